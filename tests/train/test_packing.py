"""Packed rows (data.pack) against the same conversations one per row: the target's states, every
family's training loss (to fp32 tolerance, under the losses' own per-batch reduction), the feature
cache's packed rows, the resume fingerprint, and train.py end to end. Each equality is shown
failing on a variant that lets attention or a shifted target cross from one conversation into the
next."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_numbers, write_conversations

import specheads.heads.dflash as dflash
import specheads.heads.eagle as eagle
import specheads.heads.early_exit as early_exit
import specheads.heads.hydra as hydra
import specheads.heads.peagle as peagle
import specheads.target as target_module
from specheads.config.model import ModelConfig
from specheads.config.train import HeadConfig
from specheads.data.packing import pack_rows
from specheads.errors import SpecHeadsError
from specheads.heads import build_head
from specheads.target import load_target
from specheads.train.state_source import OfflineStates, OnlineStates
from specheads.train.trainer import fingerprint_diffs

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# the head fields that make every family's loss deterministic (no sampled anchors or depths, no
# feature noise) and quick on the tiny target
FAMILIES = {
    "medusa": dict(num_heads=3),
    "hydra": dict(num_heads=3, hydra_prefix_layer=True, hydra_teacher_loss=True),
    "eagle": dict(noise="none"),
    "eagle3": dict(ttt_steps=3, draft_vocab_size=200),
    "peagle": dict(parallel_depths=3, depth_keep_rate=1.0, depth_min_rate=1.0, draft_vocab_size=200),
    "dflash": dict(block_size=4, anchors_per_sequence=1000),
    "dspark": dict(block_size=4, anchors_per_sequence=1000, markov_rank=8, markov_head_type="gated"),
    "dflash2": dict(block_size=4, anchors_per_sequence=1000, conv_kernel_size=3, selector_rank=8, selector_top_k=40),
    "early_exit": dict(exit_layer=3, adapter_mlp=True),
}
CAPACITY = 44  # a packed row's tokens: two or three of the conversations below, and some padding


def conversations(seed, n=6):
    """n rows of 5..20 random tokens, each answered after a prompt of 0..3 tokens (loss_mask 0)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length, prompt = rng.randint(5, 20), rng.randint(0, 3)
        ids = [rng.randint(3, 250) for _ in range(length)]
        rows.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return rows


def head_for(family, target, rows):
    torch.manual_seed(0)
    head = build_head(HeadConfig(family=family, **FAMILIES[family]), target, train_rows=rows).eval()
    with torch.no_grad():  # no zero-initialised layer left as the identity, where a wrong mask could hide
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def both_ways(family, target, seed):
    """(head, (unpacked batch, states), (packed batch, states)) of the same conversations."""
    rows = conversations(seed)
    head = head_for(family, target, rows)
    source = OnlineStates(target, {"train": rows}, pad_id=0)
    source.require(*head.training_states())
    packs = pack_rows([len(r["input_ids"]) for r in rows], CAPACITY)
    assert len(packs) < len(rows) and any(len(p) > 1 for p in packs)
    return head, source.fetch("train", range(len(rows))), source.fetch_packed("train", packs)


def assert_same_loss(head, plain, packed):
    torch.manual_seed(1)
    loss, metrics = head.loss(*plain)
    torch.manual_seed(1)
    packed_loss, packed_metrics = head.loss(*packed)
    assert_same_numbers(packed_loss, loss)
    assert packed_metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        assert packed_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


# -- the target's states -----------------------------------------------------------------------------


def plain_causal_row(batch):
    """A wrong target forward: a plain causal mask over the packed row, positions running on."""
    return {"attention_mask": batch["attention_mask"]}


