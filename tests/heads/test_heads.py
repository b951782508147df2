import json
from dataclasses import fields

import pytest
import torch
from conftest import assert_other_numbers, assert_same_numbers, batch_rows, head_states, overfit
from safetensors.torch import save_file

from specheads.config.train import HeadConfig, ModelConfig, family_fields
from specheads.errors import SpecHeadsError
from specheads.heads import HEADS, build_head, load_head, save_head
from specheads.heads.base import shifted
from specheads.heads.spec import HeadSpec, default_layer_ids
from specheads.heads.vocab import vocab_from_counts
from specheads.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["medusa", "eagle", "eagle3", "peagle", "dflash"]


def make_head(family, target, batch, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = HeadConfig(family=family, draft_vocab_size=96, num_heads=3, ttt_steps=4, **overrides)
    return build_head(cfg, target, train_rows=batch_rows(batch))


def test_head_spec_is_the_head_config_resolved(tiny_target):
    """One definition per field: HeadSpec is a HeadConfig with the target-dependent defaults filled."""
    info = tiny_target.info
    spec = HeadSpec.from_config(HeadConfig(family="eagle3", draft_vocab_size=10**6, ttt_steps=9), info)
    assert isinstance(spec, HeadConfig) and spec.layer_ids == default_layer_ids("eagle3", info.num_layers)
    assert (spec.intermediate_size, spec.draft_vocab_size, spec.eval_depth) == (
        info.intermediate_size,
        info.vocab_size,
        9,
    )
    # null is a value where it is not "the target's": lora_lr=null trains the LoRA at train.lr
    assert HeadSpec.from_config(HeadConfig(family="medusa2", lora_lr=None), info).lora_lr is None
    assert HeadSpec.from_config(HeadConfig(family="medusa2"), info).lora_lr == HeadConfig().lora_lr
    # config.json holds the family's own fields: no LoRA, Hydra or Medusa knobs in an EAGLE-3 head
    assert set(spec.to_dict()) == set(family_fields("eagle3"))
    assert not set(spec.to_dict()) & {"lora_r", "hydra_teacher_loss", "medusa_decay", "heads_only_steps"}
    assert {f.name for f in fields(HeadConfig)} - set(spec.to_dict()) >= {"num_heads", "noise", "lm_loss"}
    # config.json's "head" dict as written before HeadSpec derived from HeadConfig (every family's
    # fields in every head) reads back as the medusa head it describes
    saved = {
        "family": "medusa",
        "layer_ids": [],
        "num_heads": 3,
        "num_layers": 1,
        "shared_lm_head": True,
        "medusa_decay": 0.8,
        "num_decoder_layers": 1,
        "intermediate_size": 256,
        "fc_bias": False,
        "feature_loss_weight": 1.0,
        "token_loss_weight": 0.1,
        "noise": "uniform",
        "noise_std": 0.2,
        "draft_vocab_size": 320,
        "ttt_steps": 7,
        "ttt_decay": 0.8,
        "eval_depth": 3,
    }
    own = {k: v for k, v in saved.items() if k in family_fields("medusa")}
    assert set(own) == set(family_fields("medusa"))
    assert HeadSpec.from_dict({**saved, "from_a_newer_version": 1}).to_dict() == own
    # a medusa2 head written with every field: its own ones read back, fields added since take defaults
    old_m2 = {**saved, "family": "medusa2", "lora_r": 8, "lm_loss_weight": 1.0}
    back = HeadSpec.from_dict(old_m2).to_dict()
    assert (back["lora_r"], back["lm_loss_weight"], back["lora_lr"]) == (8, 1.0, HeadConfig().lora_lr)
    assert "ttt_steps" not in back and set(back) == set(family_fields("medusa2"))
    partial = HeadSpec.from_dict({"family": "medusa", "num_heads": 2})  # an engine export's fields only
    assert (partial.layer_ids, partial.intermediate_size, partial.draft_vocab_size) == ([], 0, 0)


def test_registry_has_every_family():
    # hydra: tests/heads/test_hydra.py; medusa2 (which adapts its target): tests/heads/test_medusa2.py;
    # early_exit (which drafts with the target's own layers): tests/heads/test_early_exit.py;
    # dspark (DFlash's block with Markov and confidence heads): tests/heads/test_dspark.py;
    # dflash2 (DFlash's block with in-block convolutions and a candidate selector): tests/heads/test_dflash2.py
    assert sorted(HEADS) == sorted(FAMILIES + ["hydra", "medusa2", "early_exit", "dspark", "dflash2"])


def test_eagle3_default_layers_match_vllm_convention():
    assert default_layer_ids("eagle3", 32) == [2, 16, 29]
    assert default_layer_ids("eagle3", 80) == [2, 40, 77]
    # a shallow target still fuses exactly three layers (repeats), as vLLM builds them
    assert default_layer_ids("eagle3", 6) == [2, 3, 3]
    assert default_layer_ids("eagle3", 2) == [1, 1, 0]


def test_eagle3_default_head_on_a_shallow_target_fuses_three_layers_and_exports(tiny_target, tmp_path):
    from specheads.export import export_head

    vocab = tiny_target.info.vocab_size  # the full vocab: no training data needed to choose it
    head = build_head(HeadConfig(family="eagle3", draft_vocab_size=vocab), tiny_target)
    assert head.spec.layer_ids == [2, 3, 3] and head.fc.in_features == 3 * tiny_target.info.hidden_size
    assert head.training_states() == ([2, 3], True)  # each state captured once
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "eagle3", tmp_path / "engines")  # both engines' default layers
    assert out.engines == ["vllm", "sglang"]
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((out.path / "config.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes(family, tiny_target, toy_batch):
    head = make_head(family, tiny_target, toy_batch)
    states = head_states(tiny_target, head, toy_batch)
    b, t = toy_batch["input_ids"].shape
    info = tiny_target.info
    if family == "medusa":
        logits = head.medusa_logits(states["final"])
        assert logits.shape == (3, b, t, info.vocab_size)
    elif family == "dflash":  # a block of drafts after the fed rows, one forward
        feats = head.input_features(states)
        assert feats.shape == (b, t, info.hidden_size)
        logits = head.parallel_logits(toy_batch["input_ids"][:1], feats[:1], head.new_cache(), 7)
        assert logits.shape == (7, info.vocab_size)
    else:
        feats = head.input_features(states)
        assert feats.shape == (b, t, info.hidden_size)
        pos = torch.arange(t).expand(b, t)
        h, logits = head.draft_step(toy_batch["input_ids"], feats, pos, head.new_cache())
        assert h.shape == (b, t, info.hidden_size)
        assert logits.shape[-1] == head.spec.draft_vocab_size
    ev = head.evaluate(toy_batch, states)
    depth = head.spec.eval_depth
    assert ev["correct"].shape == (depth,) and ev["total"].shape == (depth,)
    assert int(ev["accept_lengths"].max()) <= depth


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_falls_over_20_fixed_seed_steps(family, tiny_target, toy_batch):
    head = make_head(family, tiny_target, toy_batch).train()
    states = head_states(tiny_target, head, toy_batch)
    torch.manual_seed(1)
    losses, _ = overfit(head, toy_batch, states, steps=20)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses


def test_frozen_target_parts_are_not_head_parameters(tiny_target, toy_batch):
    for family in FAMILIES:
        head = make_head(family, tiny_target, toy_batch)
        target_params = {id(p) for p in tiny_target.model.parameters()}
        assert not any(id(p) in target_params for p in head.parameters())
        assert all(p.requires_grad for p in head.parameters())


def test_medusa_blocks_are_distinct_modules(tiny_target, toy_batch):
    head = make_head("medusa", tiny_target, toy_batch, num_layers=2)
    blocks = [blk for seq in head.blocks for blk in seq]
    assert len({id(b) for b in blocks}) == len(blocks) == 6


def slow_unrolled_reference(head, input_ids, features, steps):
    """Recompute every (position, step) from scratch the way inference drafts a chain."""
    b, t = input_ids.shape
    out = [torch.zeros(b, t, head.info.hidden_size) for _ in range(steps)]
    for pos in range(t):
        cache = head.new_cache()
        ids0 = shifted(input_ids, 1)[:, : pos + 1]
        positions = torch.arange(pos + 1).expand(b, pos + 1)
        h, _ = head.draft_step(ids0, features[:, : pos + 1], positions, cache)
        out[0][:, pos] = h[:, pos]
        feat = h[:, pos : pos + 1]
        for j in range(1, steps):
            tok = shifted(input_ids, 1 + j)[:, pos : pos + 1]
            h, _ = head.draft_step(tok, feat, torch.full((b, 1), pos + j), cache)
            out[j][:, pos] = h[:, 0]
            feat = h
    return out


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_unrolled_attention_matches_slow_reference(family, tiny_target, toy_batch):
    head = make_head(family, tiny_target, toy_batch, num_decoder_layers=2).eval()
    # random non-identity norms and weights so that a wrong mask cannot hide
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    states = head_states(tiny_target, head, toy_batch)
    ids = toy_batch["input_ids"][:, :24]
    feats = head.input_features(states)[:, :24]
    with torch.no_grad():
        fast = head.unrolled(ids, feats, 4)
        slow = slow_unrolled_reference(head, ids, feats, 4)
    for j in range(4):
        assert_same_numbers(fast[j], slow[j])


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_gives_identical_logits(family, tiny_target, toy_batch, tmp_path):
    head = make_head(family, tiny_target, toy_batch)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    head.eval()
    save_head(head, tmp_path / "head", training={"steps": 0})
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["schema_version"] == 1 and config["family"] == family
    assert config["layer_convention"] == "residual_stream_entering_layer_k"
    loaded = load_head(tmp_path / "head", tiny_target)
    states = head_states(tiny_target, head, toy_batch)
    if family == "medusa":
        torch.testing.assert_close(
            head.medusa_logits(states["final"]), loaded.medusa_logits(states["final"]), rtol=0, atol=0
        )
    elif family == "dflash":
        ids = toy_batch["input_ids"][:1]
        with torch.no_grad():
            a = head.parallel_logits(ids, head.input_features(states)[:1], head.new_cache(), 7)
            c = loaded.parallel_logits(ids, loaded.input_features(states)[:1], loaded.new_cache(), 7)
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    else:
        b, t = toy_batch["input_ids"].shape
        pos = torch.arange(t).expand(b, t)
        with torch.no_grad():
            a = head.draft_step(toy_batch["input_ids"], head.input_features(states), pos, head.new_cache())[1]
            c = loaded.draft_step(toy_batch["input_ids"], loaded.input_features(states), pos, loaded.new_cache())[1]
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    if family == "eagle3":
        assert torch.equal(head.d2t, loaded.d2t) and torch.equal(head.t2d, loaded.t2d)


def test_mismatched_target_is_refused(tiny_target, toy_batch, tmp_path):
    head = make_head("eagle", tiny_target, toy_batch)
    save_head(head, tmp_path / "head")
    other = load_target(ModelConfig(name="wider", path="tiny:llama", tiny={"hidden_size": 96}))
    with pytest.raises(SpecHeadsError, match="hidden_size 64 != 96"):
        load_head(tmp_path / "head", other)


def test_corrupt_or_foreign_weights_are_refused(tiny_target, toy_batch, tmp_path):
    head = make_head("medusa", tiny_target, toy_batch)
    save_head(head, tmp_path / "head")
    (tmp_path / "head" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpecHeadsError, match="not a readable safetensors"):
        load_head(tmp_path / "head", tiny_target)
    save_file({"wrong": torch.zeros(2)}, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(SpecHeadsError, match="does not match a medusa head"):
        load_head(tmp_path / "head", tiny_target)
    (tmp_path / "head" / "config.json").write_text("{")
    with pytest.raises(SpecHeadsError, match="not valid JSON"):
        load_head(tmp_path / "head", tiny_target)


def test_save_is_atomic_on_failure(tiny_target, toy_batch, tmp_path, monkeypatch):
    head = make_head("eagle", tiny_target, toy_batch)
    save_head(head, tmp_path / "head")
    before = (tmp_path / "head" / "model.safetensors").read_bytes()
    import specheads.heads.io as io

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(io, "save_file", boom)
    with pytest.raises(OSError):
        save_head(head, tmp_path / "head")
    assert (tmp_path / "head" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_draft_vocab_maps():
    counts = torch.tensor([0, 5, 0, 9, 1, 9, 0, 2])
    d2t, t2d = vocab_from_counts(counts, 4)
    used = torch.arange(4) + d2t
    assert used.tolist() == [1, 3, 5, 7]
    assert t2d.tolist() == [False, True, False, True, False, True, False, True]
    # fewer seen tokens than slots: unseen ids fill deterministically instead of crashing
    d2t, t2d = vocab_from_counts(torch.tensor([0, 3, 0, 0]), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2]


def test_eagle3_vocab_covers_training_tokens(tiny_target, toy_batch):
    head = make_head("eagle3", tiny_target, toy_batch)
    assistant = toy_batch["input_ids"][toy_batch["loss_mask"].bool()].unique()
    assert head.t2d[assistant].float().mean() > 0.9 or head.t2d.sum() == head.spec.draft_vocab_size
    mapped = head.draft_to_target(torch.arange(head.spec.draft_vocab_size))
    assert head.t2d[mapped].all()


def test_unknown_family_is_refused(tiny_target):
    with pytest.raises(SpecHeadsError, match="unknown head family"):
        build_head(HeadConfig(family="hydra9"), tiny_target)


@pytest.mark.parametrize(
    "arch,finish",
    [
        ("llama", {}),
        ("granitemoehybrid", {"logits_scaling": 4.0}),
        ("falcon_h1", {"lm_head_multiplier": 0.5}),
        ("gemma3_text", {"final_logit_softcapping": 2.0}),
    ],
)
def test_a_heads_soft_labels_are_the_targets_own_logits(arch, finish):
    """What a head learns from is the distribution the target's forward gives, its family's output
    scaling or soft-capping included; the LM head's raw output differs where a family finishes it."""
    from specheads.target import FrozenTarget
    from specheads.tiny import tiny_target

    model, tokenizer = tiny_target(arch, num_hidden_layers=2, **finish)
    target = FrozenTarget(model, tokenizer, name=f"tiny-{arch}")
    head = build_head(HeadConfig(family="medusa", num_heads=1), target)
    ids = torch.tensor([list(range(40, 60))])
    states = target.states(ids, final=True, logits=True)
    assert_same_numbers(head.target_logits(states.final), states.logits.float())
    raw = target.lm_head(states.final).float()
    if finish:
        assert_other_numbers(raw, states.logits.float())
