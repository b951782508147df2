"""DFlash: the block attention mask against a plain per-element rule, the packed training forward
against drafting each block alone, the loss against a plain weighted sum, the anchors, the layer ids."""

import random

import pytest
import torch
from conftest import assert_other_numbers, assert_same_numbers, batch_rows, fails_for_some_seed, head_states

import specheads.heads.dflash as dflash
from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.heads import build_head
from specheads.heads.base import shifted
from specheads.heads.spec import HeadSpec, default_layer_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def dflash_head(target, batch, **overrides):
    torch.manual_seed(0)
    cfg = HeadConfig(family="dflash", block_size=5, **overrides)
    head = build_head(cfg, target, train_rows=batch_rows(batch)).eval()
    with torch.no_grad():  # non-identity norms and weights, so that a wrong mask cannot hide
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


# -- the mask ------------------------------------------------------------------------------------


def visible_plain(ctx_doc, doc, anchor, block, i, key):
    """Whether block element i may attend to key `key` (context positions first, then the elements),
    element by element: what slot i of its block sees at inference (its document's verified
    positions, up to its anchor, and its own block)."""
    t = len(ctx_doc)
    if key >= t:
        j = key - t
        return i == j or (doc[i] >= 0 and block[j] == block[i])
    return doc[i] >= 0 and ctx_doc[key] == doc[i] and key <= anchor[i]


def random_layout(seed):
    """A row of two documents and padding, anchors in both documents, and a padding block."""
    rng = random.Random(seed)
    t = rng.randint(8, 16)
    split = rng.randint(3, t - 4)
    ctx_doc = torch.tensor([0] * split + [1] * (t - split - 2) + [-1, -1])
    size = rng.randint(2, 4)
    anchors = sorted(rng.sample(range(t - 2), rng.randint(1, 4)))
    anchor = torch.tensor(anchors + [0]).repeat_interleave(size)
    doc = torch.cat([ctx_doc[torch.tensor(anchors)], torch.tensor([-1])]).repeat_interleave(size)
    block = torch.arange(len(anchors) + 1).repeat_interleave(size)
    return ctx_doc, doc, anchor, block


def check_mask(mask_fn, seed):
    ctx_doc, doc, anchor, block = random_layout(seed)
    mask = mask_fn(ctx_doc, doc, anchor, block)
    keys = len(ctx_doc) + len(doc)
    plain = [[visible_plain(ctx_doc, doc, anchor, block, i, k) for k in range(keys)] for i in range(len(doc))]
    assert torch.equal(mask, torch.tensor(plain))


RIGHT_MASK = dflash.block_attention_mask


def sees_other_documents(ctx_doc, doc, anchor, block):
    return RIGHT_MASK(ctx_doc.clamp(max=0), doc.clamp(max=0), anchor, block)


def sees_past_its_anchor(ctx_doc, doc, anchor, block):
    return RIGHT_MASK(ctx_doc, doc, anchor + 1, block)


def sees_other_blocks(ctx_doc, doc, anchor, block):
    return RIGHT_MASK(ctx_doc, doc, anchor, torch.where(doc >= 0, 0, block))


WRONG_MASKS = (sees_other_documents, sees_past_its_anchor, sees_other_blocks)


def test_block_mask_matches_the_per_element_rule():
    for seed in range(30):
        check_mask(dflash.block_attention_mask, seed)
    # the check has power: each wrong mask (another document, a position after the anchor, another
    # block) fails it
    for wrong in WRONG_MASKS:
        assert fails_for_some_seed(check_mask, wrong, range(30)), wrong.__name__


# -- the packed forward --------------------------------------------------------------------------

ANCHORS = [torch.tensor([0, 3, 7, 10, 15, 21]), torch.tensor([2, 7, 18])]
DOC0 = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])  # row 0: two documents; row 1: padding


def drafted_alone(head, input_ids, features, start, anchor):
    """The block anchored at `anchor` drafted as inference drafts it: a fresh context cache fed the
    document's rows start..anchor, then one block. Positions count from 0 here and from the row's
    start in the packed forward: RoPE is relative, so the two must agree."""
    ids = shifted(input_ids, 1)[:, start : anchor + 1]
    return head.parallel_logits(ids, features[:, start : anchor + 1], head.new_cache(), head.spec.block_size - 1)


def check_packed_forward(head, batch, states):
    feats = head.input_features(states)
    with torch.no_grad():
        h, anchor, slot, doc = head.packed_hidden(batch["input_ids"], feats, ANCHORS, DOC0)
        logits = head.draft_logits(h)
        checked = 0
        for r in range(anchor.shape[0]):
            for n in range(anchor.shape[1]):
                if doc[r, n] < 0 or slot[r, n] == 0:
                    continue
                t = int(anchor[r, n])
                start = int((DOC0[r] == doc[r, n]).nonzero()[0])
                alone = drafted_alone(head, batch["input_ids"][r : r + 1], feats[r : r + 1], start, t)
                assert_same_numbers(logits[r, n], alone[int(slot[r, n]) - 1])
                checked += 1
    assert checked == sum(len(a) for a in ANCHORS) * (head.spec.block_size - 1)


