"""`eagle3`: the research EAGLE-3 directory (SpecForge / yuhuili layout) that SGLang, vLLM and
TensorRT-LLM's PyTorch backend load: config.json with architectures ["LlamaForCausalLMEagle3"]
and one model.safetensors with fc / midlayer.* / norm / lm_head / d2t / t2d.

Aux-layer numbering is where engines disagree. vLLM reads eagle_aux_hidden_state_layer_ids as
"capture the residual stream entering layer k" (our convention); SGLang adds 1 to explicit ids
(set_eagle3_layers_to_capture: `[val + 1 for val in layer_ids]`, sglang llama.py), i.e. reads them
as "output of layer k". Both default to [2, L//2, L-3] entering-layer ids when the field is absent,
so a head on those layers is written without the field and loads the same in both.

A P-EAGLE head is the same directory plus `mask_hidden` (the learned feature of the positions
after the first, n_aux x hidden values) and `mask_token_id` in config.json, which vLLM reads when
served with `{"method": "eagle3", "parallel_drafting": true}` (llama_eagle3.py load_weights,
llm_base_proposer._init_parallel_drafting_params); SGLang has no parallel drafting, so it is
written for vLLM only. A P-EAGLE head that trained its own embedding carries it as embed_tokens.
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

NAME = "eagle3"
FAMILIES = ("eagle3", "peagle")
WEIGHTS = "model.safetensors"


# -- layer ids -------------------------------------------------------------------------------------


def engine_default_ids(num_layers: int) -> list[int]:
    """vLLM (eagle3_utils get_eagle3_aux_layers_from_config fallback) and SGLang
    (set_eagle3_layers_to_capture with no ids) both capture [2, L//2, L-3] entering-layer ids."""
    return [2, num_layers // 2, num_layers - 3]


def check_capturable(layer_ids: list[int], num_layers: int) -> None:
    """The engines' Llama targets capture inside their layer loop, before layer k runs."""
    if len(layer_ids) != 3:
        raise SpecHeadsError(
            f"vLLM and SGLang fuse exactly 3 target layers (fc reads 3 x hidden); this head fuses "
            f"{len(layer_ids)} ({layer_ids}): train it with head.layer_ids=[low,mid,high]"
        )
    bad = [k for k in layer_ids if not 1 <= k <= num_layers - 1]
    if bad:
        raise SpecHeadsError(
            f"layer ids {bad} cannot be captured by vLLM/SGLang (they capture the stream entering "
            f"layers 1..{num_layers - 1} of a {num_layers}-layer target)"
        )


# The target types of specheads.tiny and the vLLM class that serves each (vLLM 0.32.0's model
# registry), with whether it serves EAGLE-3 drafts: only a class with SupportsEagle3 among its bases
# records the aux layers' states (set_aux_hidden_state_layers); vLLM stops at load otherwise
# ("Model does not support EAGLE3 interface"). tests/export/test_vllm_targets.py reads the wheel's
# source to keep this true. Types not listed are not refused.
VLLM_VERSION = "0.32.0"
VLLM_TARGETS = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", True),
    "qwen3": ("Qwen3ForCausalLM", True),
    "gemma": ("GemmaForCausalLM", False),
    "qwen3_moe": ("Qwen3MoeForCausalLM", True),
    "mixtral": ("MixtralForCausalLM", False),
    "deepseek_v3": ("DeepseekV3ForCausalLM", True),
    "gpt_oss": ("GptOssForCausalLM", True),
    "llama4_text": ("Llama4ForCausalLM", True),
    "gemma3_text": ("Gemma3ForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", True),
    "olmo2": ("Olmo2ForCausalLM", True),  # through vLLM's Transformers backend
    "smollm3": ("SmolLM3ForCausalLM", True),  # through vLLM's Transformers backend
    "qwen3_next": ("Qwen3NextForCausalLM", True),
    "falcon_h1": ("FalconH1ForCausalLM", False),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", False),
}


def check_vllm_serves(model_type: str, fmt: str) -> None:
    """One line refusing an export for vLLM of a head whose target vLLM serves no EAGLE-3 draft for."""
    architecture, served = VLLM_TARGETS.get(model_type, (None, True))
    if not served:
        instead = " (engine=sglang writes SGLang's layout alone)" if fmt == "eagle3" else ""
        raise SpecHeadsError(
            f"vLLM {VLLM_VERSION} serves no EAGLE-3 draft for a {model_type} target: its {architecture} lacks "
            f"SupportsEagle3 (it cannot record the aux layers' states); format={fmt} is not written for vLLM{instead}"
        )


def sglang_ids(layer_ids: list[int]) -> list[int]:
    return [k - 1 for k in layer_ids]


# -- weight names ------------------------------------------------------------------------------------


def to_engine_names(tensors: dict[str, torch.Tensor], layer0: str) -> dict[str, torch.Tensor]:
    """Our EAGLE-3 state dict -> engine names; layer 0 under `layer0` ('midlayer' or 'layers.0')."""
    out = {}
    for name, t in tensors.items():
        if name == "input_norm.weight":
            out[f"{layer0}.input_layernorm.weight"] = t
        elif name == "fc_input_norm.weight":  # norm_before_fc
            out["input_norm.weight"] = t
        elif name == "hidden_norm.weight":
            out[f"{layer0}.hidden_norm.weight"] = t
        elif (idx := layer_index(name, "layers.")) is not None:
            i, rest = idx
            out[f"{layer0}.{rest}" if i == 0 else f"layers.{i}.{rest}"] = t
        elif (idx := layer_index(name, "extra_input_norms.")) is not None:
            out[f"layers.{idx[0] + 1}.input_layernorm.weight"] = t
        else:  # fc.*, norm.weight, lm_head.weight, d2t, t2d
            out[name] = t
    return out


def from_engine_names(tensors: dict[str, torch.Tensor], keep_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """Engine names (midlayer.* or layers.0.*) -> our EAGLE-3 state dict; drops embed_tokens (the
    target's copy) unless keep_embeddings (a P-EAGLE head's own trained embedding)."""
    out = {}
    for name, t in tensors.items():
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        if name == "layers.0.input_layernorm.weight":
            out["input_norm.weight"] = t
        elif name == "input_norm.weight":  # the engines' norm before fc (norm_before_fc)
            out["fc_input_norm.weight"] = t
        elif name.startswith("fc_norm."):
            raise SpecHeadsError(
                "this checkpoint normalises each target layer's state on its own before fc (fc_norm.*, speculators' "
                "--fc-norm); specheads heads have one norm over all of them (norm_before_fc): not read"
            )
        elif name == "layers.0.hidden_norm.weight":
            out["hidden_norm.weight"] = t
        elif (idx := layer_index(name, "layers.")) is not None and idx[0] > 0 and idx[1] == "input_layernorm.weight":
            out[f"extra_input_norms.{idx[0] - 1}.weight"] = t
        elif name == "mask_hidden":
            out[name] = t.flatten()  # speculators keeps it as [1, 1, n], vLLM views it as [1, n]
        elif name == "embed_tokens.weight" and keep_embeddings:
            out["embed_tokens.weight"] = t
        elif name == "embed_tokens.weight" or name.endswith("hidden_norm.weight"):
            continue  # the target's embedding; vLLM builds unused hidden_norms for layers >= 1
        else:
            out[name] = t
    return out


def vocab_maps(tensors: dict[str, torch.Tensor], vocab: int, draft_vocab: int) -> dict[str, torch.Tensor]:
    """d2t / t2d as our head stores them; rebuilt when a format leaves them out (full vocab)."""
    d2t = tensors.get("d2t")
    if d2t is None:
        if draft_vocab != vocab:
            raise SpecHeadsError("a reduced draft vocabulary needs d2t in the checkpoint")
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
    d2t = d2t.long()
    t2d = tensors.get("t2d")
    if t2d is None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + d2t] = True
    return {"d2t": d2t, "t2d": t2d.bool()}


# -- export ----------------------------------------------------------------------------------------


def eagle3_fields(src: HeadSource, dtype: torch.dtype) -> dict[str, Any]:
    spec, info = src.spec, src.info
    return {
        **llama_layer_fields(info, spec.intermediate_size, spec.num_decoder_layers, dtype),
        "draft_vocab_size": spec.draft_vocab_size,
        **norm_fields(spec),
    }


# The EAGLE-3 variants both vLLM (llama_eagle3.py, speculators/algos.py) and speculators read from
# config.json, as our HeadSpec names them. Always written: vLLM reads an absent
# norm_before_residual in a speculators config as true.
NORM_FIELDS = ("norm_before_fc", "norm_before_residual", "norm_output")
# what SGLang's EAGLE-3 draft reads of them (norm_before_residual only)
SGLANG_NORM_FIELDS = ("norm_before_residual",)


def norm_fields(spec) -> dict[str, bool]:
    return {name: bool(getattr(spec, name)) for name in NORM_FIELDS}


def norm_fields_from_config(config: dict[str, Any], absent_residual: bool) -> dict[str, bool]:
    """The variants a checkpoint's config.json says; `absent_residual`: how its reader takes a
    missing norm_before_residual (vLLM: true in a speculators config, false in an eagle3 one)."""
    if config.get("fc_norm"):
        raise SpecHeadsError(
            "this checkpoint has fc_norm=true (a norm per target layer before fc, speculators' --fc-norm); "
            "specheads heads have one norm over all of them (norm_before_fc): not read"
        )
    fields = {name: bool(config.get(name, False)) for name in NORM_FIELDS}
    fields["norm_before_residual"] = bool(config.get("norm_before_residual", absent_residual))
    return fields


def build(src: HeadSource, opts: ExportOptions) -> Exported:
    spec, info = src.spec, src.info
    ids = src.layer_ids
    check_capturable(ids, info.num_layers)
    default = ids == engine_default_ids(info.num_layers)
    engine = opts.engine
    if engine not in ("auto", "vllm", "sglang"):
        raise SpecHeadsError(f"format eagle3 is read by vllm and sglang; engine={engine} is neither")
    if engine != "sglang":
        check_vllm_serves(info.model_type, NAME)
    parallel = src.family == "peagle"
    if not default and engine == "auto" and not parallel:
        raise SpecHeadsError(
            f"this head reads target layers {ids} (entering-layer ids), not the engines' default "
            f"{engine_default_ids(info.num_layers)}; vLLM and SGLang number explicit ids differently "
            "(SGLang adds 1): choose engine=vllm or engine=sglang, or use format=speculators for vLLM"
        )
    if spec.fc_bias:
        # vLLM's fc is bias-free; SGLang takes the fc bias from config "bias", which its Llama
        # attention also reads, so no engine loads an EAGLE-3 fc bias without side effects.
        raise SpecHeadsError(
            "this EAGLE-3 head has an fc bias, which vLLM and SGLang cannot load; train it with head.fc_bias=false"
        )
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
    config = {"architectures": ["LlamaForCausalLMEagle3"], **eagle3_fields(src, dtype)}
    notes = []
    vllm_only = [k for k in NORM_FIELDS if k not in SGLANG_NORM_FIELDS and getattr(spec, k)]
    if vllm_only and engine == "sglang":
        raise SpecHeadsError(
            f"SGLang's EAGLE-3 draft does not read {', '.join(vllm_only)}: it would draft this head wrongly; "
            "export it for vLLM (engine=vllm or format=speculators)"
        )
    if parallel:
        check_parallel_export(src, opts)
        config["mask_token_id"] = spec.mask_token_id
        notes.append(parallel_serving_note(spec))
    if default and parallel:
        engines, numbering = ["vllm"], None
        notes.append(f"layer ids {ids} are vLLM's default: eagle_aux_hidden_state_layer_ids left out")
    elif default and vllm_only:
        engines, numbering = ["vllm"], None
        notes.append(f"for vLLM only: SGLang does not read {', '.join(vllm_only)}")
    elif default:
        engines, numbering = ["vllm", "sglang"], None
        notes.append(f"layer ids {ids} are both engines' default: eagle_aux_hidden_state_layer_ids left out")
    elif engine == "vllm" or parallel:
        engines, numbering = ["vllm"], "vllm"
        config["eagle_aux_hidden_state_layer_ids"] = list(ids)
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(ids)
        notes.append(
            f"aux layer ids {ids} written in vLLM's numbering (entering layer k); SGLang would capture one layer later"
        )
    else:
        engines, numbering = ["sglang"], "sglang"
        eagle_config["eagle_aux_hidden_state_layer_ids"] = sglang_ids(ids)
        notes.append(
            f"aux layer ids written in SGLang's numbering ({sglang_ids(ids)}: output of layer k, "
            "SGLang adds 1); vLLM would capture one layer earlier"
        )
        if ids[0] != 2:
            notes.append(
                "SGLang versions that add 1 only when the first id is 1 (sglang PR #25454) "
                f"would read these ids one layer early; first id here is {ids[0] - 1}"
            )
    config["eagle_config"] = eagle_config
    tensors = dict(src.tensors)
    if opts.embeddings and "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = opts.target.embed_tokens()
    out = cast(to_engine_names(tensors, "midlayer"), dtype)
    config[PROVENANCE_KEY] = provenance(src, NAME, engines, ids, numbering)
    return Exported(config, {WEIGHTS: out}, engines, notes)


def check_parallel_export(src: HeadSource, opts: ExportOptions) -> None:
    """A P-EAGLE head with the target's frozen embedding must not carry a copy of it: read back,
    the copy would say the head trained its own."""
    if opts.engine == "sglang":
        raise SpecHeadsError("SGLang has no parallel drafting: a peagle head is exported for vLLM (engine=vllm)")
    if opts.embeddings and not src.spec.train_embeddings:
        raise SpecHeadsError(
            "this P-EAGLE head reads the target's embedding (head.train_embeddings=false): vLLM shares the "
            "target's, so export it without embeddings=true"
        )


def parallel_serving_note(spec) -> str:
    return (
        f'P-EAGLE: serve with speculative_config {{"method": "eagle3", "parallel_drafting": true, '
        f'"num_speculative_tokens": K}}, K <= {spec.parallel_depths} (the positions it was trained on); '
        f"mask token id {spec.mask_token_id}"
    )


# -- read back -------------------------------------------------------------------------------------


def detect(config: dict[str, Any], directory: Path) -> bool:
    archs = config.get("architectures") or []
    return "speculators_model_type" not in config and any(
        a in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM") for a in archs
    )


def our_layer_ids(config: dict[str, Any], num_layers: int, numbering: str | None) -> list[int]:
    """Entering-layer ids from an EAGLE-3 research config.

    Our own exports record the numbering they used. For other checkpoints: no ids means the
    engines' default; ids at the top level are vLLM's (capture-before) numbering; ids only inside
    eagle_config are SGLang/SpecForge's (output-of-layer) numbering. `numbering` overrides that.
    """
    block = config.get(PROVENANCE_KEY) or {}
    if block.get("layer_ids") and numbering is None:
        return list(block["layer_ids"])
    eagle = config.get("eagle_config") or {}
    top = config.get("eagle_aux_hidden_state_layer_ids")
    ids = top or eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return engine_default_ids(num_layers)
    numbering = numbering or ("vllm" if top else "sglang")
    if numbering not in ("vllm", "sglang"):
        raise SpecHeadsError(f"layer-id numbering must be vllm or sglang, got {numbering!r}")
    return [int(k) + (1 if numbering == "sglang" else 0) for k in ids]


def spec_fields(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], layer_ids: list[int], absent_residual: bool = False
) -> dict[str, Any]:
    """The head fields the engine config says; a `mask_hidden` tensor makes it a P-EAGLE head."""
    norms = norm_fields_from_config(config, absent_residual)
    if norms["norm_before_fc"] != ("fc_input_norm.weight" in tensors):
        raise SpecHeadsError(
            f"config.json says norm_before_fc={str(norms['norm_before_fc']).lower()} but the weights "
            f"{'lack' if norms['norm_before_fc'] else 'hold'} input_norm.weight (the norm before fc)"
        )
    fields = {
        **norms,
        "family": "eagle3",
        "layer_ids": layer_ids,
        "num_decoder_layers": int(config.get("num_hidden_layers", 1)),
        "intermediate_size": int(config["intermediate_size"]),
        "fc_bias": "fc.bias" in tensors,
        "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"]),
    }
    if "mask_hidden" in tensors:
        mask = mask_token_of(config)
        if mask is None:
            raise SpecHeadsError("a checkpoint with mask_hidden (P-EAGLE) needs mask_token_id in its config.json")
        fields.update(family="peagle", mask_token_id=mask, train_embeddings="embed_tokens.weight" in tensors)
    return fields


def mask_token_of(config: dict[str, Any]) -> int | None:
    """The parallel-drafting mask id, where vLLM looks for it (llm_base_proposer, in that order)."""
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for value in (dflash.get("mask_token_id"), config.get("mask_token_id"), config.get("pard_token")):
        if value is not None:
            return int(value)
    return None


def read(directory: Path, config: dict[str, Any], num_layers: int, numbering: str | None = None) -> ReadBack:
    engine_tensors = read_tensors(directory / WEIGHTS)
    # a P-EAGLE checkpoint's embedding is its own trained one; an EAGLE-3 one's the target's copy
    tensors = from_engine_names(engine_tensors, keep_embeddings="mask_hidden" in engine_tensors)
    ids = our_layer_ids(config, num_layers, numbering)
    spec = spec_fields(config, tensors, ids)
    tensors.update(vocab_maps(tensors, int(config["vocab_size"]), spec["draft_vocab_size"]))
    return ReadBack(spec["family"], spec, draft_fields_from_config(config), tensors, config.get(PROVENANCE_KEY) or {})
