"""EAGLE-3's training loss against the plain every-position loss it replaces."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_other_numbers, assert_same_numbers, batch_rows, head_states, loss_and_lm_head_rows

from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.heads import build_head
from specheads.heads.base import shifted


def soft_cross_entropy(p, logits):
    return -(p * torch.log_softmax(logits, dim=-1)).sum(-1)


def every_position_loss(head, batch, states, offset=1, out_of_vocab=False, objective=soft_cross_entropy):
    """The loss written plainly: the target's logits and the draft's at every position, masked.
    offset: where step j's target distribution sits, from t + j (1 is right); out_of_vocab: also
    count positions whose target top token is outside the draft vocabulary; objective(p, draft
    logits): the per-position loss."""
    target_logits = head.target_logits(states["final"])
    in_vocab_logits = target_logits[..., head.t2d]
    in_vocab_top = head.t2d[target_logits.argmax(-1)]
    total = target_logits.new_zeros(())
    for j, h in enumerate(head.unrolled_batch(batch, head.input_features(states), head.spec.ttt_steps)):
        p = torch.softmax(shifted(in_vocab_logits, offset + j), dim=-1)
        mask = head._counted(batch, j) & (shifted(in_vocab_top, offset + j, False) | out_of_vocab)
        per_position = objective(p, head.draft_logits(h))
        total = total + head.spec.ttt_decay**j * (per_position * mask).sum() / mask.sum().clamp(min=1)
    return total


def packed(batch):
    """The toy batch as packed rows: row 0 holds two conversations, row 1 one and padding."""
    document = torch.tensor([[0] * 20 + [1] * 20, [0] * 30 + [-1] * 10])
    starts = torch.tensor([[0] * 20 + [20] * 20, [0] * 40])
    return {**batch, "document": document, "position_ids": torch.arange(40) - starts}


@pytest.mark.parametrize("pack", [False, True])
def test_the_loss_reads_the_target_lm_head_at_needed_positions_only(tiny_target, toy_batch, pack):
    """The loss and its gradients equal the every-position loss, while the target's LM head sees
    only the positions some step reads, each once; the target's distribution read one position
    late (a wrong variant) gives another loss."""
    torch.manual_seed(0)
    cfg = HeadConfig(family="eagle3", draft_vocab_size=96, ttt_steps=3)
    head = build_head(cfg, tiny_target, train_rows=batch_rows(toy_batch)).train()
    with torch.no_grad():  # a trained-looking draft: a fresh one predicts every position alike
        head.lm_head.weight.normal_(0, 1.0)
    states = head_states(tiny_target, head, toy_batch)  # the same states for both losses: packed or not
    if pack:
        toy_batch = packed(toy_batch)
    loss, metrics, rows = loss_and_lm_head_rows(head, toy_batch, states)
    positions = toy_batch["input_ids"].numel()
    needed = torch.zeros_like(head._counted(toy_batch, 0))
    for j in range(cfg.ttt_steps):
        b, t = head._counted(toy_batch, j).nonzero(as_tuple=True)
        needed[b, t + 1 + j] = True
    assert rows == [int(needed.sum())] and rows[0] < positions
    assert set(metrics) == {f"{k}_{j}" for k in ("loss", "acc") for j in range(cfg.ttt_steps)}
    params = [head.fc.weight, head.lm_head.weight]
    plain = every_position_loss(head, toy_batch, states)
    assert_same_numbers(loss, plain)
    for ours, theirs in zip(torch.autograd.grad(loss, params), torch.autograd.grad(plain, params)):
        assert_same_numbers(ours, theirs)
    with pytest.raises(AssertionError):  # the check above tells the wrong variant apart
        assert_same_numbers(every_position_loss(head, toy_batch, states, offset=2), loss)


def test_the_loss_counts_positions_outside_the_draft_vocabulary_only_when_asked(tiny_target, toy_batch):
    """loss_positions=all (speculators' choice) equals the plain loss over every counted position,
    in_vocab the plain loss without those whose target top token the draft cannot propose; on a
    draft vocabulary too small to hold every top token, the two differ."""
    rows = batch_rows(toy_batch)
    losses = {}
    for positions in ("in_vocab", "all"):
        torch.manual_seed(0)
        cfg = HeadConfig(family="eagle3", draft_vocab_size=16, ttt_steps=2, loss_positions=positions)
        head = build_head(cfg, tiny_target, train_rows=rows).train()
        states = head_states(tiny_target, head, toy_batch)
        top = head.t2d[head.target_logits(states["final"]).argmax(-1)]
        assert not top[toy_batch["loss_mask"].bool()].all(), "every top token in the vocabulary: nothing to tell apart"
        losses[positions], _ = head.loss(toy_batch, states)
        assert_same_numbers(
            losses[positions], every_position_loss(head, toy_batch, states, out_of_vocab=positions == "all")
        )
    with pytest.raises(AssertionError):
        assert_same_numbers(losses["in_vocab"], losses["all"])


def plain_lk_hybrid(p, logits, eta=3.0):
    """speculators' lk_hybrid from its definition: exp(-eta alpha) KL + (1 - exp(-eta alpha)) TV."""
    tv = 0.5 * (p - torch.softmax(logits, dim=-1)).abs().sum(-1)
    kl = F.kl_div(torch.log_softmax(logits, dim=-1), p, reduction="none").sum(-1)
    lam = torch.exp(-eta * (1 - tv)).detach()
    return lam * kl + (1 - lam) * tv


def test_the_loss_fn_trains_each_step_on_the_acceptance_objective(tiny_target, toy_batch):
    """loss_fn=lk_hybrid: the loss and its gradients equal the plain every-position loss with the
    objective written from its definition; the default (kl) is another loss."""
    torch.manual_seed(0)
    cfg = HeadConfig(family="eagle3", draft_vocab_size=96, ttt_steps=3, loss_fn="lk_hybrid")
    head = build_head(cfg, tiny_target, train_rows=batch_rows(toy_batch)).train()
    with torch.no_grad():  # a draft that overlaps the target in part: both of lk_hybrid's terms weigh
        head.lm_head.weight.normal_(0, 1.0)
    states = head_states(tiny_target, head, toy_batch)
    loss, _ = head.loss(toy_batch, states)
    plain = every_position_loss(head, toy_batch, states, objective=plain_lk_hybrid)
    params = [head.fc.weight, head.lm_head.weight]
    assert_same_numbers(loss, plain)
    for ours, theirs in zip(torch.autograd.grad(loss, params), torch.autograd.grad(plain, params)):
        assert_same_numbers(ours, theirs)
    assert_other_numbers(loss, every_position_loss(head, toy_batch, states))
    with pytest.raises(SpecHeadsError, match="head.loss_fn must be one of"):
        build_head(HeadConfig(family="eagle3", loss_fn="jsd"), tiny_target, train_rows=batch_rows(toy_batch))


def test_a_frozen_draft_lm_head_stays_at_the_targets_rows(tiny_target, toy_batch):
    """freeze_lm_head: the LM head starts at the target's rows for the draft vocabulary, gets no
    gradient and is left out of the trainable parameters; the rest of the head trains."""
    cfg = HeadConfig(family="eagle3", draft_vocab_size=96, ttt_steps=2, freeze_lm_head=True)
    head = build_head(cfg, tiny_target, train_rows=batch_rows(toy_batch)).train()
    ids = head.draft_to_target(torch.arange(96))
    assert torch.equal(head.lm_head.weight, tiny_target.lm_head.weight[ids].to(head.lm_head.weight.dtype))
    loss, _ = head.loss(toy_batch, head_states(tiny_target, head, toy_batch))
    loss.backward()
    assert head.lm_head.weight.grad is None and head.fc.weight.grad is not None
    assert all(p is not head.lm_head.weight for p in head.parameters() if p.requires_grad)
    for bad in ({"loss_positions": "every"},):
        with pytest.raises(SpecHeadsError, match="loss_positions"):
            build_head(
                HeadConfig(family="eagle3", draft_vocab_size=96, **bad), tiny_target, train_rows=batch_rows(toy_batch)
            )
