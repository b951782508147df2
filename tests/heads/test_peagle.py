"""P-EAGLE: the packed training forward against drafting each element on its own, the packed
mask against a plain per-element rule, COD sampling, and the mask token rule."""

import random

import pytest
import torch
from conftest import assert_same_numbers, batch_rows, fails_for_some_seed, head_states

import specheads.heads.peagle as peagle
from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.heads import build_head
from specheads.heads.base import shifted
from specheads.heads.mask_token import resolve_mask_token_id
from specheads.tiny import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def peagle_head(target, batch, **overrides):
    torch.manual_seed(0)
    cfg = HeadConfig(family="peagle", draft_vocab_size=96, num_decoder_layers=2, **overrides)
    head = build_head(cfg, target, train_rows=batch_rows(batch)).eval()
    with torch.no_grad():  # non-identity norms and weights, so that a wrong mask cannot hide
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def visible_plain(doc, anchor, depth, i, j):
    """Whether element i may attend to element j, element by element: what draft position
    depth[i] + 1 after anchor[i] sees at inference (the real context of its own document up to
    its anchor, and its own chain's earlier positions)."""
    if i == j:
        return True
    if doc[i] < 0 or doc[i] != doc[j]:
        return False
    if depth[j] == 0:
        return anchor[j] <= anchor[i]
    return anchor[j] == anchor[i] and depth[j] <= depth[i]


def random_layout(seed):
    """A packed row of two documents and padding: depth 0 everywhere, deeper depths nested."""
    rng = random.Random(seed)
    t = rng.randint(6, 14)
    split = rng.randint(2, t - 2)
    doc0 = torch.tensor([0] * split + [1] * (t - split - 1) + [-1])
    counted = torch.rand(4, t, generator=torch.Generator().manual_seed(seed)) < 0.9
    counted[:, -1] = False
    deeper = peagle.sample_anchors(counted, 0.7, 0.3, torch.Generator().manual_seed(seed))
    anchor = torch.cat([torch.arange(t), *deeper])
    depth = torch.cat([torch.zeros(t, dtype=torch.long)] + [torch.full_like(a, d + 1) for d, a in enumerate(deeper)])
    return doc0[anchor], anchor, depth


def check_mask(mask_fn, seed):
    doc, anchor, depth = random_layout(seed)
    mask = mask_fn(doc, anchor, depth)
    n = len(anchor)
    plain = torch.tensor([[visible_plain(doc, anchor, depth, i, j) for j in range(n)] for i in range(n)])
    assert torch.equal(mask, plain)


RIGHT_MASK = peagle.packed_depth_mask


def sees_other_documents(doc, anchor, depth):
    return RIGHT_MASK(torch.zeros_like(doc), anchor, depth)


def sees_deeper_in_its_chain(doc, anchor, depth):
    return RIGHT_MASK(doc, anchor, torch.where(depth > 0, 1, 0))


def test_packed_mask_matches_the_per_element_rule():
    for seed in range(20):
        check_mask(peagle.packed_depth_mask, seed)
    # the check has power: a mask letting an element see another document, or a deeper position of
    # its own chain, fails it
    assert fails_for_some_seed(check_mask, sees_other_documents, range(20))
    assert fails_for_some_seed(check_mask, sees_deeper_in_its_chain, range(20))


def drafted_alone(head, input_ids, features, start, anchor, depth):
    """Draft position depth + 1 after `anchor` the way inference does: a fresh draft cache fed the
    document's accepted rows start..anchor, then one parallel forward. Its positions count from
    0, the packed forward's from the row's start: RoPE is relative, so the two must agree."""
    ids = shifted(input_ids, 1)[:, start : anchor + 1]
    logits = head.parallel_logits(ids, features[:, start : anchor + 1], head.new_cache(), depth + 1)
    return logits[depth]


