"""train.py end to end on the tiny target: one process per head family, and two ranks (gloo)."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import write_conversations
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env() -> dict:
    """The test process may hold a process group of its own: children must not inherit its address."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def tiny_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "model=tiny-random",
        f"data.path={data}",
        "data.max_length=96",
        "data.eval_fraction=0.25",
        f"output_dir={out}",
        "wandb.mode=disabled",
        *extra,
    ]


def run(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def run_together(*jobs, workers: int = 2) -> list:
    """Several jobs, `workers` at a time, in the order given: a command is run(), a callable is
    called (runs that depend on each other, one after another in one slot); their results in the
    same order. Each child is single-threaded (clean_env), so two of them use the cores that one
    leaves idle; plain runs meet in a store of their own, with no port to share
    (tests/test_distributed.py)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: job() if callable(job) else run(job), jobs))


def assert_head_written(proc: subprocess.CompletedProcess, out: Path, last: bool = True) -> None:
    head = out / "head"
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    lines = proc.stdout.strip().splitlines()
    # the `deepspeed` launcher logs its own lines after train.py's
    assert lines[-1] == str(head) if last else str(head) in lines


WRITING_FAMILIES = ["medusa", "eagle", "eagle3", "peagle", "dflash"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("chats") / "chats.jsonl", n=32)


def then_infer(cmd: list[str], out: Path) -> Callable[[], tuple]:
    """The train.py run, then infer.py on its head: both processes."""

    def job():
        trained = run(cmd)
        return trained, run([sys.executable, "infer.py", f"head={out / 'head'}", "prompt=hi", "max_new_tokens=8"])

    return job


def then_again(cmd: list[str], out: Path) -> Callable[[], dict]:
    """The train.py run, then the same command again (nothing left to train: the head is written
    again, this time with its weights stored in bf16), then once more with a save_dtype it refuses;
    what the first run left (metrics, weights, training record) read before the second."""

    def job():
        first = run(cmd)
        left = {
            "logged": (out / "metrics.jsonl").read_text(),
            "weights": load_file(out / "head" / "model.safetensors"),
            "training": json.loads((out / "head" / "config.json").read_text())["training"],
        }
        again = run([*cmd, "save_dtype=bfloat16"])
        bad = subprocess.run(
            [*cmd, "save_dtype=int8"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=240
        )
        return {"first": first, **left, "again": again, "bad": bad}

    return job


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, chats) -> dict:
    """The module's one-process train.py runs, two at a time (run_together): hydra and medusa2,
    each followed by infer.py on its head; one per writing family, medusa's followed by the same
    command twice more (then_again); and the one-rank reference of the ZeRO-3 test (eagle3, the
    2-rank runs' data and global batch). Name -> (finished process, output directory); "medusa
    again" -> then_again's record, "<name> infer" -> infer.py's process."""
    tmp = tmp_path_factory.mktemp("plain")
    data = write_conversations(tmp / "chats.jsonl")
    medusa2_stages = ["head.heads_only_steps=1", "head.lm_loss_warmup_steps=1", "head.lora_r=4", "head.merge_lora=true"]
    commands = {
        "hydra": [sys.executable, "train.py", "head=hydra", "train.max_steps=3", *tiny_args(data, tmp / "hydra")],
        "medusa2": [sys.executable, "train.py", "head=medusa2", "train.max_steps=3", *medusa2_stages]
        + ["train.log_every=1", *tiny_args(data, tmp / "medusa2")],
    }
    for family in WRITING_FAMILIES:
        commands[family] = [
            sys.executable,
            "train.py",
            f"head={family}",
            "train.max_steps=3",
            *tiny_args(data, tmp / family)[:-1],
        ] + (
            ["wandb.mode=offline", "train.save_every=2", "train.save_heads=true"]
            if family == "eagle3"
            else ["wandb.mode=disabled"]
        )
    commands["one-rank"] = [sys.executable, "train.py", "head=eagle3", "train.max_steps=3", "train.batch_size=4"]
    commands["one-rank"] += ["train.log_every=1", *tiny_args(chats, tmp / "one-rank")]
    outs = {name: tmp / name for name in commands}
    jobs = dict(commands)
    for name in ("hydra", "medusa2"):
        jobs[name] = then_infer(commands[name], outs[name])
    jobs["medusa"] = then_again(commands["medusa"], outs["medusa"])
    # the chains first, the longest first, then the single runs
    order = ["hydra", "medusa2", "medusa", "eagle3", "peagle", "dflash", "eagle", "one-rank"]
    done = {}
    for name, result in zip(order, run_together(*(jobs[n] for n in order))):
        if name in ("hydra", "medusa2"):
            done[name], done[f"{name} infer"] = (result[0], outs[name]), (result[1], outs[name])
        elif name == "medusa":
            done[name], done["medusa again"] = (result["first"], outs[name]), result
        else:
            done[name] = (result, outs[name])
    return done


@pytest.mark.parametrize("family", WRITING_FAMILIES)
def test_train_py_writes_the_head_and_prints_its_path_last(family, plain_runs):
    proc, out = plain_runs[family]
    assert_head_written(proc, out)
    assert json.loads((out / "head" / "config.json").read_text())["family"] == family
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and any("eval/sim_tau" in r for r in records)
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "checkpoints" / "step-3" / "complete.json").is_file()
    assert (out / ".hydra" / "config.yaml").is_file()  # Hydra's own files stay inside output_dir
    if family == "eagle3":
        assert any((out / "wandb").glob("offline-run-*"))
        # train.save_heads: every checkpoint's head beside its checkpoint, the last one the final head's
        heads = sorted(p.name for p in (out / "heads").iterdir())
        assert heads == ["step-2", "step-3"]
        steps = [json.loads((out / "heads" / h / "config.json").read_text())["training"]["steps"] for h in heads]
        assert steps == [2, 3]
        final = load_file(out / "head" / "model.safetensors")
        at_3, at_2 = (load_file(out / "heads" / h / "model.safetensors") for h in ("step-3", "step-2"))
        assert all(torch.equal(at_3[k], final[k]) for k in final)
        assert not all(torch.equal(at_2[k], final[k]) for k in final)
    if family == "medusa":  # the same command again: nothing left to train, the head is written again
        before = plain_runs["medusa again"]
        assert "segments" not in before["training"]  # one process
        again = before["again"]  # this time with its weights stored in bf16
        assert "resuming from step 3" in again.stderr
        assert (out / "metrics.jsonl").read_text() == before["logged"]  # no step was trained twice
        assert_head_written(again, out)
        record = json.loads((out / "head" / "config.json").read_text())["training"]
        assert [s["steps"] for s in record["segments"]] == [[0, 3], [3, 3]]  # who trained what
        assert record["segments"][1]["command"] == record["command"] != record["segments"][0]["command"]
        bf16, fp32 = load_file(out / "head" / "model.safetensors"), before["weights"]
        assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
        assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
        bad = before["bad"]
        assert bad.returncode == 2 and "save_dtype must be auto or one of" in bad.stderr


def test_hydra_head_trains_and_infer_py_runs_it(plain_runs):
    """head=hydra end to end: train.py writes the head, infer.py loads it and drafts with it."""
    proc, out = plain_runs["hydra"]
    assert_head_written(proc, out)
    config = json.loads((out / "head" / "config.json").read_text())
    assert config["family"] == "hydra" and config["head"]["num_heads"] == 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/acc_3" in r for r in records)  # one accuracy per head
    last = plain_runs["hydra infer"][0].stdout.strip().splitlines()[-1]
    assert "[hydra head" in last and "8 tokens" in last and "identical to plain greedy: yes" in last, last


def test_medusa2_head_trains_and_infer_py_runs_it_on_the_adapted_target(plain_runs):
    """head=medusa2 end to end: train.py writes the heads with their adapter (and the merged target
    on request), infer.py folds the adapter into the target and decodes losslessly against it."""
    proc, out = plain_runs["medusa2"]
    assert_head_written(proc, out)
    assert json.loads((out / "head" / "config.json").read_text())["family"] == "medusa2"
    assert (out / "head" / "adapter" / "adapter_config.json").is_file()
    assert (out / "head" / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "merged" / "model.safetensors").is_file() and (out / "merged" / "tokenizer.json").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/lm_weight"] for r in records if "train/lm_weight" in r] == [
        0.0,
        0.0,
        10.0,
    ]  # the stages (lambda 10)
    last = plain_runs["medusa2 infer"][0].stdout.strip().splitlines()[-1]
    assert "[medusa2 head" in last and "8 tokens" in last and "identical to plain greedy: yes" in last, last


