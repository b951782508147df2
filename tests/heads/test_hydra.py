"""Hydra heads: head k reads cat(h_t, e(x_{t+1}), ..., e(x_{t+k+1})); the Hydra++ options; the loss."""

import pytest
import torch
from conftest import assert_other_numbers, assert_same_numbers, batch_rows, head_states, overfit

from specheads.config.train import HeadConfig
from specheads.heads import HydraHead, build_head, load_head, save_head

pytestmark = pytest.mark.usefixtures("one_thread")


def make_hydra(target, batch, seed=0, nudge=0.0, **overrides):
    torch.manual_seed(seed)
    head = build_head(HeadConfig(family="hydra", **{"num_heads": 3, **overrides}), target, train_rows=batch_rows(batch))
    if nudge:  # off the initialisation, whose path weights are zero
        with torch.no_grad():
            for p in head.parameters():
                p.add_(nudge * torch.randn_like(p))
    return head


def plain_logits(head, final, input_ids, b, t, k, offset=1):
    """Head k at (b, t), written out: its input is h_t then the embeddings of x_{t+offset}.. in order."""
    emb = head.frozen.embed_tokens.weight
    parts = [final[b, t]] + [emb[input_ids[b, t + offset + j]] for j in range(k + 1)]
    y = head.blocks[k](torch.cat(parts)[None])
    lm = head.lm_heads[k] if head.lm_heads is not None else head.frozen.lm_head
    return lm(y)[0].float()


def test_shapes_and_input_widths(tiny_target, toy_batch):
    head = make_hydra(tiny_target, toy_batch)
    assert isinstance(head, HydraHead) and head.draft_kind == "sequential"
    h, v = tiny_target.info.hidden_size, tiny_target.info.vocab_size
    assert [blocks[0].linear.in_features for blocks in head.blocks] == [2 * h, 3 * h, 4 * h]
    assert HydraHead.max_draft_depth(head.spec) == 3 and head.spec.eval_depth == 3
    states = head_states(tiny_target, head, toy_batch)
    b, t = toy_batch["input_ids"].shape
    logits = head.teacher_forced_logits(toy_batch["input_ids"], states, 5)
    assert [x.shape for x in logits] == [(b, t, v)] * 3  # never deeper than the heads
    assert len(head.teacher_forced_logits(toy_batch["input_ids"], states, 2)) == 2
    ev = head.evaluate(toy_batch, states)
    assert ev["correct"].shape == (3,) and ev["total"].shape == (3,)
    assert int(ev["accept_lengths"].max()) <= 3
    with pytest.raises(ValueError, match="reads 2 path tokens"):
        head.head_logits(1, states["final"][0, :1], toy_batch["input_ids"][0, :1, None])


def test_teacher_forced_logits_match_a_plain_loop(tiny_target, toy_batch):
    head = make_hydra(tiny_target, toy_batch, nudge=0.05, num_layers=2).eval()
    states = head_states(tiny_target, head, toy_batch)
    ids, final = toy_batch["input_ids"], states["final"]
    with torch.no_grad():
        fast = head.teacher_forced_logits(ids, states, 3)
        for b, t in [(0, 0), (0, 17), (1, 25), (1, 33)]:
            for k in range(3):
                assert_same_numbers(fast[k][b, t], plain_logits(head, final, ids, b, t, k))
        # the comparison can fail: a path shifted by one token gives other logits
        assert_other_numbers(fast[1][0, 5], plain_logits(head, final, ids, 0, 5, 1, offset=2))


def test_fresh_head_starts_as_medusa_would(tiny_target, toy_batch):
    """Zero path weights at first: a fresh head k reads only h_t (and per-head LM heads are the target's)."""
    head = make_hydra(tiny_target, toy_batch).eval()
    states = head_states(tiny_target, head, toy_batch)
    ids = toy_batch["input_ids"]
    with torch.no_grad():
        a = head.teacher_forced_logits(ids, states, 3)
        b = head.teacher_forced_logits(torch.roll(ids, 3, dims=1), states, 3)
    for x, y in zip(a, b):
        assert_same_numbers(x, y)
    for lm in head.lm_heads:
        assert torch.equal(lm.weight, tiny_target.lm_head.weight)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"shared_lm_head": True}, {"hydra_teacher_loss": True}, {"hydra_prefix_layer": True}],
    ids=["default", "shared-lm-head", "teacher-loss", "prefix-layer"],
)
def test_loss_falls_when_overfitting(overrides, tiny_target, toy_batch):
    head = make_hydra(tiny_target, toy_batch, **overrides).train()
    states = head_states(tiny_target, head, toy_batch)
    losses, metrics = overfit(head, toy_batch, states, steps=30)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert set(metrics) == {f"{m}_{k}" for m in ("loss", "acc") for k in range(3)}
    # the teacher's soft CE cannot go below the target's own entropy: a smaller fall there
    assert losses[-1] < (0.8 if overrides.get("hydra_teacher_loss") else 0.5) * losses[0], losses