def check_packed_forward(head, batch, states, doc0):
    """Every packed element's logits equal drafting it alone (document by document)."""
    feats = head.input_features(states)
    counted = torch.ones(4, *batch["input_ids"].shape, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    anchors = [peagle.sample_anchors(counted[:, r], 0.7, 0.3, gen) for r in range(counted.shape[1])]
    with torch.no_grad():
        logits, anchor, depth, doc = head.packed_forward(batch["input_ids"], feats, anchors, doc0)
        checked = {0: 0, 1: 0, 2: 0, 3: 0}
        for r in range(anchor.shape[0]):
            for n in range(anchor.shape[1]):
                if doc[r, n] < 0:
                    continue
                t, d = int(anchor[r, n]), int(depth[r, n])
                start = int((doc0[r] == doc[r, n]).nonzero()[0])
                row = drafted_alone(head, batch["input_ids"][r : r + 1], feats[r : r + 1], start, t, d)
                assert_same_numbers(logits[r, n], row)
                checked[d] += 1
    assert all(checked.values()), checked  # every depth was compared


def test_packed_forward_equals_drafting_each_element_alone(tiny_target, toy_batch, monkeypatch):
    head = peagle_head(tiny_target, toy_batch)
    states = head_states(tiny_target, head, toy_batch)
    batch = {k: v[:, :24] for k, v in toy_batch.items()}
    states = {k: v[:, :24] for k, v in states.items()}
    # row 0 holds two documents, row 1 ends in padding
    doc0 = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    check_packed_forward(head, batch, states, doc0)
    for wrong in (sees_other_documents, sees_deeper_in_its_chain):
        monkeypatch.setattr(peagle, "packed_depth_mask", wrong)
        with pytest.raises(AssertionError):
            check_packed_forward(head, batch, states, doc0)


def test_cod_sampling_is_nested_and_keeps_the_set_rates():
    t = 40_000
    counted = torch.ones(5, t, dtype=torch.bool)
    counted[3, :100] = False  # a position that cannot count at depth 3 is never drafted there or deeper
    deeper = peagle.sample_anchors(counted, 0.7, 0.2, torch.Generator().manual_seed(0))
    for d, anchors in enumerate(deeper, start=1):
        assert abs(len(anchors) / t - max(0.7**d, 0.2)) < 0.01, d
        if d > 1:
            assert set(anchors.tolist()) <= set(deeper[d - 2].tolist())
        if d >= 3:
            assert int(anchors.min()) >= 100


def test_mask_token_rule():
    tok = byte_tokenizer()  # 259 tokens, no mask token
    assert resolve_mask_token_id(tok, 320) == 259  # a padded vocabulary's first spare row
    assert resolve_mask_token_id(tok, 320, requested=7) == 7
    with pytest.raises(SpecHeadsError, match="outside the target's vocabulary"):
        resolve_mask_token_id(tok, 320, requested=320)
    # no spare row: the special tokens are pad, the template's <|im_start|> and eos: none is free
    with pytest.raises(SpecHeadsError, match="set head.mask_token_id"):
        resolve_mask_token_id(tok, len(tok))
    tok.add_special_tokens({"additional_special_tokens": ["<unused_a>", "<unused_b>"]})
    assert resolve_mask_token_id(tok, len(tok)) == tok.convert_tokens_to_ids("<unused_b>")


def test_a_fresh_head_records_its_mask_token_and_trains_embeddings_on_request(tiny_target, toy_batch):
    head = peagle_head(tiny_target, toy_batch)
    assert head.spec.mask_token_id == 259 and head.embed_tokens is None
    assert head.spec.to_dict()["mask_token_id"] == 259
    cfg = HeadConfig(family="peagle", draft_vocab_size=96, train_embeddings=True, mask_token_id=5)
    own = build_head(cfg, tiny_target, train_rows=batch_rows(toy_batch))
    assert own.spec.mask_token_id == 5
    assert torch.equal(own.embed_tokens.weight, tiny_target.embed_tokens.weight)
    assert any(p is own.embed_tokens.weight for p in own.parameters())


def test_the_loss_fn_sets_the_objective_on_the_same_drafts(tiny_target, toy_batch):
    """loss_fn=tv scores the same drafted elements (the same anchors, the same accuracies) by the
    acceptance objective: each depth's loss is a mean of TV distances, in [0, 1], and not kl's."""
    states = head_states(tiny_target, peagle_head(tiny_target, toy_batch), toy_batch)
    metrics = {}
    for name in ("kl", "tv"):
        head = peagle_head(tiny_target, toy_batch, loss_fn=name).train()
        torch.manual_seed(1)  # the anchors come from the global RNG
        _, metrics[name] = head.loss(toy_batch, states)
    depths = range(head.spec.parallel_depths)
    assert [metrics["tv"][f"acc_{d}"] for d in depths] == [metrics["kl"][f"acc_{d}"] for d in depths]
    assert all(0 < metrics["tv"][f"loss_{d}"] <= 1 < metrics["kl"][f"loss_{d}"] for d in depths)


def test_a_frozen_lm_head_is_recorded_and_every_position_refused(tiny_target, toy_batch):
    """head.freeze_lm_head freezes P-EAGLE's LM head as EAGLE-3's and its config says so (it did not:
    the record lacked the field); head.loss_positions=all, which its loss would ignore, is refused."""
    cfg = HeadConfig(family="peagle", draft_vocab_size=96, freeze_lm_head=True)
    head = build_head(cfg, tiny_target, train_rows=batch_rows(toy_batch))
    assert not head.lm_head.weight.requires_grad and head.spec.to_dict()["freeze_lm_head"] is True
    with pytest.raises(SpecHeadsError, match="head.loss_positions=all is EAGLE-3's"):
        build_head(HeadConfig(family="peagle", loss_positions="all"), tiny_target, train_rows=batch_rows(toy_batch))
