"""`speculators`: vLLM's native speculators format for EAGLE-3 (what `speculators` save_pretrained
writes and `vllm serve <dir>` auto-detects: it loads the verifier named inside).

config.json (vllm@052316ae transformers_utils/configs/speculators/base.py, algos.py update_eagle3):
speculators_model_type, speculators_config {algorithm, proposal_methods[0].speculative_tokens,
default_proposal_method, verifier {name_or_path, architectures}}, transformer_layer_config (the
draft layer's Llama config), draft_vocab_size, norm_before_residual (absent reads as TRUE in vLLM,
so it is always written), target_hidden_size, eagle_aux_hidden_state_layer_ids in vLLM's
numbering (= ours: the residual stream entering layer k).
Weights as speculators' Eagle3DraftModel names them: fc, layers.0.{..., input_layernorm,
hidden_norm}, layers.{i}, norm, lm_head (embed_tokens only with embeddings=true); d2t/t2d only with
a reduced draft vocab (DraftVocabMixin).

A P-EAGLE head is written as speculators' `peagle` type (PEagleSpeculatorConfig: the EAGLE-3
fields plus mask_token_id and embed_requires_grad; its `mask_hidden` parameter is [1, 1, n_aux x
hidden]); vLLM serves that type as eagle3 with parallel_drafting (speculators/base.py
build_vllm_speculative_config, algos.py update_peagle: mask_token_id becomes pard_token).

A DFlash head is written as speculators' `dflash` type: speculators_dflash.py; a DSpark head as its
`dspark` type (the DFlash fields and weights plus DSpark's): speculators_dspark.py; a DFlash2 head
as its `dflash2` type (the DFlash ones plus its convolutions and candidate selector):
speculators_dflash2.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import SpecHeadsError
from . import speculators_dflash, speculators_dflash2, speculators_dspark
from .common import (
    DTYPE_NAMES,
    PROVENANCE_KEY,
    Exported,
    ExportOptions,
    HeadSource,
    ReadBack,
    cast,
    draft_fields_from_config,
    llama_layer_fields,
    provenance,
    read_tensors,
    resolve_export_dtype,
    speculators_config,
)
from .eagle3 import (
    NORM_FIELDS,
    check_capturable,
    check_parallel_export,
    check_vllm_serves,
    engine_default_ids,
    from_engine_names,
    norm_fields,
    parallel_serving_note,
    spec_fields,
    to_engine_names,
    vocab_maps,
)

NAME = "speculators"
FAMILIES = ("eagle3", "peagle", "dflash", "dspark", "dflash2")
WEIGHTS = "model.safetensors"
# The speculators release whose config schema this layout follows (src/speculators/config.py).
SPECULATORS_VERSION = "0.9.0"


def build(src: HeadSource, opts: ExportOptions) -> Exported:
    if opts.engine in ("auto", "vllm"):  # vLLM reads the target's aux layers for every algorithm
        check_vllm_serves(src.info.model_type, NAME)
    if src.family == "dflash":
        return speculators_dflash.build(src, opts, SPECULATORS_VERSION)
    if src.family == "dspark":
        return speculators_dspark.build(src, opts, SPECULATORS_VERSION)
    if src.family == "dflash2":
        return speculators_dflash2.build(src, opts, SPECULATORS_VERSION)
    spec, info = src.spec, src.info
    ids = src.layer_ids
    check_capturable(ids, info.num_layers)
    if opts.engine not in ("auto", "vllm", "speculators"):
        raise SpecHeadsError(f"format speculators is read by vllm and speculators; engine={opts.engine} is neither")
    if spec.fc_bias:
        raise SpecHeadsError(
            "the speculators format has no fc bias (Eagle3DraftModel.fc and vLLM's fc are "
            "bias-free); this head was trained with head.fc_bias=true"
        )
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    tokens = src.speculative_tokens(opts.num_speculative_tokens)
    reduced = spec.draft_vocab_size != info.vocab_size
    parallel = src.family == "peagle"
    algorithm = "peagle" if parallel else "eagle3"
    config = {
        "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators_config(algorithm, tokens, opts, info.name),
        "transformer_layer_config": llama_layer_fields(info, spec.intermediate_size, spec.num_decoder_layers, dtype),
        "draft_vocab_size": spec.draft_vocab_size,
        **norm_fields(spec),
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }
    tensors = {k: v for k, v in src.tensors.items() if reduced or k not in ("d2t", "t2d")}
    if parallel:
        check_parallel_export(src, opts)
        config.update(mask_token_id=spec.mask_token_id, embed_requires_grad=spec.train_embeddings)
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
    # Optional on both sides: vLLM shares the target's embedding when the draft has none, and
    # speculators' Eagle3DraftModel lists it in _keys_to_ignore_on_load_missing and loads it from
    # the verifier (load_verifier_weights). embeddings=true writes a self-contained copy.
    if opts.embeddings and "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = opts.target.embed_tokens()
    engines = ["vllm", "speculators"]
    config[PROVENANCE_KEY] = provenance(src, NAME, engines, ids, "vllm")
    notes = [
        f"verifier: {config['speculators_config']['verifier']['name_or_path']}; {tokens} speculative tokens by default"
    ]
    if parallel:
        notes.append(parallel_serving_note(spec))
    return Exported(config, {WEIGHTS: cast(to_engine_names(tensors, "layers.0"), dtype)}, engines, notes)


def detect(config: dict[str, Any], directory: Path) -> bool:
    return config.get("speculators_model_type") in ("eagle3", "peagle", "dflash", "dspark", "dflash2")


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    kind = config.get("speculators_model_type")
    if kind == "dflash":
        return speculators_dflash.read(directory, config, num_layers, numbering)
    if kind == "dspark":
        return speculators_dspark.read(directory, config, num_layers, numbering)
    if kind == "dflash2":
        return speculators_dflash2.read(directory, config, num_layers, numbering)
    if kind not in ("eagle3", "peagle"):
        raise SpecHeadsError(
            f"{directory}: speculators_model_type {kind!r} is not one specheads reads (eagle3, peagle, dflash, dspark, "
            "dflash2)"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecHeadsError(f"{directory}/config.json: transformer_layer_config must be a dict")
    engine_tensors = read_tensors(directory / WEIGHTS)
    tensors = from_engine_names(engine_tensors, keep_embeddings="mask_hidden" in engine_tensors)
    block = config.get(PROVENANCE_KEY) or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or block.get("layer_ids")
    if not ids:
        ids = engine_default_ids(num_layers)
    merged = {
        **layer,
        **{k: config[k] for k in (*NORM_FIELDS, "fc_norm") if k in config},
        "draft_vocab_size": config.get("draft_vocab_size") or layer.get("vocab_size"),
        "mask_token_id": config.get("mask_token_id"),
    }
    # vLLM reads an absent norm_before_residual in a speculators config as true (algos.py)
    spec = spec_fields(merged, tensors, [int(k) for k in ids], absent_residual=True)
    tensors.update(vocab_maps(tensors, int(layer["vocab_size"]), spec["draft_vocab_size"]))
    return ReadBack(spec["family"], spec, draft_fields_from_config(layer), tensors, block)
