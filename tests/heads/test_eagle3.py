"""EAGLE-3's training loss against the plain every-position loss it replaces."""

import pytest
import torch
from conftest import assert_same_numbers, batch_rows, head_states, loss_and_lm_head_rows

from specheads.config.train import HeadConfig
from specheads.heads import build_head
from specheads.heads.base import shifted


def every_position_loss(head, batch, states, offset=1):
    """The loss written plainly: the target's logits and the draft's at every position, masked.
    offset: where step j's target distribution sits, from t + j (1 is right)."""
    target_logits = head.target_logits(states["final"])
    in_vocab_logits = target_logits[..., head.t2d]
    in_vocab_top = head.t2d[target_logits.argmax(-1)]
    total = target_logits.new_zeros(())
    for j, h in enumerate(head.unrolled_batch(batch, head.input_features(states), head.spec.ttt_steps)):
        p = torch.softmax(shifted(in_vocab_logits, offset + j), dim=-1)
        mask = head._counted(batch, j) & shifted(in_vocab_top, offset + j, False)
        logq = torch.log_softmax(head.draft_logits(h), dim=-1)
        total = total + head.spec.ttt_decay**j * -((p * logq).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
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
