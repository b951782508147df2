"""Where the trainer's (batch, states) pairs come from.

The engine decides WHICH rows a rank reads (specheads.train.batches); a state source turns those rows
into a padded batch plus the target states the head's loss needs. Two sources fit this seam:
  - OnlineStates: one frozen-target forward per batch (this file);
  - offline features: hidden states cached on disk by distill.py, read back by row index.
A source only has to implement the StateSource protocol below.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from ..target import FrozenTarget

Batch = dict[str, torch.Tensor]  # input_ids, attention_mask, loss_mask: LongTensor [B, T], right padded
States = dict[Any, torch.Tensor]  # layer id -> [B, T, H] (our convention), "final" -> post-norm [B, T, H]


class StateSource(Protocol):
    def rows(self, split: str) -> Sequence[dict]:
        """Rows of a split ("train" or "eval"), each with input_ids and loss_mask lists."""

    def require(self, layer_ids: Sequence[int], final: bool) -> None:
        """Which states fetch must return (head.training_states()); a source that cannot
        provide them raises SpecHeadsError."""

    def fetch(self, split: str, indices: Sequence[int]) -> tuple[Batch, States]:
        """The batch of rows `indices` and its states, on the training device."""


class OnlineStates:
    """States computed by the frozen target, one no-grad forward per batch."""

    def __init__(self, target: FrozenTarget, splits: dict[str, Sequence[dict]], pad_id: int):
        self.target, self.splits, self.pad_id = target, splits, pad_id
        self.layer_ids: list[int] = []
        self.final = True

    def rows(self, split: str) -> Sequence[dict]:
        return self.splits[split]

    def require(self, layer_ids: Sequence[int], final: bool) -> None:
        self.layer_ids = self.target.check_layer_ids(layer_ids)
        self.final = bool(final)

    def fetch(self, split: str, indices: Sequence[int]) -> tuple[Batch, States]:
        from ..data.conversations import collate

        rows = self.splits[split]
        batch = collate([rows[int(i)] for i in indices], self.pad_id)
        batch = {k: v.to(self.target.device) for k, v in batch.items()}
        captured = self.target.states(batch["input_ids"], batch["attention_mask"],
                                      layer_ids=self.layer_ids, final=self.final)
        states: States = dict(captured.hidden)
        if self.final:
            states["final"] = captured.final
        return batch, states


def row_lengths(rows: Sequence[dict]) -> list[int]:
    """Token count of every row; a `datasets.Dataset` is measured in Arrow, without Python lists."""
    if hasattr(rows, "with_format") and hasattr(rows, "column_names"):
        import pyarrow.compute as pc

        return pc.list_value_length(rows.with_format("arrow")["input_ids"]).to_pylist()
    return [len(r["input_ids"]) for r in rows]
