"""The target's vocabulary as a llama.cpp draft GGUF carries it (`tokenizer.ggml.*`).

llama.cpp's EAGLE-3 draft lays its logits out over its own vocabulary (src/models/eagle3.cpp: d2t
scatters the draft's rows into `vocab.n_tokens()` columns) and will not load without one
(llama-vocab.cpp: tokenizer.ggml.model is required), so the draft carries the target's, as llama.cpp's
converter writes it from --target-model-dir. The draft never tokenizes text: what matters is that
its token count and ids are the target's.

A target that is a GGUF file (the embedded SmolLM2, a .gguf path) gives its tokenizer.ggml.* keys
as they are: exactly the vocabulary llama.cpp loads for the target. Any other target gives its
Hugging Face tokenizer, written as a byte-level BPE vocabulary ("gpt2") the way the converter's
get_vocab_base does: ids without a token padded as [PAD<id>] up to the target's vocab_size, added
special tokens as control tokens. The pre-tokenizer name is left out (the converter finds it by
hashing tokenizer outputs against its own table); llama.cpp then warns and uses its default one,
which a draft never runs. Other tokenizer kinds are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, Keys, TokenType

from ..errors import SpecHeadsError
from .common import TargetParts

PREFIX = "tokenizer.ggml."
# (key, value, type, element type of an array)
Field = tuple[str, Any, GGUFValueType, GGUFValueType | None]


def vocab_fields(parts: TargetParts, vocab_size: int) -> list[Field]:
    if parts.gguf_file is not None:
        return from_gguf(Path(parts.gguf_file), vocab_size)
    return from_tokenizer(parts.tokenizer(), vocab_size)


def from_gguf(path: Path, vocab_size: int) -> list[Field]:
    try:
        fields = GGUFReader(str(path)).fields
    except (OSError, ValueError) as err:
        raise SpecHeadsError(f"the target's GGUF {path} is not readable: {err}") from None
    out = []
    for name, field in fields.items():
        if name.startswith(PREFIX):
            kind = field.types[0]
            sub = field.types[1] if kind == GGUFValueType.ARRAY and len(field.types) > 1 else None
            out.append((name, field.contents(), kind, sub))
    tokens = next((v for k, v, _, _ in out if k == Keys.Tokenizer.LIST), None)
    if tokens is None:
        raise SpecHeadsError(f"the target's GGUF {path} has no vocabulary ({Keys.Tokenizer.LIST})")
    if len(tokens) != vocab_size:
        raise SpecHeadsError(
            f"the target's GGUF {path} holds {len(tokens)} tokens, the head's target {vocab_size}: another target"
        )
    return out


def from_tokenizer(tokenizer: Any, vocab_size: int) -> list[Field]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        kind = f"{model.get('type', type(tokenizer).__name__)} with a {decoder.get('type', 'non-byte-level')} decoder"
        raise SpecHeadsError(
            f"llama.cpp's draft GGUF carries the target's vocabulary; specheads writes it from byte-level BPE "
            f"tokenizers only (this target's: {kind}): give the target as a GGUF file (model.path=FILE.gguf)"
        )
    ids = tokenizer.get_vocab()
    if max(ids.values()) >= vocab_size:
        raise SpecHeadsError(
            f"the target's tokenizer has ids up to {max(ids.values())}, its vocab_size is {vocab_size}"
        )
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    by_id = {i: t for t, i in ids.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        tokens.append(token if token is not None else f"[PAD{i}]")
        if token is None:
            types.append(TokenType.UNUSED)
        elif token in added:
            types.append(TokenType.CONTROL if added[token] else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:  # llama.cpp needs the key for a BPE vocabulary, and gguf writes no empty array
        raise SpecHeadsError(
            "the target's BPE tokenizer has no merges, which a GGUF vocabulary cannot carry: give the target "
            "as a GGUF file (model.path=FILE.gguf)"
        )
    out: list[Field] = [
        (Keys.Tokenizer.MODEL, "gpt2", GGUFValueType.STRING, None),
        (Keys.Tokenizer.LIST, tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        (Keys.Tokenizer.TOKEN_TYPE, [int(t) for t in types], GGUFValueType.ARRAY, GGUFValueType.INT32),
        (Keys.Tokenizer.MERGES, merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
    ]
    for key, name in (
        (Keys.Tokenizer.BOS_ID, "bos_token_id"),
        (Keys.Tokenizer.EOS_ID, "eos_token_id"),
        (Keys.Tokenizer.UNK_ID, "unk_token_id"),
        (Keys.Tokenizer.PAD_ID, "pad_token_id"),
    ):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            out.append((key, value, GGUFValueType.UINT32, None))
    for key, name in ((Keys.Tokenizer.ADD_BOS, "add_bos_token"), (Keys.Tokenizer.ADD_EOS, "add_eos_token")):
        out.append((key, bool(getattr(tokenizer, name, False)), GGUFValueType.BOOL, None))
    return out