def positions_running_on(batch):
    """A wrong target forward: told positions that run on across the row (transformers then sees
    one sequence), no mask."""
    t = batch["input_ids"].shape[1]
    return {"attention_mask": None, "position_ids": torch.arange(t).expand_as(batch["input_ids"]), "use_cache": False}


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_target_states_are_each_conversations_own(tiny_target, seed, monkeypatch):
    rows = conversations(seed)
    packs = pack_rows([len(r["input_ids"]) for r in rows], CAPACITY)

    def check():
        source = OnlineStates(tiny_target, {"train": rows}, pad_id=0)
        source.require([0, 2, 6], True)
        plain, plain_states = source.fetch("train", range(len(rows)))
        batch, states = source.fetch_packed("train", packs)
        for b, pack in enumerate(packs):
            for d, i in enumerate(pack):
                here = batch["document"][b] == d
                n = len(rows[i]["input_ids"])
                assert torch.equal(batch["input_ids"][b][here], plain["input_ids"][i, :n])
                for key in (0, 2, 6, "final"):
                    assert_same_numbers(states[key][b][here], plain_states[key][i, :n])

    check()
    for wrong in (plain_causal_row, positions_running_on):
        monkeypatch.setattr("specheads.train.state_source.forward_masks", wrong)
        with pytest.raises(AssertionError):
            check()


def test_a_target_that_lets_packed_conversations_meet_is_refused(tiny_target, monkeypatch):
    target_module.check_packing(tiny_target)  # the tiny llama keeps them apart
    monkeypatch.setattr(target_module, "forward_masks", lambda batch: {"attention_mask": None})
    with pytest.raises(SpecHeadsError, match="does not keep packed conversations apart.*drop data.pack"):
        target_module.check_packing(tiny_target)


# -- every family's loss -------------------------------------------------------------------------------


def target_leaks(head, batch, states, target):
    """States from a target forward over the packed row with a plain causal mask."""
    layer_ids, final = head.training_states()
    s = target.states(batch["input_ids"], batch["attention_mask"], layer_ids=layer_ids, final=final)
    return batch, {**s.hidden, "final": s.final}


def one_document(head, batch, states, target):
    """The head told the row is one conversation: its attention and shifted targets cross."""
    return {**batch, "document": torch.where(batch["attention_mask"].bool(), 0, -1)}, states


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_batch_has_the_loss_of_its_conversations_unpacked(family, tiny_target):
    for seed in (0, 1):
        head, plain, packed = both_ways(family, tiny_target, seed)
        assert_same_loss(head, plain, packed)
    for wrong in (target_leaks, one_document):
        with pytest.raises(AssertionError):
            assert_same_loss(head, plain, wrong(head, *packed, tiny_target))


def causal_over_the_row(batch):
    t = batch["input_ids"].shape[1]
    return torch.ones(t, t, dtype=torch.bool).tril().expand(len(batch["input_ids"]), 1, t, t)


def one_doc(doc):
    return torch.where(doc >= 0, 0, -1)


# attention alone let across conversations (the shifted targets still cut at their ends)
ATTENTION_LEAKS = {
    "hydra": (hydra, "document_causal_mask", lambda real: causal_over_the_row),
    "eagle": (eagle, "document_causal_mask", lambda real: causal_over_the_row),
    "eagle3": (eagle, "document_causal_mask", lambda real: causal_over_the_row),
    "early_exit": (early_exit, "document_causal_mask", lambda real: causal_over_the_row),
    "peagle": (peagle, "packed_depth_mask", lambda real: lambda doc, *rest: real(one_doc(doc), *rest)),
    "dflash": (
        dflash,
        "block_attention_mask",
        lambda real: lambda ctx, elem, *rest: real(one_doc(ctx), one_doc(elem), *rest),
    ),
    "dspark": (
        dflash,
        "block_attention_mask",
        lambda real: lambda ctx, elem, *rest: real(one_doc(ctx), one_doc(elem), *rest),
    ),
    "dflash2": (
        dflash,
        "block_attention_mask",
        lambda real: lambda ctx, elem, *rest: real(one_doc(ctx), one_doc(elem), *rest),
    ),
}


