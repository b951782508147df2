"""The trainer on the tiny target in this process (a world of one, gloo): batches, schedule,
DeepSpeed config, and every head's loss falling through deepspeed.initialize."""

from dataclasses import replace

import pytest
import torch
from conftest import write_conversations

from specheads.config.model import ModelConfig
from specheads.config.train import DataConfig, DeepSpeedConfig, HeadConfig, TrainConfig, TrainJobConfig, WandbConfig
from specheads.errors import SpecHeadsError
from specheads.numerics import same_numbers
from specheads.train.batches import TrainBatches, eval_batches, training_order
from specheads.train.deepspeed_config import deepspeed_config
from specheads.train.metrics import MetricsLog
from specheads.train.run import head_and_states
from specheads.train.schedule import TimeBudget, WarmupCosine
from specheads.train.state_source import OnlineStates
from specheads.train.trainer import Trainer


def test_warmup_cosine_shape():
    f = WarmupCosine(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    warm = [f(s) for s in range(11)]
    assert all(a < b for a, b in zip(warm, warm[1:])) and warm[-1] == pytest.approx(1.0)
    decay = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert f(60) == pytest.approx(0.55)  # half way down the cosine


def test_time_budget_projects_the_end_from_the_settled_rate():
    now = [100.0]
    budget = TimeBudget(minutes=1.0, first_step=0, settle_steps=2, clock=lambda: now[0])
    assert budget.projected_end(1, 10_000) is None  # still settling
    now[0] = 104.0
    assert budget.projected_end(2, 10_000) is None  # the estimate starts here, at 2 steps in 4 s
    now[0] = 114.0
    # 10 steps in 10 s since settling, 46 s left: the schedule should end 46 steps later
    assert budget.projected_end(12, 10_000) == 58
    assert budget.projected_end(12, 40) == 40  # never past max_steps
    assert not budget.spent()
    now[0] = 160.0
    assert budget.spent() and budget.projected_end(60, 10_000) == 60  # the schedule ends here
    with pytest.raises(ValueError, match="max_minutes must be > 0"):
        TimeBudget(minutes=0, first_step=0)


def test_train_batches_shard_like_a_distributed_sampler():
    lengths = [(7 * i) % 50 + 1 for i in range(40)]
    ranks = [TrainBatches(lengths, batch_size=3, rank=r, world_size=2, seed=1) for r in range(2)]
    assert ranks[0].batches_per_epoch == 40 // 6
    for i in range(ranks[0].batches_per_epoch):
        a, b = ranks[0][i], ranks[1][i]
        assert len(a) == len(b) == 3 and not set(a) & set(b)
    epoch0 = [row for i in range(6) for r in ranks for row in r[i]]
    assert len(set(epoch0)) == 36  # an epoch reads each row at most once
    again = TrainBatches(lengths, batch_size=3, rank=1, world_size=2, seed=1)
    assert [again[i] for i in (9, 3, 0)] == [ranks[1][i] for i in (9, 3, 0)]  # random access = resume
    assert [ranks[0][i] for i in range(6)] != [ranks[0][i] for i in range(6, 12)]  # epochs reshuffle


def test_data_seed_fixes_the_order_while_seed_varies():
    lengths = [(7 * i) % 50 + 1 for i in range(40)]

    def order(**seeds):
        cfg = TrainJobConfig(model=ModelConfig(), train=TrainConfig(batch_size=4), **seeds)
        _, batches = training_order(cfg, lengths)
        return [batches[i] for i in range(batches.batches_per_epoch)]

    assert order(seed=0) != order(seed=1)  # the seed orders the rows unless data_seed is set
    assert order(seed=1, data_seed=0) == order(seed=0) == order(seed=2, data_seed=0)
    assert order(seed=0, data_seed=3) == order(seed=3)


def test_group_by_length_pads_less():
    lengths = [int(x) for x in torch.randint(1, 500, (256,), generator=torch.Generator().manual_seed(0))]

    def padded(group):
        b = TrainBatches(lengths, batch_size=8, seed=0, group_by_length=group)
        return sum(max(lengths[i] for i in b[k]) * 8 for k in range(b.batches_per_epoch))

    assert padded(True) < 0.8 * padded(False)


def test_too_little_data_is_a_clear_error():
    with pytest.raises(SpecHeadsError, match="cannot fill one batch"):
        TrainBatches([5, 6, 7], batch_size=2, world_size=2)


def test_eval_batches_give_every_rank_the_same_count():
    lengths = list(range(1, 24))
    per_rank = [eval_batches(lengths, 4, rank=r, world_size=3) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1
    rows = [i for b in per_rank for batch in b for i in batch]
    assert len(rows) == len(set(rows)) == 21
    assert len(eval_batches(lengths, 4, max_batches=2)) == 2


def test_deepspeed_config_follows_the_job():
    t = TrainConfig(batch_size=3, grad_accum=2)
    z = DeepSpeedConfig(zero_stage=3, extra={"checkpoint": {"tag_validation": "Fail"}})
    ds = deepspeed_config(t, z, world_size=4, device=torch.device("cpu"), head_dtype=torch.float32)
    assert ds["train_batch_size"] == 24 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 3 and not ds["bf16"]["enabled"]
    assert ds["checkpoint"] == {"tag_validation": "Fail"}
    assert deepspeed_config(t, z, 1, torch.device("cpu"), torch.bfloat16)["bf16"]["enabled"]
    with pytest.raises(SpecHeadsError, match="zero_stage=3"):
        deepspeed_config(t, replace(z, zero_stage=2, offload_param=True), 1, torch.device("cpu"), torch.float32)


def job(family, data, out, **train):
    return TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family=family),
        data=DataConfig(path=str(data), max_length=96, eval_fraction=0.25),
        train=TrainConfig(**{"lr": 3e-3, "warmup_steps": 2, "batch_size": 4, **train}),
        wandb=WandbConfig(mode="disabled"),
        output_dir=str(out),
    )