def test_packed_forward_equals_drafting_each_block_alone(tiny_target, toy_batch, monkeypatch):
    head = dflash_head(tiny_target, toy_batch)
    states = head_states(tiny_target, head, toy_batch)
    batch = {k: v[:, :24] for k, v in toy_batch.items()}
    states = {k: v[:, :24] for k, v in states.items()}
    check_packed_forward(head, batch, states)
    for wrong in WRONG_MASKS:
        monkeypatch.setattr(dflash, "block_attention_mask", wrong)
        with pytest.raises(AssertionError):
            check_packed_forward(head, batch, states)


def test_k_norm_is_one_parameter_shared_by_every_layer(tiny_target, toy_batch):
    """vLLM's CPU build normalises every layer's context keys with layer 0's k_norm: the head has one."""
    head = dflash_head(tiny_target, toy_batch, dflash_layers=3)
    names = [n for n, _ in head.named_parameters() if "k_norm" in n]
    assert names == ["k_norm.weight"]
    assert all("k_norm" not in n for n in head.layers.state_dict())


# -- the loss ------------------------------------------------------------------------------------


def plain_loss(head, batch, states, anchors):
    """The weighted cross-entropy, block by block through the inference path."""
    feats = head.input_features(states)
    ids, mask = batch["input_ids"], batch["loss_mask"].bool() & batch["attention_mask"].bool()
    total = weights = 0.0
    for r, row in enumerate(anchors):
        for t in row.tolist():
            logits = drafted_alone(head, ids[r : r + 1], feats[r : r + 1], 0, t)
            for k in range(1, head.spec.block_size):
                if t + 1 + k < ids.shape[1] and mask[r, t + 1 + k]:
                    w = torch.exp(torch.tensor(-(k - 1) / head.spec.dflash_gamma))
                    ce = torch.nn.functional.cross_entropy(logits[k - 1], ids[r, t + 1 + k])
                    total, weights = total + w * ce, weights + w
    return total / weights


@pytest.fixture
def drawn(monkeypatch) -> list:
    """Every anchor tensor the head draws, in order (the real sampler, recorded)."""
    record, sample = [], dflash.sample_block_anchors
    monkeypatch.setattr(dflash, "sample_block_anchors", lambda *a: record.append(sample(*a)) or record[-1])
    return record


def test_loss_is_the_decayed_cross_entropy_of_the_drawn_blocks(tiny_target, toy_batch, drawn):
    head = dflash_head(tiny_target, toy_batch, anchors_per_sequence=4)
    states = head_states(tiny_target, head, toy_batch)
    torch.manual_seed(3)
    with torch.no_grad():
        loss, metrics = head.loss(toy_batch, states)
        expected = plain_loss(head, toy_batch, states, drawn)
    assert_same_numbers(loss, expected)
    assert set(metrics) == {f"{m}_{d}" for m in ("loss", "acc") for d in range(4)}
    # the weights matter: with gamma changed, the plain sum no longer matches
    head.spec.dflash_gamma = 1.0
    with torch.no_grad():
        assert_other_numbers(plain_loss(head, toy_batch, states, drawn), loss)


def test_anchors_are_redrawn_each_step_from_the_seeded_rng(tiny_target, toy_batch, drawn):
    head = dflash_head(tiny_target, toy_batch, anchors_per_sequence=5)
    states = head_states(tiny_target, head, toy_batch)

    def draws(seed, calls):
        drawn.clear()
        torch.manual_seed(seed)
        with torch.no_grad():
            for _ in range(calls):
                head.loss(toy_batch, states)
        return [a.tolist() for a in drawn]

    first = draws(0, 2)
    assert first == draws(0, 2)  # the trainer's seed fixes them
    assert first[:2] != first[2:]  # a new draw every step
    valid, counted = toy_batch["attention_mask"].bool(), toy_batch["loss_mask"].bool()
    for r, row in enumerate(first[:2]):
        assert len(row) == 5 and row == sorted(set(row))
        # token t+1 exists and the first draft's token t+2 is a counted assistant token
        assert all(valid[r, t + 1] and counted[r, t + 2] and valid[r, t + 2] for t in row)
    few = torch.zeros(40, dtype=torch.bool)
    few[[4, 9]] = True
    assert dflash.sample_block_anchors(few, 5, None).tolist() == [4, 9]  # fewer fit: all of them


# -- spec ----------------------------------------------------------------------------------------


def test_default_layers_spread_over_the_target_and_bad_fields_are_refused(tiny_target):
    # z-lab's rule (outputs of layers 1..L-3, or the middle one), in our numbering (+1)
    assert default_layer_ids("dflash", 30, 5) == [2, 9, 15, 21, 28]
    assert default_layer_ids("dflash", 30, 3) == [2, 15, 28]
    assert default_layer_ids("dflash", 30, 1) == [16]
    assert default_layer_ids("dflash", 36, 5) == [2, 10, 18, 26, 34]  # Qwen3-8B's [1, 9, 17, 25, 33]
    spec = HeadSpec.from_config(HeadConfig(family="dflash"), tiny_target.info)
    assert (spec.layer_ids, spec.eval_depth, spec.draft_vocab_size) == ([2, 4], 7, 320)
    for field, value, line in [
        ("block_size", 1, "head.block_size must be >= 2"),
        ("dflash_layers", 0, "head.dflash_layers must be >= 1"),
        ("anchors_per_sequence", 0, "head.anchors_per_sequence must be >= 1"),
        ("dflash_gamma", 0.0, "head.dflash_gamma must be > 0"),
    ]:
        with pytest.raises(SpecHeadsError, match=line):
            HeadSpec.from_config(HeadConfig(family="dflash", **{field: value}), tiny_target.info)