@pytest.mark.parametrize("family", list(ATTENTION_LEAKS))
def test_attention_leaking_across_conversations_changes_the_loss(family, tiny_target, monkeypatch):
    head, plain, packed = both_ways(family, tiny_target, 0)
    module, name, leak = ATTENTION_LEAKS[family]
    monkeypatch.setattr(module, name, leak(getattr(module, name)))
    with pytest.raises(AssertionError):
        assert_same_loss(head, plain, packed)


def test_medusa2_packed_loss_runs_the_adapted_target_per_conversation():
    """Medusa-2 runs its (LoRA-adapted) target itself: the heads' and the target's own loss."""
    target = load_target(ModelConfig(name="tiny-random", path="tiny:llama"), device=torch.device("cpu"))
    rows = conversations(0)
    torch.manual_seed(0)
    cfg = HeadConfig(
        family="medusa2", num_heads=3, lora_r=4, lora_dropout=0.0, heads_only_steps=0, lm_loss_warmup_steps=0
    )
    head = build_head(cfg, target, train_rows=rows).eval()
    with torch.no_grad():  # a LoRA that changes the target, so that the adapted forward is exercised
        for p in [*head.parameters(), *head.target_adapter().parameters()]:
            p.add_(0.05 * torch.randn_like(p))
    source = OnlineStates(target, {"train": rows}, pad_id=0)
    source.require(*head.training_states())
    plain = source.fetch("train", range(len(rows)))
    packed = source.fetch_packed("train", pack_rows([len(r["input_ids"]) for r in rows], CAPACITY))
    assert "lm_loss" in head.loss(*plain)[1]
    assert_same_loss(head, plain, packed)
    with pytest.raises(AssertionError):
        assert_same_loss(head, plain, one_document(head, *packed, target))


# -- the feature cache, resume, train.py ----------------------------------------------------------------


def test_cached_states_pack_like_a_packed_target_forward(tiny_target, tmp_path):
    from specheads.data.features import ensure_split_features

    rows = conversations(2)
    splits = {"train": rows, "eval": rows[:2]}
    ensure_split_features(tiny_target, splits, [2], True, tmp_path / "feat", max_length=64, dtype="float32")
    offline = OfflineStates(tmp_path / "feat", tiny_target, 64, 0, torch.device("cpu"), torch.float32)
    online = OnlineStates(tiny_target, splits, 0)
    for source in (offline, online):
        source.require([2], True)
    packs = pack_rows([len(r["input_ids"]) for r in rows], CAPACITY)
    (b1, s1), (b2, s2) = offline.fetch_packed("train", packs), online.fetch_packed("train", packs)
    assert b1.keys() == b2.keys() and all(torch.equal(b1[k], b2[k]) for k in b1)
    real = b1["attention_mask"].bool()
    for key in (2, "final"):
        # fp32 noise only: the cache ran each conversation alone, unpadded (matmuls of other shapes)
        assert_same_numbers(s1[key][real], s2[key][real])


def test_a_checkpoint_resumes_only_a_run_packed_alike():
    assert fingerprint_diffs({}, {"pack": None}) == []  # a checkpoint from before packing was unpacked
    assert fingerprint_diffs({}, {"pack": 96}) == ["pack None -> 96"]
    assert fingerprint_diffs({"pack": 96}, {"pack": 128}) == ["pack 96 -> 128"]


def test_train_py_trains_on_packed_rows(tmp_path):
    data = write_conversations(tmp_path / "chats.jsonl", n=24)
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "model=tiny-random", "head=eagle3", "head.ttt_steps=2"]
    cmd += [f"data.path={data}", "data.max_length=96", "data.eval_fraction=0.25", "data.pack=true"]
    cmd += ["train.max_steps=3", "train.batch_size=2", "train.log_every=1", f"output_dir={out}", "wandb.mode=disabled"]
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out / "head")
    assert re.search(r"data: 18 training conversations packed into \d+ rows of up to 96 tokens", proc.stderr)
    metrics = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line]
    assert len(metrics) == 3