def two_rank_run(
    out: Path, data: Path, launcher: list[str], *extra: str, last: bool = True
) -> subprocess.CompletedProcess:
    proc = run(
        [*launcher, "train.py", "head=eagle3", "train.max_steps=3", "train.batch_size=2", *tiny_args(data, out), *extra]
    )
    assert_head_written(proc, out, last)
    assert json.loads((out / "checkpoints" / "step-3" / "complete.json").read_text())["world_size"] == 2
    # both ranks reported their peak memory, and agreed on the trained weights (or the run fails)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get(f"train/peak_mem_gb/rank{k}", 0) > 0 for r in logged if "train/loss" in r for k in (0, 1))
    training = json.loads((out / "head" / "config.json").read_text())["training"]
    assert len(training["trained_weights_sha256"]) == 64
    return proc


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r] + [r["eval/loss"] for r in rows if "eval/loss" in r]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def deepspeed_launcher() -> list[str]:
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]


@pytest.fixture(scope="module")
def zero2_launch(chats, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The reference 2-rank run: ZeRO-2, the whole target on each rank (logged every step),
    started by the `deepspeed` launcher."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    proc = two_rank_run(out, chats, deepspeed_launcher(), "deepspeed=zero2", "train.log_every=1", last=False)
    return proc, out


@pytest.fixture(scope="module")
def zero2_run(zero2_launch) -> Path:
    return zero2_launch[1]


def test_two_ranks_zero2_on_cpu(zero2_run):
    files = {p.name for p in (zero2_run / "checkpoints" / "step-3").iterdir()}
    # ZeRO-2 partitions the optimizer state: one shard per rank
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files


def test_two_ranks_zero1_trains_like_zero2(zero2_run, chats, tmp_path):
    out = tmp_path / "run"
    two_rank_run(out, chats, TORCHRUN, "deepspeed=zero1", "train.log_every=1")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in {p.name for p in (out / "checkpoints" / "step-3").iterdir()}
    assert losses(out) == pytest.approx(losses(zero2_run), rel=1e-5)


def test_zero3_with_a_sharded_target_trains_like_the_whole_target(zero2_run, chats, plain_runs, tmp_path):
    """ZeRO-3 for the head and the frozen target partitioned over the ranks: the same losses as
    ZeRO-2 with the whole target on each rank, and as one rank taking the same global batch."""
    out = tmp_path / "run"
    proc = two_rank_run(out, chats, TORCHRUN, "deepspeed=zero3", "deepspeed.shard_target=true", "train.log_every=1")
    assert "the frozen target is sharded over 2 ranks" in proc.stderr
    files = {p.name for p in (out / "checkpoints" / "step-3").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"} <= files
    sharded, whole = losses(out), losses(zero2_run)
    assert len(sharded) == 4 and sharded == pytest.approx(whole, rel=1e-5)
    one = plain_runs["one-rank"][1]  # one process, the same data, batch_size=4
    # one rank averages the loss over the 4 rows' tokens, two ranks average their 2-row means
    assert losses(one) == pytest.approx(sharded, rel=2e-3) and losses(one) != sharded


def test_the_deepspeed_launcher_runs_two_cpu_ranks(zero2_launch):
    """The README's `deepspeed` form (it appends --local_rank=N, which train.py moves to the env):
    the reference ZeRO-2 run is started so (two_rank_run checked its head, its world of 2 and both
    ranks' reports); train.py's head path is among the launcher's lines."""
    proc, out = zero2_launch
    assert_head_written(proc, out, last=False)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
