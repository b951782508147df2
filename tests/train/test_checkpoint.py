"""Checkpoints are atomic, pruned, and a killed run resumes to the same weights as an unbroken one."""

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import write_conversations
from safetensors.torch import load_file
from test_train import ROOT, assert_head_written, clean_env, run, tiny_args

from specheads.errors import SpecHeadsError
from specheads.train.checkpoint import COMPLETE, Checkpoints, capture_rng, load_rng, restore_rng, save_rng


class TorchFiles:
    """DeepSpeed's default checkpoint engine, as far as loading goes: it unpickles."""

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)


class FakeEngine:
    """Stands in for a DeepSpeed engine: one file per checkpoint holding the client state, read
    through its checkpoint engine as DeepSpeed's load_checkpoint reads its files."""

    def __init__(self):
        self.loaded = None
        self.checkpoint_engine = TorchFiles()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert not save_latest  # DeepSpeed's "latest" file would point into a temporary name
        path = f"{save_dir}/{tag}"
        import os

        os.makedirs(path, exist_ok=True)
        torch.save(client_state, f"{path}/state.pt")

    def load_checkpoint(self, load_dir, tag, **kwargs):
        self.loaded = tag
        return f"{load_dir}/{tag}", self.checkpoint_engine.load(f"{load_dir}/{tag}/state.pt")


def test_keeps_the_newest_complete_checkpoints(tmp_path):
    ckpts = Checkpoints(tmp_path, keep=2)
    engine = FakeEngine()
    for step in (2, 4, 6):
        ckpts.save(engine, step, {"step": step})
    assert [s for s, _ in ckpts.complete()] == [4, 6]
    assert ckpts.latest() == tmp_path / "checkpoints" / "step-6"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert ckpts.load(engine, ckpts.latest())["step"] == 6 and engine.loaded == "step-6"


def test_partial_checkpoints_are_ignored_then_removed(tmp_path):
    ckpts = Checkpoints(tmp_path, keep=0)
    ckpts.save(FakeEngine(), 3, {"step": 3})
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-5").mkdir()  # killed while writing
    (root / "step-7").mkdir()  # no completion marker
    assert ckpts.latest() == root / "step-3"
    ckpts.remove_partial()
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]


def test_world_size_must_match_on_resume(tmp_path):
    Checkpoints(tmp_path, world_size=1).save(FakeEngine(), 1, {"step": 1})
    ckpts = Checkpoints(tmp_path, world_size=1)
    marker = ckpts.latest() / COMPLETE
    marker.write_text(json.dumps({"step": 1, "world_size": 4}))
    with pytest.raises(SpecHeadsError, match="4 ranks"):
        ckpts.load(FakeEngine(), ckpts.latest())


def test_rng_round_trip(tmp_path):
    """Through the checkpoint's safetensors file: python's, numpy's and torch's generators all
    continue where they were (a Gaussian cached by numpy too)."""
    import random

    import numpy as np

    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    save_rng(capture_rng(), tmp_path / "rng.safetensors")
    a = (torch.rand(3), random.random(), np.random.standard_normal(2))
    restore_rng(load_rng(tmp_path / "rng.safetensors"))
    b = (torch.rand(3), random.random(), np.random.standard_normal(2))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


