"""Which rows each rank reads: a pure function of (seed, micro-batch index), so resume needs no state.

Training order works like DistributedSampler(drop_last=True) under a batch sampler: every epoch is
a fresh seeded permutation cut into global batches of batch_size * world_size rows, and rank r
reads its slice of each. With group_by_length, rows are sorted by length inside windows of
`window` global batches and the batches are then shuffled: a batch holds similar lengths (less
padding) while the order stays random.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..data.packing import pack_lengths, pack_rows
from ..errors import SpecHeadsError


class TrainBatches:
    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        group_by_length: bool = True,
        window: int = 32,
    ):
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.group_by_length, self.window = seed, group_by_length, window
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = len(self.lengths) // self.global_batch
        if self.batches_per_epoch == 0:
            raise SpecHeadsError(
                f"{len(self.lengths)} training rows cannot fill one batch of {self.global_batch} "
                f"(train.batch_size {batch_size} x {world_size} ranks); use more data or a smaller batch"
            )
        self._epoch: int | None = None
        self._order: torch.Tensor | None = None

    def epoch_of(self, index: int) -> int:
        return index // self.batches_per_epoch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """[batches_per_epoch, global_batch] row ids of one epoch."""
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            used = self.batches_per_epoch * self.global_batch
            perm = torch.randperm(len(self.lengths), generator=gen)[:used]
            if self.group_by_length:
                span = self.window * self.global_batch
                chunks = []
                for start in range(0, used, span):
                    chunk = perm[start : start + span]
                    # stable sort keeps the random order among equal lengths
                    chunks.append(chunk[torch.sort(-self.lengths[chunk], stable=True).indices])
                perm = torch.cat(chunks)
            batches = perm.view(self.batches_per_epoch, self.global_batch)
            if self.group_by_length:
                batches = batches[torch.randperm(self.batches_per_epoch, generator=gen)]
            self._epoch, self._order = epoch, batches
        return self._order

    def __getitem__(self, index: int) -> list[int]:
        """Rows this rank reads for micro-batch `index` (counted from the start of training)."""
        batch = self._epoch_order(self.epoch_of(index))[index % self.batches_per_epoch]
        return batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size].tolist()


def eval_batches(
    lengths: Sequence[int],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    max_batches: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """This rank's evaluation batches: a fixed random subset, sorted by length to pad little.

    Every rank gets the same number of batches (a few rows are dropped to make the subset divide
    evenly): under ZeRO-3 each forward is a collective, so ranks must run the same count.
    """
    n = len(lengths)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    if max_batches is not None:
        perm = perm[: max_batches * batch_size * world_size]
    perm = perm[: (len(perm) // world_size) * world_size]
    lens = torch.as_tensor(list(lengths), dtype=torch.long)
    ordered = perm[torch.sort(-lens[perm], stable=True).indices] if len(perm) else perm
    mine = ordered[rank::world_size].tolist()
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def training_order(cfg, lengths: Sequence[int], rank: int = 0, world_size: int = 1):
    """(packs, batches) of a training job over rows of these lengths: with data.pack, the packs of
    conversations each training row holds (specheads.data.packing.pack_rows; None without), and the
    TrainBatches over those rows. What the Trainer reads, and what a tool reproducing its order
    (engines/peer.py) reads too."""
    packs = None
    if cfg.data.pack:
        packs = pack_rows(lengths, cfg.data.max_length)
        lengths = pack_lengths(lengths, packs)
    t = cfg.train
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    batches = TrainBatches(lengths, t.batch_size, rank, world_size, seed=seed, group_by_length=t.group_by_length)
    return packs, batches