@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3"])
def test_loss_falls_through_the_engine(family, world, tiny_target, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    cfg = job(family, data, tmp_path / "run", max_steps=20)
    torch.manual_seed(0)
    head, source = head_and_states(cfg, tiny_target, world)
    target_before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    trainer = Trainer(cfg, head, source, world, tmp_path / "run")
    # only the head is wrapped: its parameters are exactly the engine's
    assert {id(p) for p in trainer.engine.module.parameters()} == {id(p) for p in head.parameters()}
    before = trainer.evaluate()
    losses = [trainer.train_step()["loss"] for _ in range(20)]
    after = trainer.evaluate()
    assert after["eval/loss"] < 0.95 * before["eval/loss"], (before, after)
    assert sum(losses[-5:]) < sum(losses[:5])
    depth = head.spec.eval_depth if family != "eagle" else len([k for k in after if k.startswith("eval/acc_")])
    assert [k for k in after if k.startswith("eval/acc_")] == [f"eval/acc_{i}" for i in range(depth)]
    assert 1.0 <= after["eval/sim_tau"] <= 1.0 + depth
    assert all(torch.equal(v, target_before[k]) for k, v in tiny_target.model.state_dict().items())


def test_a_spent_budget_ends_the_run_like_max_steps(world, tiny_target, tmp_path, monkeypatch):
    """train.max_minutes stops the run with its final evaluation and checkpoint, and ends the cosine
    where the budget was projected to end (the clock is faked: one step a second, two minutes)."""
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    out = tmp_path / "run"
    cfg = job("medusa", data, out, max_steps=1000, max_minutes=2.0, eval_every=0, save_every=0, log_every=1000)
    clock = [0.0]
    monkeypatch.setattr(
        "specheads.train.trainer.TimeBudget",
        lambda minutes, first_step: TimeBudget(minutes, first_step, clock=lambda: clock[0]),
    )
    torch.manual_seed(0)
    trainer = Trainer(cfg, *head_and_states(cfg, tiny_target, world), world, out)
    steps = trainer.train_step

    def one_second_step():
        clock[0] += 1.0
        return steps()

    trainer.train_step = one_second_step
    trainer.fit(MetricsLog(out, WandbConfig(mode="disabled"), {}, enabled=True))
    assert trainer.step == 120
    assert trainer.engine.lr_scheduler.lr_lambdas[0].total_steps == 120
    assert trainer.checkpoints.latest() is not None and trainer.last_eval


def test_resume_continues_the_same_run_and_refuses_another(world, tiny_target, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    out = tmp_path / "run"

    def trainer(family, **train):
        cfg = job(family, data, out, max_steps=4, **train)
        torch.manual_seed(0)
        return Trainer(cfg, *head_and_states(cfg, tiny_target, world), world, out)

    first = trainer("medusa")
    first.origin = {"commit": "c1", "command": "train.py first"}
    for _ in range(2):
        first.train_step()
    first.save()
    second = trainer("medusa")
    second.origin = {"commit": "c2", "command": "train.py second"}
    assert second.resume() == 2
    assert all(torch.equal(a, b) for a, b in zip(first.head.parameters(), second.head.parameters()))
    # the resumed run names who trained which steps (its own commit and command are only the last)
    assert second.segments() == [
        {"steps": [0, 2], "commit": "c1", "command": "train.py first"},
        {"steps": [2, 2], "commit": "c2", "command": "train.py second"},
    ]
    # a checkpoint from before checkpoints named their segments: its steps' code is not invented
    state = {"step": 2, "micro_batches": 2, "fingerprint": first.fingerprint(), "last_eval": {}}
    first.checkpoints.save(first.engine, 2, state)
    third = trainer("medusa")
    assert third.resume() == 2
    assert third.segments()[0] == {"steps": [0, 2], "commit": None, "command": None}
    with pytest.raises(SpecHeadsError, match="different run.*grad_accum 1 -> 2"):
        trainer("medusa", grad_accum=2).resume()


def test_offline_features_feed_the_same_trainer(world, tiny_target, tmp_path):
    """data.features swaps the online target forwards for a feature cache: same batches, same states."""
    from specheads.data.datasets import build_datasets
    from specheads.data.features import ensure_split_features
    from specheads.heads import build_head

    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    cfg = job("eagle3", data, tmp_path / "run", max_steps=10)
    train_rows, eval_rows = build_datasets(cfg.data, tiny_target.tokenizer)
    torch.manual_seed(0)
    head = build_head(cfg.head, tiny_target, train_rows=train_rows)
    layer_ids, final = head.training_states()
    ensure_split_features(
        tiny_target,
        {"train": train_rows, "eval": eval_rows},
        layer_ids,
        final,
        tmp_path / "features",
        cfg.data.max_length,
        dtype="float32",
    )
    cfg.data.features = str(tmp_path / "features")
    _, offline = head_and_states(cfg, tiny_target, world)
    online = OnlineStates(tiny_target, {"train": train_rows, "eval": eval_rows}, tiny_target.tokenizer.pad_token_id)
    online.require(layer_ids, final)
    offline.require(layer_ids, final)
    (b1, s1), (b2, s2) = offline.fetch("train", [3, 0]), online.fetch("train", [3, 0])
    assert all(torch.equal(b1[k], b2[k]) for k in b2)
    mask = b2["attention_mask"].bool()
    assert all(same_numbers(s1[k][mask], s2[k][mask]) for k in s2)
    trainer = Trainer(cfg, head, offline, world, tmp_path / "run")
    before = trainer.evaluate()["eval/loss"]
    for _ in range(10):
        trainer.train_step()
    assert trainer.evaluate()["eval/loss"] < before


def test_auto_features_are_cached_once_per_data(world, tiny_target, tmp_path, monkeypatch):
    """data.features=auto: the first run caches the states under the cache root, the next reuses
    them, and other data gets a cache of its own."""
    from specheads.data import features as features_module

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    writes = []
    real_write = features_module.write_features
    monkeypatch.setattr(features_module, "write_features", lambda *a, **k: writes.append(a[4]) or real_write(*a, **k))
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    cfg = job("eagle3", data, tmp_path / "run", max_steps=2)
    cfg.data.features = "auto"
    head, source = head_and_states(cfg, tiny_target, world)
    assert head.training_states() == ([2, 3], True)  # what the cache holds: the head's own states
    assert len(writes) == 2 and all(str(w).startswith(str(tmp_path / "cache" / "features")) for w in writes)
    source.require([2], True)
    batch, states = source.fetch("train", [0, 1])
    assert states[2].dtype == torch.float32 and states["final"].shape[:2] == batch["input_ids"].shape
    head_and_states(cfg, tiny_target, world)
    assert len(writes) == 2  # reused
    cfg.data.max_examples = 20
    head_and_states(cfg, tiny_target, world)
    assert len(writes) == 4 and writes[2].parent != writes[0].parent


def test_ranks_that_disagree_on_the_trained_weights_fail_the_run(monkeypatch):
    from types import SimpleNamespace

    from specheads.distributed import Dist
    from specheads.train import trainer as trainer_module

    head = torch.nn.Linear(3, 2)
    head.bias.requires_grad_(False)  # frozen weights are not part of the digest
    fake = SimpleNamespace(engine=SimpleNamespace(module=head), d=Dist(0, 0, 2, torch.device("cpu")))
    monkeypatch.setattr(trainer_module, "all_gather_objects", lambda value: [value, value])
    digest = Trainer.agreed_weights_digest(fake)
    with torch.no_grad():
        head.bias.add_(1)
    assert Trainer.agreed_weights_digest(fake) == digest
    with torch.no_grad():
        head.weight.add_(1)
    assert Trainer.agreed_weights_digest(fake) != digest
    monkeypatch.setattr(trainer_module, "all_gather_objects", lambda value: [value, "0" * 64])
    with pytest.raises(SpecHeadsError, match=r"rank\(s\) \[1\] hold head weights different"):
        Trainer.agreed_weights_digest(fake)


def test_autocast_trains_in_bf16_with_float32_weights(world, tiny_target, tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", n=32)

    def first_losses(autocast, steps=6):
        cfg = job("eagle3", data, tmp_path / f"run-{autocast}", max_steps=steps, autocast=autocast)
        torch.manual_seed(0)
        trainer = Trainer(cfg, *head_and_states(cfg, tiny_target, world), world, tmp_path / f"run-{autocast}")
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        return losses, trainer

    plain, _ = first_losses(None)
    mixed, trainer = first_losses("bfloat16")
    assert all(p.dtype == torch.float32 for p in trainer.head.parameters())
    # the matmuls really ran in bf16 (other losses), and they track the float32 run closely
    assert mixed[0] != plain[0]
    assert mixed == pytest.approx(plain, rel=0.02)
    assert sum(mixed[-2:]) < sum(mixed[:2])
    with pytest.raises(SpecHeadsError, match="train.autocast must be null, bfloat16 or float16"):
        first_losses("int8", steps=1)


@pytest.mark.parametrize(
    "changed, line",
    [
        ({"lr": 1e-3}, r"train\.lr 0\.003 -> 0\.001"),
        ({"warmup_steps": 5}, r"train\.warmup_steps 2 -> 5"),
        ({"min_lr_ratio": 0.5}, r"train\.min_lr_ratio 0\.1 -> 0\.5"),
        ({"betas": [0.8, 0.9]}, r"train\.betas \[0\.9, 0\.95\] -> \[0\.8, 0\.9\]"),
        ({"weight_decay": 0.1}, r"train\.weight_decay 0\.0 -> 0\.1"),
    ],
)
def test_resume_refuses_an_optimizer_setting_it_would_ignore(world, tiny_target, tmp_path, changed, line):
    """The checkpoint's optimizer and schedule are restored whole: a changed setting would be silently
    dropped (while the head's record wrote the new one), so it is refused, naming both values."""
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    out = tmp_path / "run"

    def trainer(**train):
        cfg = job("medusa", data, out, max_steps=4, **train)
        torch.manual_seed(0)
        return Trainer(cfg, *head_and_states(cfg, tiny_target, world), world, out)

    first = trainer()
    first.train_step()
    first.save()
    assert trainer().resume() == 1
    with pytest.raises(SpecHeadsError, match=line) as refused:
        trainer(**changed).resume()
    assert "\n" not in str(refused.value)


def test_resume_refuses_other_data_of_the_same_size_and_another_batch_order(world, tiny_target, tmp_path):
    """The rows a checkpoint's step counts index are named by a digest of what they hold, not by
    their count; group_by_length orders them, so it must match too."""
    data = write_conversations(tmp_path / "chats.jsonl", n=32)
    other = write_conversations(tmp_path / "other.jsonl", n=32, seed=1)  # as many rows, other text
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(data.read_bytes())
    out = tmp_path / "run"

    def trainer(path, **train):
        cfg = job("medusa", path, out, max_steps=4, **train)
        torch.manual_seed(0)
        return Trainer(cfg, *head_and_states(cfg, tiny_target, world), world, out)

    first = trainer(data)
    first.train_step()
    first.save()
    assert trainer(moved).resume() == 1  # the same rows under another name
    with pytest.raises(SpecHeadsError, match=r"different run \(train_data '[\w:]+' -> '[\w:]+'\)"):
        trainer(other).resume()
    with pytest.raises(SpecHeadsError, match=r"different run \(group_by_length True -> False\)"):
        trainer(data, group_by_length=False).resume()


@pytest.mark.parametrize("has_bf16", [False, True])
def test_bf16_autocast_on_a_cpu_without_bf16_instructions_says_so(has_bf16, monkeypatch, capsys):
    from specheads.train import trainer

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: has_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    trainer.warn_if_emulated(torch.bfloat16, "cpu")
    trainer.warn_if_emulated(None, "cpu")
    trainer.warn_if_emulated(torch.bfloat16, "cuda")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (0 if has_bf16 else 1) and all("emulated" in line for line in err)
