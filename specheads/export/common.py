"""What every exporter shares: the head being exported, the target parts some formats copy,
the draft layer's Llama config fields, dtype handling and the atomic directory write."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .. import atomic
from ..errors import SpecHeadsError
from ..heads.io import CONFIG_NAME, WEIGHTS_NAME, read_head_config
from ..heads.registry import HEADS
from ..heads.spec import HeadSpec
from ..target import FLOAT_DTYPES, LAYER_CONVENTION, TargetInfo

DTYPES = FLOAT_DTYPES
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Key under which exported config.json files carry our own provenance (engines ignore unknown keys).
PROVENANCE_KEY = "specheads"


@dataclass
class HeadSource:
    """A specheads head directory, read without building the module (no target needed)."""

    directory: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def read(cls, directory: str | os.PathLike) -> HeadSource:
        directory = Path(directory)
        config = read_head_config(directory)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise SpecHeadsError(f"{directory} has no {WEIGHTS_NAME}")
        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError) as err:
            raise SpecHeadsError(f"{weights} is not a readable safetensors file: {err}") from None
        return cls(directory, config, tensors)

    @property
    def family(self) -> str:
        return self.config["family"]

    @property
    def spec(self) -> HeadSpec:
        return HeadSpec.from_dict(self.config["head"])

    @property
    def info(self) -> TargetInfo:
        return TargetInfo(**{k: v for k, v in self.config["target"].items() if k in TargetInfo.__dataclass_fields__})

    @property
    def layer_ids(self) -> list[int]:
        return list(self.config.get("layer_ids") or self.spec.layer_ids)

    @property
    def default_tree(self) -> list | None:
        return self.config.get("default_tree")

    def speculative_tokens(self, requested: int | None = None) -> int:
        """The chain an engine drafts with this head (num_speculative_tokens): `requested`, refused in
        one line past the deepest position the family drafts (a P-EAGLE head's parallel_depths,
        Medusa's heads); by default that depth, else the default tree's, else 3."""
        limit = HEADS[self.family].max_draft_depth(self.spec)
        if requested is not None:
            if requested < 1 or (limit is not None and requested > limit):
                most = f"1..{limit}" if limit is not None else "at least 1"
                raise SpecHeadsError(
                    f"num_speculative_tokens={requested}: this {self.family} head drafts {most} tokens "
                    "(the positions it was trained on); an engine would draft positions it never learned"
                )
            return requested
        if limit is not None:
            return limit
        tree = self.default_tree
        return max((len(p) for p in tree), default=3) if tree else 3


@dataclass
class TargetParts:
    """Lazy access to the frozen target's embedding, LM head and tokenizer, for formats that store copies.

    `load` returns a FrozenTarget; it runs only when a format needs one of its tensors.
    """

    load: Callable[[], Any] | None = None
    gguf_file: Path | None = None  # the target's own GGUF file, when it is one (its vocabulary, as llama.cpp loads it)
    _target: Any = field(default=None, repr=False)

    def _get(self, what: str):
        if self._target is None:
            if self.load is None:
                raise SpecHeadsError(
                    f"this export needs the target's {what}: pass model=NAME (a conf/model option) "
                    "or model.path=HUB_ID_OR_DIR"
                )
            self._target = self.load()
        return self._target

    def embed_tokens(self) -> torch.Tensor:
        return self._get("embedding").embed_tokens.weight.detach().to("cpu")

    def lm_head(self) -> torch.Tensor:
        return self._get("LM head").lm_head.weight.detach().to("cpu")

    def tokenizer(self):
        return self._get("tokenizer").tokenizer


@dataclass
class ExportOptions:
    """Choices that shape one export (see conf/export.yaml for their meaning)."""

    engine: str = "auto"
    dtype: str = "auto"
    embeddings: bool | None = None  # None: the format's reference layout decides
    base_model: str | None = None  # Hub id written where engines load the target from
    verifier_architectures: list[str] | None = None
    num_speculative_tokens: int | None = None
    target: TargetParts = field(default_factory=TargetParts)


@dataclass
class Exported:
    """One format's output before it is written: config.json plus safetensors files."""

    config: dict[str, Any]
    files: dict[str, dict[str, torch.Tensor]]
    engines: list[str]  # engines this layout is written for
    notes: list[str] = field(default_factory=list)


@dataclass
class ReadBack:
    """A format read back into our own terms (no target needed)."""

    family: str
    spec: dict[str, Any]  # HeadSpec fields
    draft_fields: dict[str, Any]  # TargetInfo fields the draft layer takes from the exported config
    tensors: dict[str, torch.Tensor]  # our own state-dict names
    provenance: dict[str, Any] = field(default_factory=dict)


# -- dtypes --------------------------------------------------------------------------------------


def resolve_export_dtype(name: str, tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The float dtype of the exported weights: 'auto' keeps the head's own."""
    if name == "auto":
        floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
        return floats[0] if floats else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise SpecHeadsError(f"export dtype must be auto, {', '.join(DTYPES)}; got {name!r}") from None


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Float tensors to `dtype`; integer / bool maps (d2t, t2d) keep theirs."""
    return {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().to("cpu").contiguous() for k, v in tensors.items()
    }


# -- the draft layer's Llama config, as engines read it --------------------------------------------


def rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """Both RoPE spellings: transformers 5 `rope_parameters` and legacy `rope_theta`/`rope_scaling`.

    Older serving stacks read only the legacy pair, newer ones prefer rope_parameters.
    """
    rope = dict(rope) or {"rope_type": "default", "rope_theta": 10000.0}
    theta = float(rope.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": {**rope, "rope_theta": theta}}


def llama_layer_fields(info: TargetInfo, intermediate_size: int, num_layers: int, dtype: torch.dtype) -> dict[str, Any]:
    """The draft decoder's shape: a Llama layer with the target's width, heads and RoPE."""
    return {
        "model_type": "llama",
        "hidden_size": info.hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": info.num_attention_heads,
        "num_key_value_heads": info.num_key_value_heads,
        "head_dim": info.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": info.rms_norm_eps,
        "max_position_embeddings": info.max_position_embeddings,
        **rope_fields(info.rope_parameters),
        "vocab_size": info.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }


def draft_fields_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """TargetInfo fields the draft layer takes from an exported Llama-style config."""
    from transformers import LlamaConfig

    known = {
        k: v
        for k, v in cfg.items()
        if k
        in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
        )
    }
    if not known.get("rope_parameters"):
        known.pop("rope_parameters", None)
    parsed = LlamaConfig(**known)  # turns legacy rope_theta / rope_scaling into rope_parameters
    heads = int(cfg["num_attention_heads"])
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
        "rope_parameters": dict(parsed.rope_parameters or {}),
    }


def provenance(
    src: HeadSource, fmt: str, engines: list[str], layer_ids: list[int] | None = None, numbering: str | None = None
) -> dict[str, Any]:
    """What we know that the engine fields cannot say: our layer ids and the source head config."""
    block: dict[str, Any] = {
        "format": fmt,
        "engines": engines,
        "family": src.family,
        "layer_convention": LAYER_CONVENTION,
        "layer_ids": layer_ids if layer_ids is not None else src.layer_ids,
        "head_config": src.config,
    }
    if numbering is not None:
        block["aux_layer_numbering"] = numbering
    return block


# -- reading an exported directory ---------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpecHeadsError(f"{path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise SpecHeadsError(f"{path} does not hold a JSON object")
    return data


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise SpecHeadsError(f"{path.parent} has no {path.name}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise SpecHeadsError(f"{path} is not a readable safetensors file: {err}") from None


def tensor_meta(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype string)} from the safetensors header only (no weights loaded)."""
    out = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    except (SafetensorError, OSError) as err:
        raise SpecHeadsError(f"{path} is not a readable safetensors file: {err}") from None
    return out


# -- writing ---------------------------------------------------------------------------------------


def write_directory(out: Path, exported: Exported, extra_files: dict[str, str], check: Callable[[Path], None]) -> Path:
    """Write to a temp directory beside `out`, run `check` on it, then rename it into place.

    A failed check leaves nothing behind; an existing export at `out` is replaced whole.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SpecHeadsError(f"out={out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / CONFIG_NAME).is_file():
        raise SpecHeadsError(f"out={out} is a non-empty directory that is not an exported head; refusing to replace it")

    def fill(tmp: Path) -> None:
        for filename, tensors in exported.files.items():
            save_file(tensors, str(tmp / filename), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(exported.config, indent=2) + "\n")
        for filename, text in extra_files.items():
            (tmp / filename).write_text(text)

    return atomic.write_directory(out, fill, check)


def with_draft_fields(info: TargetInfo, fields: dict[str, Any]) -> TargetInfo:
    return replace(info, **{k: v for k, v in fields.items() if k in TargetInfo.__dataclass_fields__})


def layer_index(name: str, prefix: str) -> tuple[int, str] | None:
    """'layers.3.mlp.up_proj.weight' with prefix 'layers.' -> (3, 'mlp.up_proj.weight')."""
    if not name.startswith(prefix):
        return None
    head, _, rest = name[len(prefix) :].partition(".")
    return (int(head), rest) if head.isdigit() and rest else None


def speculators_config(algorithm: str, tokens: int, opts: ExportOptions, target_name: str) -> dict[str, Any]:
    """speculators' `speculators_config` block: one greedy proposal method of `tokens` drafts and
    the verifier (the target) it was trained against; the same for every speculators algorithm."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": opts.base_model or target_name,
            "architectures": opts.verifier_architectures or [],
        },
    }
