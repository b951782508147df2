"""train(): what the head directories of a run record of it."""

import json

from conftest import write_conversations

from specheads import provenance
from specheads.config.model import ModelConfig
from specheads.config.train import DataConfig, HeadConfig, TrainConfig, TrainJobConfig, WandbConfig
from specheads.train import run


def test_every_head_of_a_run_records_the_commit_it_started_at(tmp_path, monkeypatch):
    """A commit made while the run trains does not rename the code that trained it: the checkpoint
    heads and the final head all name the commit read at the start (a fake git here, that moves on
    at every call: it fails if a head reads the commit when it is written)."""
    commits = iter(f"commit-{i}" for i in range(100))
    monkeypatch.setattr(provenance, "git_commit", lambda: next(commits))
    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    out = tmp_path / "run"
    cfg = TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family="eagle3"),
        data=DataConfig(path=str(data), max_length=64, eval_fraction=0.25),
        train=TrainConfig(warmup_steps=1, batch_size=2, max_steps=2, save_every=1, save_heads=True, eval_every=0),
        wandb=WandbConfig(mode="disabled"),
        output_dir=str(out),
    )
    run.train(cfg)
    heads = [out / "head", out / "heads" / "step-1", out / "heads" / "step-2"]
    recorded = [json.loads((h / "config.json").read_text())["training"]["commit"] for h in heads]
    assert recorded == ["commit-0"] * 3
