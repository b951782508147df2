"""engines/peer_train.py as engines/peer.py runs it, in vLLM's virtualenv, up to its first step.

    .venv-vllm/bin/python tests/engines/peer_sampler.py OUT.json SCHEDULE.json -- <speculators train arguments>

speculators' own entry point runs (its argument parsing, draft model, data splits, samplers and
loaders) with peer_train.py's hooks; only its Trainer is replaced, by one that writes to OUT.json,
per split, the rows it holds, the dataset rows of every batch its sampler yields and the tokens of
every batch its loader collates, then stops: what the peer would train on, without training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engines"))


def split_read(loader) -> dict:
    start = loader.dataset.start_file_idx
    return {
        "start": start,
        "rows": len(loader.dataset),
        "steps": len(loader),
        "batches": [[start + int(i) for i in batch] for batch in loader.batch_sampler],
        "tokens": [batch["input_ids"][0].tolist() for batch in loader],  # their states load, packed
    }


def main(argv: list[str]) -> int:
    import peer_train
    from speculators.train import cli

    out = Path(argv[0])

    class Recorder:
        def __init__(self, model, config, train_loader, val_loader):
            self.loaders = {"train": train_loader, "val": val_loader}

        def run_training(self):
            out.write_text(json.dumps({name: split_read(loader) for name, loader in self.loaders.items()}))

    cli.Trainer = Recorder
    return peer_train.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
