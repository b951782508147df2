"""The per-position objectives (head.loss_fn) against their plain definitions."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_other_numbers, assert_same_numbers

from specheads.errors import SpecHeadsError
from specheads.heads.objectives import LOSS_FNS, overlap, position_loss


def distributions(seed=0, n=64, v=50, sharp=3.0):
    """n target distributions p and draft logits over v tokens, far from each other and not flat."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(sharp * torch.randn(n, v, generator=g, dtype=torch.float64), -1)
    logits = (sharp * torch.randn(n, v, generator=g, dtype=torch.float64)).requires_grad_()
    return p, logits


def test_the_overlap_is_the_acceptance_probability_of_speculative_sampling():
    """alpha equals sum_x q(x) min(1, p(x) / q(x)), the probability that a drafted x ~ q is kept,
    and 1 - alpha the total variation distance, half the L1 distance."""
    p, logits = distributions()
    q = torch.softmax(logits, -1)
    accepted = (q * torch.clamp(p / q, max=1.0)).sum(-1)
    assert_same_numbers(overlap(p, torch.log_softmax(logits, -1)), accepted)
    assert_same_numbers(position_loss("tv", p, torch.log_softmax(logits, -1)), 0.5 * (p - q).abs().sum(-1))


def test_kl_is_the_soft_cross_entropy_and_nla_is_cross_entropy_on_one_token():
    """kl: torch's cross-entropy against probabilities (KL's gradient); nla on a one-token target:
    the cross-entropy on that token (the LK paper's reduction)."""
    p, logits = distributions(sharp=1.0)  # no draft probability under nla's floor of 1e-5
    logq = torch.log_softmax(logits, -1)
    assert_same_numbers(position_loss("kl", p, logq), F.cross_entropy(logits, p, reduction="none"))
    token = p.argmax(-1)
    one_token = F.one_hot(token, p.shape[-1]).to(p.dtype)
    assert_same_numbers(position_loss("nla", one_token, logq), F.cross_entropy(logits, token, reduction="none"))
    assert_other_numbers(position_loss("nla", p, logq), F.cross_entropy(logits, token, reduction="none"))


def test_lk_hybrid_blends_kl_and_tv_by_a_weight_it_does_not_differentiate():
    """lk_hybrid = lam KL(p || q) + (1 - lam) TV with lam = exp(-eta alpha), and its gradient is that
    of the blend with lam held fixed; differentiating through lam (a wrong variant) gives another."""
    p, logits = distributions(seed=1)
    eta = 3.0
    loss = position_loss("lk_hybrid", p, torch.log_softmax(logits, -1), eta)
    q = torch.softmax(logits, -1)
    kl = F.kl_div(torch.log_softmax(logits, -1), p, reduction="none").sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    lam = torch.exp(-eta * (1 - tv))
    assert_same_numbers(loss, lam * kl + (1 - lam) * tv)
    (ours,) = torch.autograd.grad(loss.sum(), logits)
    (held,) = torch.autograd.grad((lam.detach() * kl + (1 - lam.detach()) * tv).sum(), logits, retain_graph=True)
    (through,) = torch.autograd.grad((lam * kl + (1 - lam) * tv).sum(), logits)
    assert_same_numbers(ours, held)
    assert_other_numbers(ours, through)
    assert (lam > 0.05).all() and (lam < 0.95).any(), "both terms weigh somewhere"


@pytest.mark.parametrize("name", LOSS_FNS)
def test_every_loss_is_least_where_the_draft_is_the_target(name):
    """A draft equal to the target scores no worse than one moved off it, for every objective; the
    acceptance losses are 0 there."""
    p, logits = distributions(seed=2)
    at_target = position_loss(name, p, p.log())
    moved = position_loss(name, p, torch.log_softmax(logits.detach(), -1))
    assert (at_target <= moved + 1e-12).all()
    if name in ("tv", "nla"):
        assert at_target.abs().max() < 1e-12


def test_an_unknown_loss_is_refused_in_one_line():
    p, logits = distributions()
    with pytest.raises(SpecHeadsError, match="head.loss_fn must be one of kl, lk_hybrid, nla, tv, got 'js'"):
        position_loss("js", p, torch.log_softmax(logits, -1))


def test_a_negative_lk_eta_is_refused_before_training(tmp_path):
    """train.py head.loss_fn=lk_hybrid head.lk_eta=-1: one line, exit 2, before the target loads
    (it used to train: exp(-eta * alpha) > 1 turns the TV term's weight negative)."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "train.py", "model=tiny-random", "head.loss_fn=lk_hybrid", "head.lk_eta=-1", "tracker=none",
         f"output_dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr[-2000:]
    assert "head.lk_eta must be >= 0" in errors[0] and not (tmp_path / "run" / "head").exists()
