"""vLLM's speculators trainer (0.9.0) on a CPU, on the batches our trainer would read.

Run by engines/peer.py with the Python of vLLM's virtualenv (where `speculators` is installed):

    .venv-vllm/bin/python engines/peer_train.py SCHEDULE.json -- <speculators train arguments>

The package runs unchanged; four things are put in place around its `main` first:
- the trainer moves the model and batches to its local rank, the integer 0, which means an
  accelerator: here it is "cpu" (trainer.get_local_rank);
- its step timer synchronises the accelerator: a no-op on a CPU (torch.accelerator.synchronize);
- its checkpointer asks for the current device ("cuda:0"): "cpu";
- its packing sampler draws its own seeded packs of conversations: the training split's batches are
  those of SCHEDULE.json instead ({"train_rows": N, "rows": R, "batches": [[dataset index, ...], ...]},
  one list per optimizer step: the conversations our trainer reads at that step, in its order), so
  the two trainers see the same tokens at every step. The validation split (the R - N rows after the
  first N) keeps the peer's own packing. A split cut anywhere else (a --train-data-ratio that does
  not give int(R x ratio) = N) is refused (SplitError), never trained on the peer's own packing.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


class SplitError(ValueError):
    """speculators split the data set elsewhere than the schedule's training rows."""


def is_training_split(dataset, train_rows: int, rows: int) -> bool:
    """Whether speculators' ArrowDataset `dataset` is the schedule's training split (the first
    train_rows of `rows`) rather than its validation split (the rest); SplitError if it is neither."""
    start, size = dataset.start_file_idx, len(dataset)
    if (start, size) in ((0, train_rows), (train_rows, rows - train_rows)):
        return start == 0
    raise SplitError(
        f"speculators' split holds rows {start}-{start + size} of {rows}, not the schedule's 0-{train_rows} "
        f"or {train_rows}-{rows}: --train-data-ratio does not cut at {train_rows}"
    )


def install(plan: dict) -> None:
    from speculators.train import checkpointer, dataloader, trainer
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as Packing

    schedule, train_rows, rows = plan["batches"], plan["train_rows"], plan["rows"]

    class OurBatches(Packing):
        def _generate_batches(self, epoch):
            return [np.asarray(batch, dtype=np.int64) for batch in schedule]

    setup = dataloader._setup_dataloader

    def setup_split(dataset, *args, **kwargs):
        # speculators' loader builds the sampler its module names: ours for the training split alone
        training = is_training_split(dataset, train_rows, rows)
        dataloader.MultipackDistributedBatchSamplerV2 = OurBatches if training else Packing
        return setup(dataset, *args, **kwargs)

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    checkpointer.get_current_device = lambda: "cpu"
    dataloader._setup_dataloader = setup_split


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: peer_train.py SCHEDULE.json -- <speculators train arguments>", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        plan = json.load(f)
    install(plan)
    from speculators.train.cli import main as train_main
    from speculators.train.config.schema import TrainConfig

    train_main(TrainConfig.resolve(argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
