"""The process group's helpers: a plain process is a world of one; two gloo ranks exchange values."""

import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specheads.distributed import (
    Dist,
    all_gather_objects,
    broadcast_object,
    end_distributed,
    peak_memory_gb,
    per_rank,
    process_rank,
)


def test_a_plain_process_is_a_world_of_one():
    assert not dist.is_initialized() or process_rank()[1] == 1
    if not dist.is_initialized():
        assert process_rank() == (0, 1)
    assert all_gather_objects({"a": 1}) == [{"a": 1}]
    assert broadcast_object("mine") == "mine"
    assert per_rank(2.5, Dist(0, 0, 1, torch.device("cpu"))) == [2.5]
    assert 0.01 < peak_memory_gb(torch.device("cpu")) < 64
    if not dist.is_initialized():
        end_distributed()  # nothing to leave


def _exchange(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        d = Dist(rank, rank, 2, torch.device("cpu"))
        results[rank] = (
            process_rank(),
            all_gather_objects(f"rank {rank}"),
            broadcast_object(f"from {rank}"),
            per_rank(10.0 + rank, d),
        )
        end_distributed()
        results[f"left {rank}"] = not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_ranks_gather_in_rank_order_and_broadcast_rank_0():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_exchange, args=(port, results), nprocs=2, join=True)
    for rank in (0, 1):
        assert results[rank] == ((rank, 2), ["rank 0", "rank 1"], "from 0", [10.0, 11.0])
        assert results[f"left {rank}"]


# One plain process of a pair: import first, set up its world of one when the peer has imported too,
# then hold it until the peer has set up (or failed to), so that both groups live at the same time.
PLAIN_WORLD = """
import os, sys, time
from pathlib import Path

me, peer, sync = sys.argv[1], sys.argv[2], Path(sys.argv[3])
import deepspeed  # noqa: F401  (the slow import before the start line)
from specheads.distributed import all_gather_objects, end_distributed, setup_distributed


def wait_for(*names):
    deadline = time.time() + 120
    while not any((sync / n).exists() for n in names) and time.time() < deadline:
        time.sleep(0.01)


(sync / f"{me}.imported").touch()
wait_for(f"{peer}.imported")
try:
    d = setup_distributed("cpu")
except Exception as e:
    (sync / f"{me}.failed").write_text(repr(e))
    raise
(sync / f"{me}.ready").touch()
wait_for(f"{peer}.ready", f"{peer}.failed")
assert d.world_size == 1 and all_gather_objects(me) == [me]
end_distributed()
print("port", os.environ.get("MASTER_PORT"))
"""


def test_plain_processes_started_together_each_get_a_world_of_one(tmp_path):
    """Two plain processes set up at the same moment, each holding its group while the other sets
    up, both succeed and take no port (train.py runs side by side in the tests: run_together).
    Beside them, the harness's own check: the same pair on one fixed MASTER_PORT (the rendezvous of
    a launcher's world) collides, so a port shared by the plain pair would fail this test too."""
    from test_train import ROOT, clean_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fixed = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = {}
    for name, peer, extra in (("a", "b", {}), ("b", "a", {}), ("c", "d", fixed), ("d", "c", fixed)):
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", PLAIN_WORLD, name, peer, str(tmp_path)],
            cwd=ROOT,
            env=clean_env() | extra,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    out = {name: (p.communicate(timeout=240), p.returncode) for name, p in procs.items()}
    for name in ("a", "b"):
        (stdout, stderr), code = out[name]
        assert code == 0, stderr[-3000:]
        assert stdout.strip().splitlines()[-1] == "port None"
    failed = [(tmp_path / f"{name}.failed") for name in ("c", "d") if out[name][1] != 0]
    assert len(failed) == 1, [out[n][0][1][-1500:] for n in ("c", "d")]
    assert "EADDRINUSE" in failed[0].read_text()


RESTORED = """
import os
from specheads.distributed import WORLD_VARIABLES, process_group

for failing in (False, True):
    try:
        with process_group("cpu") as d:
            assert d.world_size == 1 and os.environ["LOCAL_RANK"] == "0" and os.environ["DS_ACCELERATOR"] == "cpu"
            if failing:
                raise ValueError("the block fails")
    except ValueError:
        pass
    print(sorted(set(WORLD_VARIABLES) & set(os.environ)))
"""


def test_a_process_group_leaves_the_environment_as_it_found_it():
    """A plain process's world of one sets RANK, LOCAL_RANK, WORLD_SIZE and DS_ACCELERATOR; once
    the block ends (also by an error) none is left for a process started afterwards (another
    trainer would read LOCAL_RANK as its launcher's and ask for an accelerator)."""
    from test_train import ROOT, clean_env

    env = {k: v for k, v in clean_env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")}
    done = subprocess.run([sys.executable, "-c", RESTORED], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "[]"]
