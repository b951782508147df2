"""`vllm-medusa`: vLLM's MedusaModel draft directory (speculative_config method "medusa").

config.json (vllm@0531c222 transformers_utils/configs/medusa.py): model_type "medusa",
architectures ["MedusaModel"], hidden_size, vocab_size, num_heads, num_hidden_layers (ResBlocks per
head). Weights (vllm@01dbb081 model_executor/models/medusa.py): blocks.{h}.layers.{l}.weight/.bias,
lm_heads.{h}.weight, or one lm_head.weight with original_lm_head=true.

The bias trap: vLLM builds the ResBlock linears with bias=config.medusa_fc_bias (default False) and
silently skips checkpoint keys it has no parameter for, so Medusa ResBlocks (which have a bias) must
say medusa_fc_bias=true or their biases vanish. A head with shared_lm_head=true is written with
original_lm_head=true and one copy of the target's LM head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import SpecHeadsError
from .common import (
    DTYPE_NAMES,
    PROVENANCE_KEY,
    Exported,
    ExportOptions,
    HeadSource,
    ReadBack,
    cast,
    provenance,
    read_tensors,
    resolve_export_dtype,
)

NAME = "vllm-medusa"
FAMILIES = ("medusa",)
WEIGHTS = "model.safetensors"


def build(src: HeadSource, opts: ExportOptions) -> Exported:
    spec, info = src.spec, src.info
    if opts.engine not in ("auto", "vllm"):
        raise SpecHeadsError(f"format vllm-medusa is read by vllm only; engine={opts.engine}")
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    out: dict[str, torch.Tensor] = {}
    for k in range(spec.num_heads):
        for l in range(spec.num_layers):
            out[f"blocks.{k}.layers.{l}.weight"] = src.tensors[f"blocks.{k}.{l}.linear.weight"]
            out[f"blocks.{k}.layers.{l}.bias"] = src.tensors[f"blocks.{k}.{l}.linear.bias"]
        if not spec.shared_lm_head:
            out[f"lm_heads.{k}.weight"] = src.tensors[f"lm_heads.{k}.weight"]
    notes = []
    if spec.shared_lm_head:
        out["lm_head.weight"] = opts.target.lm_head()
        notes.append("shared LM head: written once from the target (original_lm_head=true)")
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "num_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": bool(spec.shared_lm_head),
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }
    engines = ["vllm"]
    config[PROVENANCE_KEY] = provenance(src, NAME, engines, [])
    return Exported(config, {WEIGHTS: cast(out, dtype)}, engines, notes)


def detect(config: dict[str, Any], directory: Path) -> bool:
    return config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or [])


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    engine = read_tensors(directory / WEIGHTS)
    engine = {k.removeprefix("medusa_heads."): v for k, v in engine.items()}
    heads = next((config[k] for k in config if "num" in k and "heads" in k), None)
    layers = next((config[k] for k in config if "num" in k and "layers" in k), None)
    if not isinstance(heads, int) or not isinstance(layers, int):
        raise SpecHeadsError(f"{directory}/config.json lacks num_heads / num_hidden_layers")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for k in range(heads):
            for l in range(layers):
                tensors[f"blocks.{k}.{l}.linear.weight"] = engine[f"blocks.{k}.layers.{l}.weight"]
                bias = engine.get(f"blocks.{k}.layers.{l}.bias")
                tensors[f"blocks.{k}.{l}.linear.bias"] = (
                    bias
                    if bias is not None and config.get("medusa_fc_bias")
                    else torch.zeros(int(config["hidden_size"]))
                )
            lm = engine.get(f"lm_heads.{k}.weight")
            if config.get("original_lm_head"):
                lm = engine.get("lm_head.weight", engine.get("lm_heads.0.weight"))
            tensors[f"lm_heads.{k}.weight"] = lm if lm is not None else engine[f"lm_heads.{k}.weight"]
    except KeyError as err:
        raise SpecHeadsError(f"{directory}/{WEIGHTS} lacks {err.args[0]}") from None
    spec = {"family": "medusa", "num_heads": heads, "num_layers": layers, "shared_lm_head": False}
    return ReadBack("medusa", spec, {}, tensors, config.get(PROVENANCE_KEY) or {})