def test_flags_change_the_parameter_set(tiny_target, toy_batch):
    names = {
        key: {n.split(".")[0] for n, _ in make_hydra(tiny_target, toy_batch, **flags).named_parameters()}
        for key, flags in {
            "default": {},
            "shared": {"shared_lm_head": True},
            "prefix": {"hydra_prefix_layer": True},
            "teacher": {"hydra_teacher_loss": True},
        }.items()
    }
    assert names["default"] == {"blocks", "lm_heads"} == names["teacher"]
    assert names["shared"] == {"blocks"}  # the target's frozen LM head, not a parameter
    assert names["prefix"] == {"blocks", "lm_heads", "prefix"}
    head = make_hydra(tiny_target, toy_batch, shared_lm_head=True)
    target_params = {id(p) for p in tiny_target.model.parameters()}
    assert not any(id(p) in target_params for p in head.parameters())


def test_loss_is_hard_or_soft_cross_entropy_as_asked(tiny_target, toy_batch):
    """Both losses against a plain computation; they differ from each other."""
    hard = make_hydra(tiny_target, toy_batch, nudge=0.05)
    soft = make_hydra(tiny_target, toy_batch, nudge=0.05, hydra_teacher_loss=True)
    soft.load_state_dict(hard.state_dict())
    states = head_states(tiny_target, hard, toy_batch)
    ids = toy_batch["input_ids"]
    valid = toy_batch["attention_mask"].bool()
    mask = toy_batch["loss_mask"].bool() & valid
    b, t = ids.shape
    with torch.no_grad():
        _, hard_metrics = hard.loss(toy_batch, states)
        _, soft_metrics = soft.loss(toy_batch, states)
        logits = hard.teacher_forced_logits(ids, states, 3)
        target = hard.target_logits(states["final"])
    for k in range(3):
        ce, ref_soft, n = 0.0, 0.0, 0
        for bi in range(b):
            for ti in range(t - k - 2):
                if not (valid[bi, ti] and mask[bi, ti + k + 2]):
                    continue
                logq = torch.log_softmax(logits[k][bi, ti], -1)
                ce -= float(logq[ids[bi, ti + k + 2]])
                ref_soft -= float((torch.softmax(target[bi, ti + k + 1], -1) * logq).sum())
                n += 1
        assert hard_metrics[f"loss_{k}"] == pytest.approx(ce / n, rel=1e-4)
        assert soft_metrics[f"loss_{k}"] == pytest.approx(ref_soft / n, rel=1e-4)
        assert abs(hard_metrics[f"loss_{k}"] - soft_metrics[f"loss_{k}"]) > 1e-2


def test_prefix_layer_is_causal_and_incremental(tiny_target, toy_batch):
    head = make_hydra(tiny_target, toy_batch, hydra_prefix_layer=True).eval()
    states = head_states(tiny_target, head, toy_batch)
    final = states["final"][:1, :30]
    with torch.no_grad():
        assert_same_numbers(head.base_states(final), final)  # a fresh layer is the identity
        for p in head.prefix.parameters():
            p.add_(0.05 * torch.randn_like(p))
        full = head.base_states(final)
        assert_other_numbers(full, final)
        # fed in pieces through the KV cache, as the drafter does, the states are the same
        cache = head.new_prefix_cache()
        pieces = [head.base_states(final[:, a:z], cache) for a, z in [(0, 11), (11, 12), (12, 19), (19, 30)]]
        assert_same_numbers(torch.cat(pieces, dim=1), full)
        # causal: a change at position 20 leaves the states before it alone
        changed = final.clone()
        changed[:, 20] += 1.0
        other = head.base_states(changed)
        assert_same_numbers(other[:, :20], full[:, :20])
        assert_other_numbers(other[:, 20:], full[:, 20:])


@pytest.mark.parametrize(
    "flags", [{}, {"hydra_prefix_layer": True, "shared_lm_head": True}], ids=["default", "hydra++"]
)
def test_save_load_gives_identical_logits(flags, tiny_target, toy_batch, tmp_path):
    head = make_hydra(tiny_target, toy_batch, nudge=0.01, **flags).eval()
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", tiny_target)
    assert loaded.spec.hydra_prefix_layer == bool(flags)
    states = head_states(tiny_target, head, toy_batch)
    with torch.no_grad():
        a = head.teacher_forced_logits(toy_batch["input_ids"], states, 3)
        c = loaded.teacher_forced_logits(toy_batch["input_ids"], states, 3)
    for x, y in zip(a, c):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_describe_names_the_family(tiny_target):
    spec = build_head(HeadConfig(family="hydra", num_heads=2), tiny_target).spec
    assert "2 Hydra heads" in HydraHead.describe(spec, tiny_target.info, [])
