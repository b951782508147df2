"""Reduced draft vocabulary (EAGLE-3's, and the early-exit head's on request): the most frequent
assistant tokens of the training data.

d2t holds offsets (target_id = draft_id + d2t[draft_id]); t2d marks target ids in the draft vocab.
Results are cached under a key of (data fingerprint, tokenizer, chat template, sizes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch
from safetensors.torch import load_file, save_file

from ..atomic import atomic_path
from ..target import cache_root


def count_assistant_tokens(rows: Iterable[dict], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(row["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top draft_vocab_size ids by count (ties and unseen ids broken by lower id), sorted by id."""
    vocab_size = counts.numel()
    # stable sort on -count keeps lower ids first among equals, so unseen tokens fill deterministically
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    used = torch.sort(order).values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def vocab_cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def build_draft_vocab(
    rows, vocab_size: int, draft_vocab_size: int, key_parts: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage): coverage is the share of assistant tokens inside the draft vocab."""
    path = None
    if key_parts is not None:
        key = vocab_cache_key({**key_parts, "vocab_size": vocab_size, "draft_vocab_size": draft_vocab_size})
        path = cache_root() / "vocab" / f"{key}.safetensors"
        if path.is_file():
            t = load_file(str(path))
            return t["d2t"], t["t2d"], float(t["coverage"].item())
    counts = count_assistant_tokens(rows, vocab_size)
    d2t, t2d = vocab_from_counts(counts, draft_vocab_size)
    coverage = float(counts[t2d].sum()) / max(1, int(counts.sum()))
    if path is not None:
        with atomic_path(path) as tmp:
            save_file({"d2t": d2t, "t2d": t2d, "coverage": torch.tensor([coverage])}, str(tmp))
    return d2t, t2d, coverage


class DraftVocabulary:
    """The maps of a head that drafts over a reduced vocabulary (a mixin for nn.Module heads):
    persistent buffers, saved with the head, chosen from the training data by build_head."""

    def register_vocab(self, draft_vocab_size: int, vocab_size: int) -> None:
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        full = draft_vocab_size == vocab_size  # the identity map: every target id is a draft id
        self.register_buffer("t2d", torch.full((vocab_size,), full, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError("draft vocab maps do not match the head's sizes")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def has_draft_vocab(self) -> bool:
        return "d2t" in self._buffers  # an early-exit head registers the maps only with head.draft_vocab

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.has_draft_vocab else draft_ids