class RunsCode:
    """A pickle that runs a command when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.mark.parametrize("where", ["deepspeed", "rng"])
def test_resuming_never_unpickles_a_checkpoint(tmp_path, where):
    """A checkpoint directory from someone else: a DeepSpeed file that unpickles to code is refused
    in one line by the weights-only loader; the RNG file is safetensors, and an old pickled one is
    not read at all. Either way the code never ran (it fails on the loads used before)."""
    ckpts = Checkpoints(tmp_path)
    ckpts.save(FakeEngine(), 2, {"step": 2})
    step = ckpts.latest()
    ran = tmp_path / "ran"
    if where == "deepspeed":
        torch.save({"step": RunsCode(ran)}, step / "state.pt")
        refusal = r"cannot be loaded without unpickling arbitrary code"
    else:
        (step / "rng-rank0.safetensors").unlink()
        torch.save(RunsCode(ran), step / "rng-rank0.pt")
        refusal = r"rng-rank0.safetensors is not an RNG state written by this version"
    with pytest.raises(SpecHeadsError, match=refusal):
        ckpts.load(FakeEngine(), step)
    assert not ran.exists()
    engine = FakeEngine()
    with pytest.raises(SpecHeadsError):
        ckpts.load(engine, step)
    assert isinstance(engine.checkpoint_engine, TorchFiles)  # DeepSpeed's own engine is put back


def test_kill_during_training_then_resume_gives_the_same_weights(tmp_path):
    """EAGLE-1 draws feature noise every step, so the RNG states must be restored too."""
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    steps = 12
    args = [
        "head=eagle",
        f"train.max_steps={steps}",
        "train.save_every=2",
        "train.keep_checkpoints=2",
        "train.eval_every=10",
        "train.log_every=1",
        "train.batch_size=2",
    ]
    # the unbroken reference runs beside the run that gets killed (each child is single-threaded)
    beside = ThreadPoolExecutor(1)
    unbroken = beside.submit(run, [sys.executable, "train.py", *args, *tiny_args(data, tmp_path / "unbroken")])
    beside.shutdown(wait=False)

    out = tmp_path / "broken"
    cmd = [sys.executable, "train.py", *args, *tiny_args(data, out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = out / "checkpoints" / "step-4" / COMPLETE
    deadline = time.time() + 180
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (out / "head").exists()

    resumed = run(cmd)
    assert "resuming from step" in resumed.stderr
    assert_head_written(resumed, out)
    assert_head_written(unbroken.result(timeout=240), tmp_path / "unbroken")
    a = load_file(str(tmp_path / "unbroken" / "head" / "model.safetensors"))
    b = load_file(str(out / "head" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the unbroken run"
    # what the killed run logged after its last checkpoint is dropped, not duplicated
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, steps + 1))


def test_a_head_field_added_later_keeps_old_checkpoints_resumable():
    from dataclasses import asdict

    from specheads.config.train import HeadConfig
    from specheads.train.trainer import fingerprint_diffs

    now = {"head": asdict(HeadConfig(family="eagle3")), "batch_size": 4}
    old_head = {k: v for k, v in now["head"].items() if not k.startswith("lora_")}  # before the field existed
    assert fingerprint_diffs({"head": old_head, "batch_size": 4}, now) == []
    changed = {"head": {**now["head"], "lora_r": 4}, "batch_size": 4}
    assert fingerprint_diffs({"head": old_head, "batch_size": 4}, changed)  # set away from its default
    assert fingerprint_diffs({"head": old_head, "batch_size": 8}, now) == ["batch_size 8 -> 4"]


def test_a_resumed_run_with_another_step_count_decays_to_its_new_end(capsys):
    from types import SimpleNamespace

    from specheads.train.schedule import warmup_cosine_scheduler
    from specheads.train.trainer import Trainer

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = warmup_cosine_scheduler(opt, 0, 535, 0.1)
    for _ in range(150):
        opt.step()
        sched.step()
    trainer = Trainer.__new__(Trainer)  # only what retarget_schedule reads
    trainer.engine = SimpleNamespace(lr_scheduler=sched)
    trainer.max_steps, trainer.d = 330, SimpleNamespace(is_main=True)
    trainer.retarget_schedule()
    assert "schedule now ends at step 330 (was 535)" in capsys.readouterr().err
    for _ in range(180):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # fully decayed at the new end


def test_a_checkpoint_from_before_the_data_digest_resumes_on_its_row_count():
    from specheads.train.trainer import fingerprint_diffs

    now = {"train_rows": 24, "train_data": "ab12", "group_by_length": False}
    assert fingerprint_diffs({"train_rows": 24}, now) == []
    assert fingerprint_diffs({"train_rows": 25}, now) == ["train_rows 25 -> 24"]
    assert fingerprint_diffs({**now, "train_data": "cd34"}, now) == ["train_data 'cd34' -> 'ab12'"]
