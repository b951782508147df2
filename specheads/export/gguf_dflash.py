"""`gguf` for the DFlash family: a DFlash, DSpark or DFlash2 head as llama.cpp's draft model, one
GGUF of architecture `dflash`, served with `-md DRAFT.gguf --spec-type draft-dflash` (DFlash,
DFlash2) or `draft-dspark` (llama.cpp b11434).

Written as llama.cpp's converter writes a DFlash-family checkpoint (convert_hf_to_gguf.py with
--target-model-dir, conversion/qwen.py DFlashModel / DSparkModel) and checked as its loader reads
one (src/models/dflash.cpp load_arch_hparams / load_arch_tensors, src/llama-model.cpp,
common/speculative.cpp common_speculative_impl_draft_dflash; validate_gguf.py):

- One architecture for the three: llama.cpp tells them apart by their tensors (markov_w1: DSpark,
  run as draft-dspark; selector_hidden: DFlash2; neither: DFlash).
- `dflash.*`: the draft layers' Qwen3 shape (block_count = the head's layers, embedding_length =
  the target's width, head counts, key/value_length = head_dim, rms eps, RoPE); `target_layers`,
  the target layers whose input llama.cpp captures (llama_set_embeddings_layer_inp): our numbering
  as it is, 0..L-1 (no target graph records the state after its last layer); `block_size`;
  `attention.causal` false (absent reads as non-causal at run time but causal in the hparams).
  DSpark: `sample_from_anchor` and `has_confidence_head`, both written since an absent one reads as
  true. DFlash2: `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`.
- The target's vocabulary (gguf_vocab.py) and `tokenizer.ggml.mask_token_id`, the id llama.cpp
  fills the block's masks with (absent, it fills them with -1). No embedding, LM head or d2t: the
  draft shares the target's, as our head does.
- Tensors: `fc`, `enc.output_norm` (hidden_norm), `output_norm` (norm), per layer `blk.{i}.attn_norm`,
  `attn_{q,k,v,output}`, `attn_q_norm`, `attn_k_norm` (our one k_norm, copied into every layer),
  `ffn_norm`, `ffn_{gate,up,down}`; DSpark `markov_w1`, `markov_w2`, `conf_proj.{weight,bias}`;
  DFlash2 `blk.{i}.{attn,ffn}_conv_base` (F32, no .weight suffix), `blk.{i}.{attn,ffn}_conv_proj`,
  `selector_{predecessor,successor,hidden}`. q/k rows stay as trained: llama.cpp rotates a DFlash
  draft NeoX-style, the halves our layers rotate (unlike its EAGLE-3 draft). The file must hold
  exactly the tensors llama.cpp creates: it refuses an extra one.

llama.cpp's draft length is its block: `--spec-draft-n-max N` decodes [last token, N masks] (N
slots from the last token for DSpark with sample_from_anchor), clamped to the trained block. The
export's note gives the N that runs the trained block; a shorter one changes every draft.
"""

from __future__ import annotations

import json
import re

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, Keys

from ..errors import SpecHeadsError
from .common import ExportOptions, HeadSource, ReadBack, provenance, resolve_export_dtype
from .gguf_file import ENGINES, LLAMACPP, PROVENANCE, ROPE_FREQS, Draft, as_ggml, file_dtype, layer_fields, rope_freqs
from .gguf_file import tensor_of as read_tensor
from .gguf_vocab import Field, vocab_fields

ARCH = "dflash"
FAMILIES = ("dflash", "dspark", "dflash2")
SPEC_TYPES = {"dflash": "draft-dflash", "dflash2": "draft-dflash", "dspark": "draft-dspark"}
MASK_TOKEN_ID = Keys.Tokenizer.MASK_ID
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# our state-dict names -> llama.cpp's (conversion/qwen.py, gguf-py tensor_mapping.py)
GLOBAL = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
K_NORM, LAYER_K_NORM = "k_norm.weight", "attn_k_norm.weight"
F32_ALWAYS = ("conv_base",)  # fed to ggml_add beside F32 coefficients; the converter keeps them F32
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


# -- what llama.cpp serves ---------------------------------------------------------------------------


def draft_length(spec, family: str) -> int:
    """--spec-draft-n-max that runs the trained block: llama.cpp decodes N + 1 slots from the last
    token (DSpark with sample_from_anchor: N), so block_size - 1 (block_size)."""
    return spec.block_size if family == "dspark" and spec.sample_from_anchor else spec.block_size - 1


