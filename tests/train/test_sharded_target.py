"""The frozen target sharded over 2 CPU ranks (ZeRO-3 inference) computes what the whole one does;
the training runs that use it are in tests/test_train.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_plan import job

from specheads.errors import SpecHeadsError
from specheads.tiny import tiny_target
from specheads.train.plan import shard_decision
from specheads.train.sharded_target import check_shardable

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sharded_states.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """One torchrun of the worker over both sources: source -> rank 0's report."""
    tmp = tmp_path_factory.mktemp("sharded")
    model, tokenizer = tiny_target("llama")
    model.save_pretrained(tmp / "target")
    tokenizer.save_pretrained(tmp / "target")
    paths = {"tiny": "tiny:llama", "local directory": str(tmp / "target")}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = tmp / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
    proc = subprocess.run(
        [*cmd, *paths.values(), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_path = json.loads(out.read_text())
    return {source: by_path[path] for source, path in paths.items()}


@pytest.mark.parametrize("source", ["tiny", "local directory"])
def test_a_sharded_target_computes_what_the_whole_one_does(source, reports):
    """Built in memory (partitioned by deepspeed.initialize) or read from a checkpoint directory
    straight into partitions (transformers' ZeRO-3 loading)."""
    report = reports[source]
    assert report["sharded"] and report["local_numel"] == 0  # each weight lives in ZeRO-3 partitions
    assert report["hidden"] == report["final"] == report["logits"] == report["embed"] == 0.0
    assert report["gathered_lm_head_equal"]


def test_the_plan_shards_only_when_the_whole_target_does_not_fit():
    big = job("model=llama-70b", "head=eagle", "plan.gpu_memory=80GB")
    assert shard_decision(big, world=8, on_gpu=True)  # (b): 141 GB of weights over 8 x 80 GB
    assert not shard_decision(big, world=1, on_gpu=True)  # nothing to shard over
    assert not shard_decision(job("model=llama-3.1-8b", "head=eagle3", "plan.gpu_memory=80GB"), 8, True)
    assert not shard_decision(job(), world=2, on_gpu=False)  # a CPU run without a plan: as asked
    assert shard_decision(job("deepspeed.shard_target=true"), world=2, on_gpu=False)
    assert not shard_decision(job("model=llama-70b", "head=eagle", "deepspeed.shard_target=false"), 8, True)


def test_what_a_sharded_target_cannot_serve_is_one_clear_error():
    with pytest.raises(SpecHeadsError, match="drop data.features"):
        check_shardable(job("data.path=x.jsonl", "data.features=auto"))
    with pytest.raises(SpecHeadsError, match="needs data.path"):
        check_shardable(job("data.features=null"))
    with pytest.raises(SpecHeadsError, match="cannot be sharded"):
        check_shardable(job("data.path=x.jsonl", "data.features=null", "head=medusa2"))
    check_shardable(job("data.path=x.jsonl", "data.features=null"))
