"""Checkpoints are atomic, pruned, and a killed run resumes to the same weights as an unbroken one."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from test_train import ROOT, assert_head_written, clean_env, run, tiny_args, write_conversations

from specheads.errors import SpecHeadsError
from specheads.train.checkpoint import COMPLETE, Checkpoints, capture_rng, restore_rng


class FakeEngine:
    """Stands in for a DeepSpeed engine: one file per checkpoint holding the client state."""

    def __init__(self):
        self.loaded = None

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert not save_latest  # DeepSpeed's "latest" file would point into a temporary name
        path = f"{save_dir}/{tag}"
        import os

        os.makedirs(path, exist_ok=True)
        torch.save(client_state, f"{path}/state.pt")

    def load_checkpoint(self, load_dir, tag, **kwargs):
        self.loaded = tag
        return f"{load_dir}/{tag}", torch.load(f"{load_dir}/{tag}/state.pt")


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


def test_rng_round_trip():
    state = capture_rng()
    a = torch.rand(3)
    restore_rng(state)
    assert torch.equal(torch.rand(3), a)


def test_kill_during_training_then_resume_gives_the_same_weights(tmp_path):
    """EAGLE-1 draws feature noise every step, so the RNG states must be restored too."""
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    steps = 30
    args = [
        "head=eagle",
        f"train.max_steps={steps}",
        "train.save_every=2",
        "train.keep_checkpoints=2",
        "train.eval_every=10",
        "train.log_every=1",
        "train.batch_size=2",
    ]
    reference = run([sys.executable, "train.py", *args, *tiny_args(data, tmp_path / "unbroken")])
    assert_head_written(reference, tmp_path / "unbroken")

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
    a = load_file(str(tmp_path / "unbroken" / "head" / "model.safetensors"))
    b = load_file(str(out / "head" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the unbroken run"
    # what the killed run logged after its last checkpoint is dropped, not duplicated
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, steps + 1))
