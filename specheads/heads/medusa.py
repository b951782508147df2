"""Medusa-1: K heads on the frozen target's final state; head k predicts token t+k+2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..target import FrozenTarget, TargetInfo
from .base import DraftHead, chain_metrics, shifted, within
from .spec import HeadSpec


class ResBlock(nn.Module):
    """x + SiLU(Wx + b); W starts at zero so a fresh block is close to the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(DraftHead):
    family = "medusa"
    reads_final_state = True
    title = "Medusa"
    draft_kind = "parallel"  # head k's top-k at the last accepted position fill depth k+1
    # 16 nodes over 3 depths: the tree drafted when the head stores none (cut to the head's depth)
    fallback_tree = (
        (0,),
        (1,),
        (2,),
        (3,),
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (2, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 0),
        (0, 0, 2),
        (2, 0, 0),
    )

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h, v = info.hidden_size, info.vocab_size
        # A fresh ResBlock per layer and per head: no module object is shared.
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(spec.num_layers)]) for _ in range(spec.num_heads)
        )
        self.lm_heads = (
            None if spec.shared_lm_head else nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(spec.num_heads))
        )

    def init_from_target(self) -> None:
        """Per-head LM heads start as copies of the target's, as in the Medusa paper."""
        if self.lm_heads is not None:
            with torch.no_grad():
                for lm in self.lm_heads:
                    lm.weight.copy_(self.frozen.lm_head.weight.to(lm.weight.dtype))

    @classmethod
    def max_draft_depth(cls, spec: HeadSpec) -> int:
        return spec.num_heads  # one head per depth

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        return f"{spec.num_heads} Medusa heads ({spec.num_layers} ResBlock each) on the target's final state"

    @classmethod
    def adopt_exported(
        cls, spec: HeadSpec, tensors: dict[str, torch.Tensor], target: FrozenTarget
    ) -> dict[str, torch.Tensor]:
        """Engine formats store a shared LM head as per-head copies: all exact copies of the
        target's LM head read back as a shared-LM-head Medusa."""
        ref = target.lm_head.weight.detach().to("cpu")
        heads = [tensors.get(f"lm_heads.{k}.weight") for k in range(spec.num_heads)]
        if not all(h is not None and h.shape == ref.shape and torch.equal(h.to(ref.dtype), ref) for h in heads):
            return tensors
        spec.shared_lm_head = True
        return {k: v for k, v in tensors.items() if not k.startswith("lm_heads.")}

    def teacher_forced_logits(self, input_ids, states, depth):
        logits = self.medusa_logits(states["final"])  # head k at t predicts t+k+2
        return [logits[k] for k in range(min(depth, logits.shape[0]))]

    def medusa_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """[K, B, T, V]: head k's logits for token t+k+2 at every position t."""
        x = final_hidden.to(self.dtype)
        out = []
        for k, blocks in enumerate(self.blocks):
            y = blocks(x)
            lm = self.lm_heads[k] if self.lm_heads is not None else self.frozen.lm_head
            out.append(lm(y.to(lm.weight.dtype)))
        return torch.stack(out).float()

    def _targets(self, batch, states):
        """Per head k: labels (the target's greedy token t+k+2) and which positions count."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        greedy = self.target_logits(states["final"]).argmax(-1)  # greedy[t] is the token t+1
        labels, counted = [], []
        for k in range(self.spec.num_heads):
            labels.append(shifted(input_ids, k + 2))
            # a position counts when token t+k+2 exists in its conversation and is an assistant token
            counted.append(shifted(loss_mask, k + 2, False) & within(batch, k + 2))
        return torch.stack(labels), torch.stack(counted), greedy

    def loss(self, batch, states):
        logits = self.medusa_logits(states["final"])
        labels, counted, _ = self._targets(batch, states)
        total = logits.new_zeros(())
        metrics = {}
        for k in range(self.spec.num_heads):
            n = counted[k].sum().clamp(min=1)
            ce = F.cross_entropy(logits[k].flatten(0, 1), labels[k].flatten(), reduction="none")
            lk = (ce * counted[k].flatten()).sum() / n
            total = total + self.spec.medusa_decay**k * lk
            hits = (logits[k].argmax(-1) == labels[k]) & counted[k]
            metrics[f"loss_{k}"] = lk.item()
            metrics[f"acc_{k}"] = (hits.sum() / n).item()
        return total, metrics

    @torch.no_grad()
    def evaluate(self, batch, states):
        logits = self.medusa_logits(states["final"])
        _, counted, greedy = self._targets(batch, states)
        hits = []
        for k in range(self.spec.num_heads):
            # greedy acceptance compares with the target's argmax for token t+k+2
            hits.append(logits[k].argmax(-1) == shifted(greedy, k + 1))
        return chain_metrics(torch.stack(hits).flatten(1), counted.flatten(1))
