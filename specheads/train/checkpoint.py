"""Resumable training checkpoints: output_dir/checkpoints/step-N, written atomically by all ranks.

A checkpoint is DeepSpeed's own (head weights, optimizer, LR scheduler; any ZeRO stage) plus our
client state (step, data position, run fingerprint) and each rank's RNG states. It is written
under a temporary name, marked complete, then renamed, so a run killed at any moment leaves
either a complete checkpoint or none. These are torch files meant only for resuming from our own
output_dir; the exported head (output_dir/head) is safetensors.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import SpecHeadsError

COMPLETE = "complete.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step-(\d+)$")


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Checkpoints:
    """The checkpoints of one output_dir. Every rank calls save/load; rank 0 renames and prunes."""

    def __init__(self, output_dir: str | Path, keep: int = 2, rank: int = 0, world_size: int = 1):
        self.root = Path(output_dir) / "checkpoints"
        self.keep, self.rank, self.world_size = keep, rank, world_size

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and (path / COMPLETE).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def remove_partial(self) -> None:
        """Drop what a killed run left half-written (rank 0; everyone waits)."""
        if self.rank == 0 and self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith(TMP_PREFIX) or (STEP_DIR.match(path.name) and not (path / COMPLETE).is_file()):
                    shutil.rmtree(path, ignore_errors=True)
        _barrier()

    def save(self, engine, step: int, client_state: dict[str, Any]) -> Path:
        final = self.root / f"step-{step}"
        tmp_tag = f"{TMP_PREFIX}step-{step}"
        tmp = self.root / tmp_tag
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)
        _barrier()
        engine.save_checkpoint(str(self.root), tag=tmp_tag, client_state=client_state, save_latest=False)
        torch.save(capture_rng(), tmp / f"rng-rank{self.rank}.pt")
        _barrier()
        if self.rank == 0:
            marker = {"step": step, "world_size": self.world_size}
            with open(tmp / COMPLETE, "w") as f:
                json.dump(marker, f)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for _, path in self.complete()[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, engine, path: Path) -> dict[str, Any]:
        """Restore engine state and this rank's RNG; returns the client state."""
        marker = json.loads((path / COMPLETE).read_text())
        if marker.get("world_size") != self.world_size:
            raise SpecHeadsError(
                f"{path} was written by {marker.get('world_size')} ranks but this run has "
                f"{self.world_size}; resume with the same number of processes or use a new output_dir"
            )
        load_path, client_state = engine.load_checkpoint(
            str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise SpecHeadsError(f"DeepSpeed could not load the checkpoint {path}")
        # Our own file in our own output_dir: RNG states are numpy/python objects, not tensors only.
        restore_rng(torch.load(path / f"rng-rank{self.rank}.pt", weights_only=False))
        return client_state or {}
