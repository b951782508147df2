"""`gguf`: a head as llama.cpp's draft model, one GGUF file (llama.cpp b11434). An EAGLE-3 head is
served with `-md DRAFT.gguf --spec-type draft-eagle3` (this module); DFlash, DSpark and DFlash2
heads as architecture `dflash` (gguf_dflash.py).

Written as llama.cpp's converter writes an EAGLE-3 checkpoint (convert_hf_to_gguf.py with
--target-model-dir, conversion/llama.py) and checked as its loader reads one (src/models/eagle3.cpp,
src/llama-model.cpp; validate_gguf.py):

- architecture `eagle3`; the draft layer's Llama shape under `eagle3.*` (context_length,
  embedding_length, block_count 1, feed_forward_length, attention.head_count(_kv), key/value_length,
  layer_norm_rms_epsilon, rope.*, vocab_size);
- `eagle3.target_layers`: the 3 target layers (int32), in our numbering: llama.cpp captures the
  input of target layer k (llama_set_embeddings_layer_inp), the stream entering layer k;
  `eagle3.target_hidden_size`, `eagle3.norm_before_residual`, `eagle3.norm_before_fc`;
- the target's vocabulary (tokenizer.ggml.*, gguf_vocab.py): the draft's logits are laid out over it;
- tensors `fc`, `blk.0.{attn_norm (input_layernorm), attn_norm_2 (hidden_norm), attn_q, attn_k,
  attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}`, `output_norm`, `output` (lm_head),
  `enc.output_norm` (norm_before_fc), `d2t` as absolute target ids (I64; t2d is not read),
  `token_embd` with embeddings=true only (else the target's is used), `rope_freqs` for llama3 RoPE.
  attn_q / attn_k rows are permuted per head: llama.cpp rotates adjacent pairs, Hugging Face
  Llama the two halves. Norms stay F32, as the converter keeps 1-D tensors.

Our provenance (the source head config) rides in `specheads.provenance`, which llama.cpp ignores.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from ..errors import SpecHeadsError
from . import gguf_dflash
from .common import ExportOptions, HeadSource, ReadBack, provenance, resolve_export_dtype
from .eagle3 import spec_fields, vocab_maps
from .gguf_file import (
    ENGINES,
    LLAMACPP,
    PROVENANCE,
    ROPE_FREQS,
    Draft,
    as_ggml,
    file_dtype,
    layer_fields,
    rope_freqs,
    tensor_of,
    values,
    write,  # noqa: F401  (the format's writer, for both architectures: exporter.export_file)
)
from .gguf_vocab import vocab_fields

NAME = "gguf"
FAMILIES = ("eagle3", *gguf_dflash.FAMILIES)
SINGLE_FILE = True  # one file at `out`, not a directory
ARCH = "eagle3"
REFUSED = {
    "peagle": (
        f"{LLAMACPP} has no parallel drafting (its EAGLE-3 draft runs one token per step and reads no "
        "mask_hidden): a P-EAGLE head is served by vLLM (format=eagle3 or speculators)"
    )
}

# our EAGLE-3 state-dict names -> llama.cpp's tensor names (conversion/llama.py, gguf constants)
TENSORS = {
    "fc.weight": "fc.weight",
    "fc_input_norm.weight": "enc.output_norm.weight",
    "input_norm.weight": "blk.0.attn_norm.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
}


# -- what llama.cpp serves ---------------------------------------------------------------------------


def check_servable(src: HeadSource, opts: ExportOptions) -> int:
    """One line for each head llama.cpp would not draft as trained; the chain length it drafts."""
    spec, info, ids = src.spec, src.info, src.layer_ids
    if opts.engine not in ("auto", "llama.cpp"):
        raise SpecHeadsError(f"format gguf is read by llama.cpp; engine={opts.engine} is not")
    if len(ids) != 3:
        raise SpecHeadsError(
            f"{LLAMACPP} fuses exactly 3 target layers (it checks eagle3.target_layers at load); this head "
            f"fuses {len(ids)} ({ids}): train it with head.layer_ids=[low,mid,high]"
        )
    if any(not 0 <= k < info.num_layers for k in ids):
        raise SpecHeadsError(
            f"layer ids {ids}: {LLAMACPP} captures the input of target layers 0..{info.num_layers - 1}; "
            f"a Llama target records no state after its last layer"
        )
    if spec.num_decoder_layers != 1:
        raise SpecHeadsError(
            f"{LLAMACPP}'s EAGLE-3 draft has one decoder layer; this head has {spec.num_decoder_layers}"
        )
    if spec.fc_bias:
        raise SpecHeadsError(
            f"this EAGLE-3 head has an fc bias, which {LLAMACPP} does not load (its fc has none); "
            "train it with head.fc_bias=false"
        )
    if spec.norm_output:
        raise SpecHeadsError(
            f"this head feeds each step its final-normed state (head.norm_output=true); {LLAMACPP} feeds "
            "the state before the final norm: it would draft another function (vLLM serves it: format=speculators)"
        )
    tree = src.default_tree or []
    if branches(tree) and opts.num_speculative_tokens is None:
        depth = max(len(p) for p in tree)
        raise SpecHeadsError(
            f"this head's default tree branches ({len(tree)} nodes); {LLAMACPP} drafts a chain only and would "
            f"ignore it: pass num_speculative_tokens=K (e.g. {depth}, its depth) to export it for a chain of K"
        )
    return src.speculative_tokens(opts.num_speculative_tokens)


def branches(tree: list) -> bool:
    """Whether a tree's paths leave the top-1 chain somewhere (a rank other than 0)."""
    return any(any(i != 0 for i in path) for path in tree)


# -- tensors ------------------------------------------------------------------------------------------


def rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from Hugging Face's rotate-half order (each head: first halves, then second halves)
    into llama.cpp's adjacent pairs (LLAMA_ROPE_TYPE_NORM)."""
    out, cols = weight.shape
    return weight.reshape(heads, 2, out // heads // 2, cols).transpose(1, 2).reshape(out, cols)


def unrope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    out, cols = weight.shape
    return weight.reshape(heads, out // heads // 2, 2, cols).transpose(1, 2).reshape(out, cols)


# -- export -------------------------------------------------------------------------------------------


def build(src: HeadSource, opts: ExportOptions) -> Draft:
    if src.family in gguf_dflash.FAMILIES:
        return gguf_dflash.build(src, opts)
    tokens = check_servable(src, opts)
    spec, info, ids = src.spec, src.info, src.layer_ids
    dtype = resolve_export_dtype(opts.dtype, src.tensors)
    a, u32, flag = ARCH, GGUFValueType.UINT32, GGUFValueType.BOOL
    fields = layer_fields(a, "EAGLE-3", info, dtype, 1, spec.intermediate_size)
    fields += [
        (f"{a}.vocab_size", info.vocab_size, u32, None),
        (f"{a}.target_layers", list(ids), GGUFValueType.ARRAY, GGUFValueType.INT32),
        (f"{a}.target_hidden_size", info.hidden_size, u32, None),
        (f"{a}.norm_before_residual", bool(spec.norm_before_residual), flag, None),
        (f"{a}.norm_before_fc", bool(spec.norm_before_fc), flag, None),
    ]
    fields += vocab_fields(opts.target, info.vocab_size)

    tensors = dict(src.tensors)
    if opts.embeddings and "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = opts.target.embed_tokens()
    out: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
    for name, tensor in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        if name not in TENSORS:
            raise SpecHeadsError(f"{LLAMACPP}'s EAGLE-3 draft has no place for this head's tensor {name}")
        if name.endswith("q_proj.weight"):
            tensor = rope_rows(tensor, info.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = rope_rows(tensor, info.num_key_value_heads)
        out[TENSORS[name]] = as_ggml(tensor, dtype)
    d2t = tensors.get("d2t")
    if d2t is not None and (spec.draft_vocab_size != info.vocab_size or bool(d2t.any())):
        # llama.cpp scatters the draft's logits to these target ids (eagle3.cpp: ggml_set_rows)
        absolute = torch.arange(spec.draft_vocab_size) + d2t.long()
        out["d2t"] = (absolute.numpy().astype(np.int64), GGMLQuantizationType.I64)
    freqs = rope_freqs(info)
    if freqs is not None:
        out[ROPE_FREQS] = (freqs.numpy(), GGMLQuantizationType.F32)
    block = {**provenance(src, NAME, ENGINES, ids), "num_speculative_tokens": tokens}
    fields.append((PROVENANCE, json.dumps(block), GGUFValueType.STRING, None))
    notes = [
        f"{LLAMACPP} drafts a chain: serve with --spec-type draft-eagle3 --spec-draft-n-max {tokens}",
    ]
    if branches(src.default_tree or []):
        notes.append(f"the head's default tree is not used: llama.cpp drafts a chain of {tokens}")
    return Draft(ARCH, fields, out, list(ENGINES), notes)


# -- read back ----------------------------------------------------------------------------------------


def read_file(path: Path) -> ReadBack:
    """The GGUF in our own terms from its llama.cpp fields alone (q/k rows back in Hugging Face order,
    d2t back to offsets), every float tensor in the file type's dtype."""
    reader = GGUFReader(str(path))
    kv = values(reader)
    a = kv.get("general.architecture")
    if a == gguf_dflash.ARCH:
        return gguf_dflash.read(reader, kv)
    if a != ARCH:
        raise SpecHeadsError(f"{path} is neither an EAGLE-3 nor a DFlash-family draft GGUF (architecture {a!r})")
    dtype = file_dtype(kv)
    heads, kv_heads = kv[f"{a}.attention.head_count"], kv[f"{a}.attention.head_count_kv"]
    ours = {v: k for k, v in TENSORS.items()}
    tensors: dict[str, torch.Tensor] = {}
    d2t = None
    for t in reader.tensors:
        tensor = tensor_of(t)
        if t.name == "d2t":
            d2t = tensor.long()
            continue
        if t.name == ROPE_FREQS:
            continue
        name = ours[t.name]
        if name.endswith("q_proj.weight"):
            tensor = unrope_rows(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = unrope_rows(tensor, kv_heads)
        tensors[name] = tensor.to(dtype)
    vocab = kv[f"{a}.vocab_size"]
    draft_vocab = len(d2t) if d2t is not None else vocab
    if d2t is not None:
        tensors["d2t"] = d2t - torch.arange(draft_vocab)
    config = {
        "num_hidden_layers": kv[f"{a}.block_count"],
        "intermediate_size": kv[f"{a}.feed_forward_length"],
        "draft_vocab_size": draft_vocab,
        "norm_before_fc": kv.get(f"{a}.norm_before_fc", False),
        "norm_before_residual": kv.get(f"{a}.norm_before_residual", False),
    }
    spec = spec_fields(config, tensors, [int(k) for k in kv[f"{a}.target_layers"]])
    tensors.update(vocab_maps(tensors, vocab, draft_vocab))
    block = json.loads(kv.get(PROVENANCE, "{}"))
    draft = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": kv[f"{a}.attention.key_length"],
        "rms_norm_eps": kv[f"{a}.attention.layer_norm_rms_epsilon"],
        "max_position_embeddings": kv[f"{a}.context_length"],
    }
    return ReadBack(spec["family"], spec, draft, tensors, block)
