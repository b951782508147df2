"""Medusa-1: K heads on the frozen target's final state; head k predicts token t+k+2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..target import TargetInfo
from .base import DraftHead, chain_metrics, shifted
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

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h, v = info.hidden_size, info.vocab_size
        # A fresh ResBlock per layer and per head: no module object is shared.
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(spec.num_layers)]) for _ in range(spec.num_heads)
        )
        self.lm_heads = None if spec.shared_lm_head else nn.ModuleList(
            nn.Linear(h, v, bias=False) for _ in range(spec.num_heads))

    def init_from_target(self) -> None:
        """Per-head LM heads start as copies of the target's, as in the Medusa paper."""
        if self.lm_heads is not None:
            with torch.no_grad():
                for lm in self.lm_heads:
                    lm.weight.copy_(self.frozen.lm_head.weight.to(lm.weight.dtype))

    @property
    def reads_final(self) -> bool:
        return True

    def target_layer_ids(self) -> list[int]:
        return []

    def training_states(self):
        return [], True

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
        valid = batch["attention_mask"].bool()
        greedy = self.target_logits(states["final"]).argmax(-1)  # greedy[t] is the token t+1
        labels, counted = [], []
        for k in range(self.spec.num_heads):
            labels.append(shifted(input_ids, k + 2))
            # a position counts when token t+k+2 exists and is an assistant token
            counted.append(shifted(loss_mask & valid, k + 2, False) & valid)
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
            total = total + self.spec.medusa_decay ** k * lk
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
