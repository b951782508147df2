"""OUTPUT_DIR/best: the head of the best evaluation (eval/sim_tau) beside the last, its step named
in its record, and kept across a resume. The evaluations are scripted so the best is not the last."""

import json
import shutil

import pytest
import torch
from conftest import write_conversations
from safetensors.torch import load_file

from specheads.config.model import ModelConfig
from specheads.config.train import DataConfig, HeadConfig, TrackerConfig, TrainConfig, TrainJobConfig
from specheads.train import run
from specheads.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# eval/sim_tau at each evaluated step: the best (step 4) is neither the first nor the last
TAUS = {2: 1.2, 4: 1.9, 6: 1.5, 8: 1.4}


@pytest.fixture
def scripted(monkeypatch):
    def evaluate(self):
        return {"eval/loss": 1.0, "eval/sim_tau": TAUS[self.step], "eval/acc_0": 0.5}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)


def job(data, out, max_steps):
    return TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family="medusa"),
        data=DataConfig(path=str(data), max_length=64, eval_fraction=0.25),
        train=TrainConfig(
            warmup_steps=1, batch_size=2, max_steps=max_steps, eval_every=2, save_every=2, save_heads=True
        ),
        tracker=TrackerConfig(wandb=False),
        output_dir=str(out),
    )


def training(head_dir):
    return json.loads((head_dir / "config.json").read_text())["training"]


def same_weights(a, b) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def assert_best_is_step_4(out):
    best = {"metric": "eval/sim_tau", "value": 1.9, "step": 4}
    assert training(out / "best")["best"] == best and training(out / "best")["steps"] == 4
    assert training(out / "head")["best"] == best and training(out / "head")["steps"] == 8
    assert same_weights(out / "best", out / "heads" / "step-4")
    assert not same_weights(out / "best", out / "head")


def test_the_best_evaluation_is_kept_beside_the_last(scripted, tmp_path, capsys):
    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    out = tmp_path / "run"
    assert run.train(job(data, out, 8)) == out / "head"
    assert_best_is_step_4(out)
    assert "best head: step 4, eval/sim_tau 1.900" in capsys.readouterr().err


def test_a_resumed_run_keeps_the_best_of_the_steps_before_it(scripted, tmp_path, monkeypatch):
    """Steps 1-4 (best at 4), then a resume to step 8 whose evaluations are all worse: best/ stays
    step 4's. A resume that forgot the best (the variant below) would keep step 6's instead."""
    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    out, forgetful = tmp_path / "run", tmp_path / "forgetful"
    run.train(job(data, out, 4))
    assert training(out / "best")["best"]["step"] == 4
    shutil.copytree(out, forgetful)
    run.train(job(data, out, 8))
    assert_best_is_step_4(out)

    resume = Trainer.resume

    def resume_forgetting_the_best(self):
        step = resume(self)
        self.best = None
        return step

    monkeypatch.setattr(Trainer, "resume", resume_forgetting_the_best)
    run.train(job(data, forgetful, 8))
    with pytest.raises(AssertionError):
        assert_best_is_step_4(forgetful)
    assert training(forgetful / "best")["best"]["step"] == 6
