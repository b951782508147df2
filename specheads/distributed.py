"""The process group: one code path for a plain process and N ranks started by deepspeed/torchrun.

The distributed backend is always initialised (gloo on CPU, nccl on GPU), also for a world of
one, so the trainer never branches on the number of processes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import SpecHeadsError


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _plain_world_of_one() -> bool:
    """No launcher set up this process: a plain `python train.py` (no WORLD_SIZE), or one whose world
    of one this module set up before (WORLD_SIZE=1 and no MASTER_PORT; a launcher always sets one)."""
    world = os.environ.get("WORLD_SIZE")
    return world is None or (world == "1" and "MASTER_PORT" not in os.environ)


def setup_distributed(device_name: str = "auto") -> Dist:
    """Initialise torch.distributed through DeepSpeed, also for a single plain process."""
    if device_name not in ("auto", "cpu", "cuda"):
        raise SpecHeadsError(f"device must be auto, cpu or cuda, got {device_name!r}")
    use_cuda = torch.cuda.is_available() if device_name == "auto" else device_name == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SpecHeadsError("device=cuda asked for, but no CUDA device is available")
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported
    plain = _plain_world_of_one()
    if plain:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not use_cuda and (int(os.environ["WORLD_SIZE"]) == 1 or os.environ.get("SPECHEADS_SHM_ALLREDUCE") == "0"):
        _skip_shm_comm_op()
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if plain:
            # A world of one meets only itself: an in-memory store, no port and no file. (Picking a
            # free MASTER_PORT by binding port 0 and releasing it let two plain runs started at once
            # draw the same port.) DeepSpeed then adopts the initialised group as it is.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return Dist(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=device)


# what setup_distributed may set in a plain process's environment
WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")


@contextlib.contextmanager
def process_group(device_name: str = "auto"):
    """setup_distributed for the block, left together by finished ranks and at once by a failing
    one (end_distributed). WORLD_VARIABLES are as before when it ends: a process started afterwards
    (another trainer, a launcher) would read this world's LOCAL_RANK as its own launcher's."""
    saved = {k: os.environ.get(k) for k in WORLD_VARIABLES}
    try:
        d = setup_distributed(device_name)
        try:
            yield d
        except BaseException:
            end_distributed(finished=False)
            raise
        end_distributed()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def end_distributed(finished: bool = True) -> None:
    """Leave the process group. A finished rank first waits at a barrier for its peers: a gloo rank
    that exits while a peer still holds its connection can abort in its C++ teardown
    ("terminate called without an active exception"). A failing rank leaves at once, since its peers
    may never reach the barrier. What still holds the group (ZeRO-3 parameters of a model the job
    let go of, in reference cycles) is collected first, not at interpreter exit, where the same
    teardown abort was seen."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    if finished and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
    # DeepSpeed keeps a clone of the world group; a later group in this process (a second train()
    # call, a notebook) would otherwise get the destroyed one from it
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and hasattr(groups, "_WORLD_GROUP"):
        groups._WORLD_GROUP = None


def _skip_shm_comm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (about a minute in a
    fresh environment) that only ranks sharing a machine use; a world of one has no peers, and
    SPECHEADS_SHM_ALLREDUCE=0 makes several CPU ranks all-reduce through gloo instead (the test
    suite's short runs, where the compile would cost more than it saves)."""
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (ImportError, AttributeError, TypeError):  # another DeepSpeed layout: build it as usual
        pass


@contextlib.contextmanager
def main_rank_first(d: Dist):
    """Rank 0 runs the block first (it may build and cache data); the others then reuse its cache."""
    if not d.is_main:
        dist.barrier()
    yield
    if d.is_main:
        dist.barrier()


def quiet_deepspeed(debug: bool) -> None:
    """DeepSpeed logs every init at INFO and calls torch collectives torch now calls deprecated."""
    from deepspeed.utils import logger

    logger.setLevel(logging.INFO if debug else logging.WARNING)
    if not debug:
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (a copy; the input is left alone)."""
    values = values.clone()
    if process_rank()[1] > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def per_rank(value: float, d: Dist) -> list[float]:
    """Every rank's `value`, in rank order, on every rank (one all-reduce of a one-hot vector)."""
    slots = torch.zeros(d.world_size, dtype=torch.float64)
    slots[d.rank] = value
    return all_reduce_sum(slots.to(d.device)).cpu().tolist()


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory: allocated GPU memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def process_rank() -> tuple[int, int]:
    """(rank, world size) of the initialised process group; (0, 1) in a plain process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's picklable `value`, in rank order, on every rank."""
    world = process_rank()[1]
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable `value` on every rank."""
    if process_rank()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]
