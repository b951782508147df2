"""`eagle`: the EAGLE-1 layout that vLLM (method "eagle") and SGLang (--speculative-algorithm EAGLE)
load: fc over cat(embedding, feature), layers.{i}.* Llama layers (layer 0 without input_layernorm),
no final norm and no lm_head (both engines use the target's LM head).

- architectures lists "LlamaForCausalLMEagle" (SGLang's EntryClass, picked first) and
  "LlamaForCausalLM" (vLLM's EAGLEConfig prefixes "Eagle": EagleLlamaForCausalLM).
- fc bias: SGLang's fc is nn.Linear(2H, H) with a bias, so fc.bias is always written (zeros for a
  bias-free head: the same function). vLLM's fc has no bias: vllm@00da9231 drops the key, older
  e1c4a552 refuses it; a head trained with a real bias cannot be served by vLLM.
- embed_tokens is the target's (frozen) embedding, copied by default like the original EAGLE-1
  checkpoints: vLLM loads it with pipeline parallelism > 1, otherwise both engines share the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import SpecHeadsError
from .common import (
    PROVENANCE_KEY,
    Exported,
    ExportOptions,
    HeadSource,
    ReadBack,
    cast,
    draft_fields_from_config,
    layer_index,
    llama_layer_fields,
    provenance,
    read_tensors,
    resolve_export_dtype,
)

NAME = "eagle"
FAMILIES = ("eagle",)
WEIGHTS = "model.safetensors"


def to_engine_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if (idx := layer_index(name, "extra_input_norms.")) is not None:
            out[f"layers.{idx[0] + 1}.input_layernorm.weight"] = t
        else:  # fc.*, layers.{i}.*
            out[name] = t
    return out


def from_engine_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        idx = layer_index(name, "layers.")
        if idx is not None and idx[1] == "input_layernorm.weight":
            if idx[0] == 0:
                raise SpecHeadsError(
                    "layers.0.input_layernorm in an EAGLE-1 checkpoint: its layer 0 "
                    "has no input norm (is this an EAGLE-3 head?)"
                )
            out[f"extra_input_norms.{idx[0] - 1}.weight"] = t
        elif name in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
            continue  # the target's own parts
        else:
            out[name] = t
    return out


def build(src: HeadSource, opts: ExportOptions) -> Exported:
    spec, info = src.spec, src.info
    if opts.engine not in ("auto", "vllm", "sglang"):
        raise SpecHeadsError(f"format eagle is read by vllm and sglang; engine={opts.engine} is neither")
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    tensors = dict(src.tensors)
    if "fc.bias" not in tensors:
        tensors["fc.bias"] = torch.zeros(info.hidden_size, dtype=tensors["fc.weight"].dtype)
    embeddings = True if opts.embeddings is None else opts.embeddings
    if embeddings:
        tensors["embed_tokens.weight"] = opts.target.embed_tokens()
    engines = ["sglang"] + ([] if spec.fc_bias and bool(src.tensors["fc.bias"].any()) else ["vllm"])
    notes = (
        []
        if "vllm" in engines
        else [
            "fc has a non-zero bias: vLLM's EAGLE-1 fc has none, so only SGLang serves this head "
            "(train with head.fc_bias=false for vLLM)"
        ]
    )
    config = {
        "architectures": ["LlamaForCausalLMEagle", "LlamaForCausalLM"],
        **llama_layer_fields(info, spec.intermediate_size, spec.num_decoder_layers, dtype),
    }
    config[PROVENANCE_KEY] = provenance(src, NAME, engines, [])
    return Exported(config, {WEIGHTS: cast(to_engine_names(tensors), dtype)}, engines, notes)


def detect(config: dict[str, Any], directory: Path) -> bool:
    archs = config.get("architectures") or []
    if any(a in ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM") for a in archs):
        return True
    # yuhuili EAGLE-1 uploads say LlamaForCausalLM: recognise them by their fc
    return (
        archs == ["LlamaForCausalLM"]
        and config.get("num_hidden_layers", 99) <= 2
        and (directory / WEIGHTS).is_file()
        and "draft_vocab_size" not in config
    )


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    tensors = from_engine_names(read_tensors(directory / WEIGHTS))
    if "fc.weight" not in tensors:
        raise SpecHeadsError(f"{directory} has no fc.weight: not an EAGLE-1 head")
    bias = tensors.get("fc.bias")
    if bias is not None and not bool(bias.any()):
        del tensors["fc.bias"]  # written as zeros for SGLang: the head itself has none
    spec = {
        "family": "eagle",
        "layer_ids": [],
        "num_decoder_layers": int(config.get("num_hidden_layers", 1)),
        "intermediate_size": int(config["intermediate_size"]),
        "fc_bias": "fc.bias" in tensors,
    }
    return ReadBack("eagle", spec, draft_fields_from_config(config), tensors, config.get(PROVENANCE_KEY) or {})
