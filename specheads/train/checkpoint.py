"""Resumable training checkpoints: output_dir/checkpoints/step-N, written atomically by all ranks.

A checkpoint is DeepSpeed's own (head weights, optimizer, LR scheduler; any ZeRO stage) plus our
client state (step, data position, run fingerprint) and each rank's RNG states. It is written
under a temporary name, marked complete, then renamed, so a run killed at any moment leaves
either a complete checkpoint or none.

Resuming never unpickles: a checkpoint directory may come from someone else, and unpickling runs
whatever code it names. DeepSpeed's files are read through torch's weights-only loader (tensors,
containers and numbers, plus the few DeepSpeed classes DEEPSPEED_SAFE_GLOBALS names), and the RNG
states are a safetensors file with their non-tensor parts as JSON metadata.
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import SpecHeadsError

COMPLETE = "complete.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step-(\d+)$")
RNG_FILE = "rng-rank{rank}.safetensors"


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


def save_rng(state: dict[str, Any], path: Path) -> None:
    """capture_rng()'s state as safetensors: the generators' words as int64 tensors, the rest
    (versions, positions, a cached Gaussian) as JSON metadata."""
    version, words, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    tensors = {
        "python": torch.tensor(words, dtype=torch.int64),
        "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "torch": state["torch"],
    }
    tensors |= {f"cuda_{i}": t for i, t in enumerate(state.get("cuda", []))}
    meta = {"python": [version, gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    save_file(tensors, str(path), metadata={"rng": json.dumps(meta)})


def load_rng(path: Path) -> dict[str, Any]:
    """save_rng's file back as capture_rng()'s state; one line if it is missing or not ours."""
    try:
        with safe_open(str(path), "pt") as f:  # the tensors and the metadata in one read
            meta = json.loads((f.metadata() or {})["rng"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        (version, gauss), (kind, pos, has_gauss, cached) = meta["python"], meta["numpy"]
        state = {
            "python": (version, tuple(tensors["python"].tolist()), gauss),
            "numpy": (kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached),
            "torch": tensors["torch"],
        }
    except (OSError, SafetensorError, KeyError, ValueError, TypeError) as err:
        raise SpecHeadsError(
            f"{path} is not an RNG state written by this version of specheads ({type(err).__name__}: {err}); "
            "resume from a checkpoint it wrote, or use a new output_dir"
        ) from None
    cuda = sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))
    if cuda:
        state["cuda"] = [tensors[k] for k in cuda]
    return state


def deepspeed_safe_globals() -> list:
    """The non-container classes DeepSpeed pickles into its checkpoints of our runs (its loss
    scalers, the ZeRO stage enum, the parameter fragments' addresses: plain records whose
    reconstruction sets attributes and runs nothing); torch's weights-only loader rebuilds these
    and refuses every other global."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class WeightsOnlyLoads:
    """DeepSpeed's checkpoint engine, its loads through torch's weights-only unpickler (which
    refuses any global outside the allow-list instead of running it)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, map_location=None):
        try:
            with torch.serialization.safe_globals(deepspeed_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as err:  # torch's UnpicklingError, or a torn/foreign file
            named = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
            why = f"it names {named.group(1)}" if named else f"{type(err).__name__}"
            raise SpecHeadsError(
                f"{path} cannot be loaded without unpickling arbitrary code, or is not a DeepSpeed checkpoint "
                f"({why}); resume only from a checkpoint this version wrote"
            ) from None


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
        try:
            engine.save_checkpoint(str(self.root), tag=tmp_tag, client_state=client_state, save_latest=False)
            save_rng(capture_rng(), tmp / RNG_FILE.format(rank=self.rank))
        except BaseException:  # a full disk, say: the half-written step goes, the last complete one stays
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
        rng = load_rng(path / RNG_FILE.format(rank=self.rank))  # before DeepSpeed's files: one line if not ours
        own = engine.checkpoint_engine
        engine.checkpoint_engine = WeightsOnlyLoads(own)
        try:
            load_path, client_state = engine.load_checkpoint(
                str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        finally:
            engine.checkpoint_engine = own
        if load_path is None:
            raise SpecHeadsError(f"DeepSpeed could not load the checkpoint {path}")
        restore_rng(rng)
        return client_state or {}
