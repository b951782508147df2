"""Medusa-2 through the Trainer: the heads and the LoRA in one DeepSpeed engine, the two stages,
resume, the head directory with its adapter and the merged target; offline features refused."""

import json

import pytest
import torch
from conftest import write_conversations

from specheads.config.model import ModelConfig
from specheads.config.train import DataConfig, HeadConfig, TrainConfig, TrainJobConfig, WandbConfig
from specheads.errors import SpecHeadsError
from specheads.heads.medusa2 import ADAPTER_DIR, ADAPTER_WEIGHTS, MERGED_KEY
from specheads.target import load_target
from specheads.train.run import head_and_states, train
from specheads.train.trainer import Trainer


def job(data, out, **head) -> TrainJobConfig:
    return TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family="medusa2", lora_r=4, heads_only_steps=3, lm_loss_warmup_steps=2, **head),
        data=DataConfig(path=str(data), max_length=96, eval_fraction=0.25),
        train=TrainConfig(lr=3e-3, warmup_steps=2, batch_size=4, max_steps=8),
        wandb=WandbConfig(mode="disabled"),
        output_dir=str(out),
    )


def trainer_for(cfg, world, out) -> Trainer:
    """A trainer on a fresh target (a medusa2 head adapts its target)."""
    target = load_target(cfg.model)
    torch.manual_seed(0)
    return Trainer(cfg, *head_and_states(cfg, target, world), world, out)


def ids(params) -> set[int]:
    return {id(p) for p in params}


def test_heads_and_lora_train_in_one_engine_and_resume(world, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    out = tmp_path / "run"
    cfg = job(data, out, merge_lora=True)
    trainer = trainer_for(cfg, world, out)
    head, adapter = trainer.head, trainer.head.target_adapter()
    model = trainer.source.target.model
    assert ids(trainer.engine.module.parameters()) == ids(head.parameters()) | ids(adapter.parameters())
    base0 = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    lora0 = {k: v.clone() for k, v in adapter.state_dict().items()}
    moved = []
    for step in range(cfg.train.max_steps):
        metrics = trainer.train_step()
        moved.append(sum(not torch.equal(v, lora0[k]) for k, v in adapter.state_dict().items()))
        assert {"lm_weight", "loss_0", "acc_3"} <= set(metrics)
        assert ("lm_loss" in metrics) == (step > cfg.head.heads_only_steps)  # lambda ramps from 0
    assert moved[:3] == [0, 0, 0] and moved[-1] == len(lora0), moved  # stage 1, then every A and B
    assert all(torch.equal(v, base0[k]) for k, v in model.state_dict().items() if ".lora_" not in k)
    result = trainer.evaluate()
    assert 1.0 <= result["eval/sim_tau"] <= 5.0 and torch.isfinite(torch.tensor(result["eval/loss"]))
    trainer.save()
    path = trainer.write_head(out / "head", {"steps": trainer.step})
    assert (path / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file() and (path / "model.safetensors").is_file()
    assert MERGED_KEY in json.loads((out / "merged" / "config.json").read_text())
    # the checkpoint holds the LoRA with the heads: a resumed run on a fresh target continues both
    again = trainer_for(cfg, world, out)
    assert again.resume() == cfg.train.max_steps
    for now, saved in ((again.head, head), (again.head.target_adapter(), adapter)):
        assert all(torch.equal(a, b) for a, b in zip(now.state_dict().values(), saved.state_dict().values()))


def test_the_lora_trains_at_its_own_learning_rate(world, tmp_path):
    from specheads.train.deepspeed_config import param_groups
    from specheads.train.trainer import HeadObjective

    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    peaks = {}
    for lora_lr in (None, 3e-4):
        trainer = trainer_for(job(data, tmp_path / f"run-{lora_lr}", lora_lr=lora_lr), world, tmp_path)
        head, adapter = trainer.head, trainer.head.target_adapter()
        groups = param_groups(HeadObjective(head), 0.0, None if lora_lr is None else (adapter, lora_lr))
        lora = ids(adapter.parameters())
        # every trained parameter in exactly one group; the LoRA's groups hold nothing else
        assert sorted(id(p) for g in groups for p in g["params"]) == sorted(ids(trainer.engine.module.parameters()))
        own = [g for g in groups if "lr" in g]
        assert ids(p for g in own for p in g["params"]) == (lora if lora_lr else set())
        # the engine's schedule starts from those peaks, group by group
        peaks[lora_lr] = trainer.engine.lr_scheduler.base_lrs
        assert peaks[lora_lr] == [g.get("lr", 3e-3) for g in groups]
    assert set(peaks[None]) == {3e-3} and set(peaks[3e-4]) == {3e-3, 3e-4}


def test_offline_features_cannot_feed_a_medusa2_head(tmp_path):
    cfg = job(tmp_path / "chats.jsonl", tmp_path / "run")
    cfg.data.features = "auto"
    with pytest.raises(SpecHeadsError, match="data.features=auto cannot feed it") as err:
        train(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()  # refused before anything loads
