"""The process group's helpers: a plain process is a world of one; two gloo ranks exchange values."""

import socket

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
