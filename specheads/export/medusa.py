"""`medusa`: the FasterDecoding Medusa-1 layout that TensorRT-LLM and TGI read: config.json with
medusa_num_heads / medusa_num_layers / base_model_name_or_path and medusa_lm_head.safetensors with
{h}.{l}.linear.weight, {h}.{l}.linear.bias and {h}.{num_layers}.weight (head h's own LM head).

TensorRT-LLM (NVIDIA/TensorRT-LLM@27712aa7 models/medusa/weight.py, load_medusa_hf) reads the bias
of every ResBlock unconditionally and one LM head per head; TGI (MedusaHeadV1) the same names.
Neither has a shared-LM-head variant with several layers, so a head trained with
shared_lm_head=true is written with one copy of the target's LM head per Medusa head.
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

NAME = "medusa"
FAMILIES = ("medusa",)
WEIGHTS = "medusa_lm_head.safetensors"


def build(src: HeadSource, opts: ExportOptions) -> Exported:
    spec, info = src.spec, src.info
    if opts.engine not in ("auto", "trtllm", "tgi"):
        raise SpecHeadsError(f"format medusa is read by trtllm and tgi; engine={opts.engine} is neither")
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    shared = opts.target.lm_head() if spec.shared_lm_head else None
    out: dict[str, torch.Tensor] = {}
    for k in range(spec.num_heads):
        for l in range(spec.num_layers):
            out[f"{k}.{l}.linear.weight"] = src.tensors[f"blocks.{k}.{l}.linear.weight"]
            out[f"{k}.{l}.linear.bias"] = src.tensors[f"blocks.{k}.{l}.linear.bias"]
        # safetensors refuses tensors that share storage: each head gets its own copy
        out[f"{k}.{spec.num_layers}.weight"] = (
            shared.clone() if shared is not None else src.tensors[f"lm_heads.{k}.weight"]
        )
    notes = [f"shared LM head materialised: {spec.num_heads} copies of the target's"] if shared is not None else []
    config = {
        "medusa_num_heads": spec.num_heads,
        "medusa_num_layers": spec.num_layers,
        "base_model_name_or_path": opts.base_model or info.name,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }
    engines = ["trtllm", "tgi"]
    config[PROVENANCE_KEY] = provenance(src, NAME, engines, [])
    return Exported(config, {WEIGHTS: cast(out, dtype)}, engines, notes)


def detect(config: dict[str, Any], directory: Path) -> bool:
    return "medusa_num_heads" in config and (directory / WEIGHTS).is_file()


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    engine = read_tensors(directory / WEIGHTS)
    heads, layers = config.get("medusa_num_heads"), config.get("medusa_num_layers")
    if not isinstance(heads, int) or not isinstance(layers, int):
        raise SpecHeadsError(f"{directory}/config.json lacks medusa_num_heads / medusa_num_layers")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for k in range(heads):
            for l in range(layers):
                tensors[f"blocks.{k}.{l}.linear.weight"] = engine[f"{k}.{l}.linear.weight"]
                tensors[f"blocks.{k}.{l}.linear.bias"] = engine[f"{k}.{l}.linear.bias"]
            tensors[f"lm_heads.{k}.weight"] = engine[f"{k}.{layers}.weight"]
    except KeyError as err:
        raise SpecHeadsError(
            f"{directory}/{WEIGHTS} lacks {err.args[0]} (a Medusa-2 / 'version 2' head "
            "without per-head LM heads is not supported)"
        ) from None
    spec = {"family": "medusa", "num_heads": heads, "num_layers": layers, "shared_lm_head": False}
    return ReadBack("medusa", spec, {}, tensors, config.get(PROVENANCE_KEY) or {})