def check_servable(src: HeadSource, opts: ExportOptions) -> int:
    """One line for each head llama.cpp would not draft as trained; the draft length it runs."""
    from ..heads import HEADS

    spec, info, ids, family = src.spec, src.info, src.layer_ids, src.family
    title = HEADS[family].title
    if opts.engine not in ("auto", "llama.cpp"):
        raise SpecHeadsError(f"format gguf is read by llama.cpp; engine={opts.engine} is not")
    if opts.embeddings:
        raise SpecHeadsError(
            f"a {title} head shares the target's embedding and LM head (llama.cpp's too): export it without embeddings"
        )
    bad = [k for k in ids if not 0 <= k < info.num_layers]
    if bad:
        raise SpecHeadsError(
            f"layer ids {bad}: {LLAMACPP} captures the input of target layers 0..{info.num_layers - 1}; "
            "no target graph there records the state after its last layer"
        )
    if family == "dspark":
        if spec.markov_head_type != "vanilla":
            raise SpecHeadsError(
                f"{LLAMACPP}'s DSpark Markov head is w2 . w1[previous token] (no gate_proj); this head's is "
                f"{spec.markov_head_type}: train it with head.markov_head_type=vanilla"
            )
        if spec.enable_confidence_head and not spec.confidence_head_with_markov:
            raise SpecHeadsError(
                f"{LLAMACPP}'s DSpark confidence head reads the state and the Markov embedding "
                "(conf_proj is [hidden + rank]); this one reads the state alone: train it with "
                "head.confidence_head_with_markov=true"
            )
    if family == "dflash2" and info.hidden_size < spec.selector_top_k * (spec.selector_top_k + 1):
        raise SpecHeadsError(
            f"{LLAMACPP} packs DFlash2's candidate lattice (top_k x (top_k + 1) = "
            f"{spec.selector_top_k * (spec.selector_top_k + 1)}) into one hidden-size row ({info.hidden_size}): "
            "train it with a smaller head.selector_top_k"
        )
    full = draft_length(spec, family)
    requested = opts.num_speculative_tokens
    if requested is not None and requested != full:
        raise SpecHeadsError(
            f"num_speculative_tokens={requested}: {LLAMACPP} decodes a block as long as its draft and this head "
            f"was trained on blocks of {spec.block_size}: serve it with {full} (another length changes every draft)"
        )
    return full


# -- export -------------------------------------------------------------------------------------------


def shape_fields(src: HeadSource, dtype: torch.dtype) -> list[Field]:
    spec, a = src.spec, ARCH
    u32, flag = GGUFValueType.UINT32, GGUFValueType.BOOL
    fields = layer_fields(a, src.family, src.info, dtype, spec.dflash_layers, spec.intermediate_size)
    fields += [
        (f"{a}.attention.causal", False, flag, None),
        (f"{a}.target_layers", list(src.layer_ids), GGUFValueType.ARRAY, GGUFValueType.INT32),
        (f"{a}.block_size", spec.block_size, u32, None),
    ]
    if src.family == "dspark":
        fields.append((f"{a}.sample_from_anchor", bool(spec.sample_from_anchor), flag, None))
        fields.append((f"{a}.has_confidence_head", bool(spec.enable_confidence_head), flag, None))
    if src.family == "dflash2":
        fields += [(f"{a}.{name}", int(getattr(spec, name)), u32, None) for name in DFLASH2_FIELDS]
    return fields


def engine_name(name: str) -> str:
    m = LAYER.match(name)
    if m and m.group(2) in PER_LAYER:
        return f"blk.{m.group(1)}.{PER_LAYER[m.group(2)]}"
    if name in GLOBAL:
        return GLOBAL[name]
    raise SpecHeadsError(f"{LLAMACPP}'s DFlash draft has no place for this head's tensor {name}")


