"""Make a draft model from a target: its first N decoder layers with its final norm and LM head,
saved as a standalone transformers model directory (specheads.decode.draft_model.make_draft_model).

    python tools/make_draft_model.py --model smollm2-135m --layers 4 --out runs/drafts/smollm2-135m-4l
    python infer.py model=smollm2-135m draft.model=runs/drafts/smollm2-135m-4l prompt="Why is the sky blue?"

--model is a conf/model option (smollm2-135m: the embedded target; tiny-random), a Hub id or a local
directory. The directory holds config.json (num_hidden_layers = N), model.safetensors, the target's
tokenizer and specheads_draft.json (where the layers came from); it is written atomically and checked
before it is put in place: it loads with AutoModelForCausalLM and its logits equal the target's first
N layers + final norm + LM head. Prints the directory last. Docs: docs/draft-models.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from specheads.config.model import ModelConfig  # noqa: E402
from specheads.errors import SpecHeadsError, one_line_errors  # noqa: E402


def model_config(name: str, dtype: str) -> ModelConfig:
    """A conf/model option by its name, else `name` as a Hub id or local directory."""
    option = ROOT / "conf" / "model" / f"{name}.yaml"
    if option.is_file():
        data = OmegaConf.load(option)
        data.pop("defaults", None)
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), data))
    else:
        cfg = ModelConfig(name=Path(name).name or name, path=name)
    cfg.dtype = dtype
    return cfg


@one_line_errors
def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="conf/model option, Hub id or directory")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers kept (1 .. the target's - 1)")
    parser.add_argument("--out", required=True, help="the draft model directory to write")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    args = parser.parse_args(argv)
    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise SpecHeadsError(f"--dtype must be float32, bfloat16 or float16, got {args.dtype!r}")
    import torch

    from specheads.decode.draft_model import make_draft_model
    from specheads.target import load_target

    cfg = model_config(args.model, args.dtype)
    target = load_target(cfg, torch.device("cpu"))
    out = make_draft_model(target, args.layers, args.out)
    print(out, flush=True)
    return out


if __name__ == "__main__":
    main()
