"""The per-position objectives a fused draft (EAGLE-3, P-EAGLE) can train on: how far the draft's
distribution q is from the target's p, both over the draft vocabulary (`head.loss_fn`).

Why acceptance is the overlap: speculative sampling accepts a drafted token x ~ q with probability
min(1, p(x) / q(x)), so a draft step is accepted with probability
    alpha = sum_x q(x) min(1, p(x) / q(x)) = sum_x min(p(x), q(x)) = 1 - TV(p, q).
KL bounds TV only loosely (Pinsker), so the LK losses (Samarin et al. 2026, arXiv 2602.23881)
train on alpha itself:
- tv: 1 - alpha. Its gradient vanishes where the two barely overlap (a young draft).
- nla: -log alpha, TV's gradient scaled by 1 / alpha; cross-entropy when p is one token.
- lk_hybrid: lam * KL(p || q) + (1 - lam) * TV with lam = exp(-eta * alpha), alpha not
  differentiated: KL's strong gradient while the draft is far off, TV as it gets close.
- kl: the soft cross-entropy -sum p log q, KL(p || q) plus p's entropy (the same gradient; the
  default, and the loss every head trained before these choices has).
"""

from __future__ import annotations

import torch

from ..errors import SpecHeadsError

LOSS_FNS = ("kl", "lk_hybrid", "nla", "tv")
_NLA_FLOOR = 1e-5  # alpha below this is clamped: -log 0 would be infinite


def check_loss_fn(name: str, eta: float = 3.0) -> None:
    if name not in LOSS_FNS:
        raise SpecHeadsError(f"head.loss_fn must be one of {', '.join(LOSS_FNS)}, got {name!r}")
    if eta < 0:  # exp(-eta * alpha) > 1 would weigh the TV term by a negative 1 - lambda
        raise SpecHeadsError(
            f"head.lk_eta must be >= 0 (a negative eta turns lk_hybrid's TV weight negative), got {eta}"
        )


def overlap(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) over the last dimension: the acceptance probability of a step."""
    return torch.minimum(p, logq.exp()).sum(-1)


def position_loss(name: str, p: torch.Tensor, logq: torch.Tensor, eta: float = 3.0) -> torch.Tensor:
    """[..., V] target probabilities p and draft log-probabilities logq -> [...] the loss `name`."""
    if name == "kl":
        return -(p * logq).sum(-1)
    check_loss_fn(name)
    alpha = overlap(p, logq)
    if name == "tv":
        return 1.0 - alpha
    if name == "nla":
        return -alpha.clamp(min=_NLA_FLOOR).log()
    # lk_hybrid, on KL itself: the cross-entropy's extra entropy term would change the blend's scale
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1.0 - lam) * (1.0 - alpha)