def build(src: HeadSource, opts: ExportOptions) -> Draft:
    tokens = check_servable(src, opts)
    spec, info = src.spec, src.info
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    fields = shape_fields(src, dtype)
    vocab = [f for f in vocab_fields(opts.target, info.vocab_size) if f[0] != MASK_TOKEN_ID]
    fields += vocab + [(MASK_TOKEN_ID, spec.mask_token_id, GGUFValueType.UINT32, None)]
    out: dict = {}
    for name, tensor in src.tensors.items():
        if name == K_NORM:  # one parameter here, one copy per layer there
            for i in range(spec.dflash_layers):
                out[f"blk.{i}.{LAYER_K_NORM}"] = as_ggml(tensor, dtype)
            continue
        target_name = engine_name(name)
        out[target_name] = as_ggml(tensor, torch.float32 if target_name.endswith(F32_ALWAYS) else dtype)
    freqs = rope_freqs(info)
    if freqs is not None:
        out[ROPE_FREQS] = (freqs.numpy(), GGMLQuantizationType.F32)
    block = {**provenance(src, "gguf", ENGINES, src.layer_ids), "num_speculative_tokens": tokens}
    fields.append((PROVENANCE, json.dumps(block), GGUFValueType.STRING, None))
    notes = [
        f"{LLAMACPP} drafts the block as a chain: serve with --spec-type {SPEC_TYPES[src.family]} "
        f"--spec-draft-n-max {tokens} --spec-draft-p-min 0 (the trained block of {spec.block_size})"
    ]
    if src.family == "dspark" and spec.confidence_threshold > 0:
        notes.append(
            f"head.confidence_threshold={spec.confidence_threshold} is infer.py's stop on the block's cumulative "
            "confidence; llama.cpp's --spec-draft-p-min stops at the first slot whose own confidence is below it"
        )
    return Draft(ARCH, fields, out, list(ENGINES), notes)


# -- read back ----------------------------------------------------------------------------------------


def family_of(names) -> str:
    """llama.cpp's own test (dflash.cpp): the Markov head makes DSpark, the selector DFlash2."""
    if "markov_w1.weight" in names:
        return "dspark"
    return "dflash2" if "selector_hidden.weight" in names else "dflash"


def read(reader: GGUFReader, kv: dict) -> ReadBack:
    """A `dflash` GGUF in our own terms from its llama.cpp fields alone: the per-layer k_norm copies
    back to the one tied norm (they must be equal), every matrix in the file type's dtype."""
    a = ARCH
    dtype = file_dtype(kv)
    ours_global = {v: k for k, v in GLOBAL.items()}
    ours_layer = {v: k for k, v in PER_LAYER.items()}
    tensors: dict[str, torch.Tensor] = {}
    k_norms = []
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        tensor = read_tensor(t)
        m = BLK.match(t.name)
        if m and m.group(2) == LAYER_K_NORM:
            k_norms.append(tensor)
            continue
        if m and m.group(2) in ours_layer:
            name = f"layers.{m.group(1)}.{ours_layer[m.group(2)]}"
        elif t.name in ours_global:
            name = ours_global[t.name]
        else:
            raise SpecHeadsError(f"a specheads DFlash-family head has no tensor for the GGUF's {t.name}")
        tensors[name] = tensor.to(dtype)
    if not k_norms or not all(torch.equal(n, k_norms[0]) for n in k_norms):
        raise SpecHeadsError("the GGUF's layers hold different attn_k_norm weights; a specheads DFlash head ties them")
    tensors[K_NORM] = k_norms[0].to(dtype)
    family = family_of({t.name for t in reader.tensors})
    spec = {
        "family": family,
        "layer_ids": [int(k) for k in kv[f"{a}.target_layers"]],
        "dflash_layers": kv[f"{a}.block_count"],
        "intermediate_size": kv[f"{a}.feed_forward_length"],
        "block_size": kv[f"{a}.block_size"],
        "mask_token_id": kv[MASK_TOKEN_ID],
    }
    if family == "dspark":
        spec["sample_from_anchor"] = kv[f"{a}.sample_from_anchor"]
        spec["enable_confidence_head"] = kv[f"{a}.has_confidence_head"]
        spec["markov_rank"] = int(tensors["markov_head.markov_w1.weight"].shape[1])
    if family == "dflash2":
        spec.update({name: kv[f"{a}.{name}"] for name in DFLASH2_FIELDS})
    draft = {
        "num_attention_heads": kv[f"{a}.attention.head_count"],
        "num_key_value_heads": kv[f"{a}.attention.head_count_kv"],
        "head_dim": kv[f"{a}.attention.key_length"],
        "rms_norm_eps": kv[f"{a}.attention.layer_norm_rms_epsilon"],
        "max_position_embeddings": kv[f"{a}.context_length"],
    }
    return ReadBack(family, spec, draft, tensors, json.loads(kv.get(PROVENANCE, "{}")))
