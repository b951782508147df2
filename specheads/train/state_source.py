"""Where the trainer's (batch, states) pairs come from.

The trainer decides WHICH rows a rank reads (specheads.train.batches); a state source turns those
rows into a padded batch plus the target states the head's loss needs. Two sources fit this seam:
  - OnlineStates: one frozen-target forward per batch;
  - OfflineStates: hidden states cached on disk (by distill.py or data.features=auto), read back
    by row index.
A source only has to implement the StateSource protocol below.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ..data.datasets import collate, collate_packed
from ..data.features import (
    INDEX_NAME,
    FeatureCache,
    check_key,
    collate_features,
    collate_features_packed,
    feature_cache_key,
    split_dir,
    state_names,
    writer_backend,
)
from ..errors import SpecHeadsError
from ..provenance import portable_path
from ..target import FrozenTarget, check_packing, forward_masks

# input_ids, attention_mask, loss_mask: LongTensor [B, T], right padded; a packed batch also has
# document and position_ids [B, T] (specheads.data.packing)
Batch = dict[str, torch.Tensor]
States = dict[Any, torch.Tensor]  # layer id -> [B, T, H] (our convention), "final" -> post-norm [B, T, H]


class StateSource(Protocol):
    def rows(self, split: str) -> Sequence[dict]:
        """Rows of a split ("train" or "eval"), each with input_ids and loss_mask lists."""

    def require(self, layer_ids: Sequence[int], final: bool) -> None:
        """Which states fetch must return (head.training_states()); a source that cannot
        provide them raises SpecHeadsError."""

    def fetch(self, split: str, indices: Sequence[int]) -> tuple[Batch, States]:
        """The batch of rows `indices` and its states, on the training device."""

    def fetch_packed(self, split: str, packs: Sequence[Sequence[int]]) -> tuple[Batch, States]:
        """One packed row per pack of row indices (data.pack, specheads.data.packing): the batch,
        with document and position_ids, and states computed for each conversation alone."""


class OnlineStates:
    """States computed by the frozen target, one no-grad forward per batch (its matmuls in
    `autocast`'s dtype when one is given: train.autocast)."""

    def __init__(
        self, target: FrozenTarget, splits: dict[str, Sequence[dict]], pad_id: int, autocast: torch.dtype | None = None
    ):
        self.target, self.splits, self.pad_id, self.autocast = target, splits, pad_id, autocast
        self.layer_ids: list[int] = []
        self.final = True
        self.packing_checked = False

    def rows(self, split: str) -> Sequence[dict]:
        return self.splits[split]

    def record(self) -> dict:
        """What a head trained from these states records of them (its training.features)."""
        return {"online": True, "writer": {"backend": "transformers"}}

    def require(self, layer_ids: Sequence[int], final: bool) -> None:
        self.layer_ids = self.target.check_layer_ids(layer_ids)
        self.final = bool(final)

    def fetch(self, split: str, indices: Sequence[int]) -> tuple[Batch, States]:
        rows = self.splits[split]
        return self._with_states(collate([rows[int(i)] for i in indices], self.pad_id))

    def fetch_packed(self, split: str, packs: Sequence[Sequence[int]]) -> tuple[Batch, States]:
        if not self.packing_checked:  # once: a target whose forward would leak across conversations is refused
            check_packing(self.target)
            self.packing_checked = True
        rows = self.splits[split]
        return self._with_states(collate_packed([[rows[int(i)] for i in pack] for pack in packs], self.pad_id))

    def _with_states(self, batch: Batch) -> tuple[Batch, States]:
        batch = {k: v.to(self.target.device) for k, v in batch.items()}
        if not self.layer_ids and not self.final:
            return batch, {}  # a head that runs the target itself (Medusa-2) needs no states
        device = batch["input_ids"].device.type
        with torch.autocast(device, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            captured = self.target.states(
                batch["input_ids"], **forward_masks(batch), layer_ids=self.layer_ids, final=self.final
            )
        states: States = dict(captured.hidden)
        if self.final:
            states["final"] = captured.final
        return batch, states


class OfflineStates:
    """States read from a feature cache (specheads.data.features) instead of running the target.

    The cache must hold (at least) the states the head needs and match the target, tokenizer,
    template and max_length.
    """

    def __init__(
        self, directory, target: FrozenTarget, max_length: int, pad_id: int, device: torch.device, dtype: torch.dtype
    ):
        self.directory, self.pad_id, self.device, self.dtype = Path(directory), pad_id, device, dtype
        self.caches: dict[str, FeatureCache] = {}
        for split in ("train", "eval"):
            where = split_dir(directory, split)
            if not (where / INDEX_NAME).is_file():
                if split == "train":
                    raise SpecHeadsError(
                        f"no feature cache at {where}; write one with distill.py "
                        "distill.features=true or point data.features elsewhere"
                    )
                continue
            cache = FeatureCache(where)
            found = cache.index.get("key", {})
            wanted = feature_cache_key(
                target, found.get("layer_ids", []), found.get("final_post_norm", False), max_length
            )
            check_key(found, wanted, where)
            self.caches[split] = cache
        self._rows: dict[str, list[dict]] = {}

    def record(self) -> dict:
        """What a head trained from this cache records of it (its training.features): where it is,
        its dtype, and who wrote it (the index's writer: transformers, or vLLM with its version and
        identity checks)."""
        index = self.caches["train"].index
        return {
            "cache": portable_path(self.directory),
            "dtype": index.get("dtype"),
            "names": index.get("names"),
            "writer": index.get("writer") or {"backend": writer_backend(index)},
        }

    def rows(self, split: str):
        if split not in self.caches:
            return []
        if split not in self._rows:
            cache = self.caches[split]
            self._rows[split] = [
                {"input_ids": r.input_ids.tolist(), "loss_mask": r.loss_mask.tolist()}
                for r in (cache[i] for i in range(len(cache)))
            ]
        return self._rows[split]

    def require(self, layer_ids, final: bool) -> None:
        have = set(self.caches["train"].names)
        missing = [n for n in state_names(layer_ids, final) if n not in have]
        if missing:
            raise SpecHeadsError(
                f"feature cache {self.directory} lacks {missing} (has {sorted(have)}); "
                "rebuild it for this head's layers"
            )
        self.wanted = set(int(k) for k in layer_ids) | ({"final"} if final else set())

    def _read(self, split: str, i: int):
        row = self.caches[split][int(i)]
        row.states = {k: v for k, v in row.states.items() if k in self.wanted}
        return row

    def fetch(self, split: str, indices):
        batch, states = collate_features([self._read(split, i) for i in indices], self.pad_id, self.dtype)
        return self._on_device(batch, states)

    def fetch_packed(self, split: str, packs):
        # the cached states were computed one conversation at a time: joined, they are a packed row's
        rows = [[self._read(split, i) for i in pack] for pack in packs]
        return self._on_device(*collate_features_packed(rows, self.pad_id, self.dtype))

    def _on_device(self, batch, states):
        return ({k: v.to(self.device) for k, v in batch.items()}, {k: v.to(self.device) for k, v in states.items()})
