"""vLLM's speculators trainer (0.9.0) on a CPU, on the batches our trainer would read.

Run by engines/peer.py with the Python of vLLM's virtualenv (where `speculators` is installed):

    .venv-vllm/bin/python engines/peer_train.py SCHEDULE.json -- <speculators train arguments>

The package runs unchanged; four things are put in place around its `main` first:
- the trainer moves the model and batches to its local rank, the integer 0, which means an
  accelerator: here it is "cpu" (trainer.get_local_rank);
- its step timer synchronises the accelerator: a no-op on a CPU (torch.accelerator.synchronize);
- its checkpointer asks for the current device ("cuda:0"): "cpu";
- its packing sampler draws its own seeded packs of conversations: the training split's batches are
  those of SCHEDULE.json instead ({"train_rows": N, "batches": [[dataset index, ...], ...]}, one
  list per optimizer step: the conversations our trainer reads at that step, in its order), so the
  two trainers see the same tokens at every step. The validation split (the dataset's rows after
  the first N, never N long: peer.py writes fewer) keeps the peer's own packing.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def install(schedule: list[list[int]], train_rows: int) -> None:
    from speculators.train import checkpointer, dataloader, trainer
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    class OurBatches(MultipackDistributedBatchSamplerV2):
        def _generate_batches(self, epoch):
            if len(self.lengths) == train_rows:  # the training split
                return [np.asarray(batch, dtype=np.int64) for batch in schedule]
            return super()._generate_batches(epoch)

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    checkpointer.get_current_device = lambda: "cpu"
    dataloader.MultipackDistributedBatchSamplerV2 = OurBatches


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: peer_train.py SCHEDULE.json -- <speculators train arguments>", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        plan = json.load(f)
    install(plan["batches"], plan["train_rows"])
    from speculators.train.cli import main as train_main
    from speculators.train.config.schema import TrainConfig

    train_main(TrainConfig.resolve(argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
