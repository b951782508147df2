"""Hydra (Ankner et al. 2024): Medusa heads made sequentially dependent.

Head k predicts the token at depth k+1 below the root (token t+k+2 at position t) from the
target's post-norm final state h_t, as a Medusa head does, and from the target's own (frozen)
input embeddings of the tokens on the path above it: the root x_{t+1} (the target's own next
token) and the drafted x_{t+2}..x_{t+k+1}. Its input is cat(h_t, e(x_{t+1}), ..., e(x_{t+k+1})),
(k+2)H wide, through num_layers residual blocks (the first one projects to H) and an LM head.
Training is teacher forced: the path is the true continuation of the sequence.

Hydra++ options: `hydra_teacher_loss` (soft CE against the target's distribution instead of the
data's tokens) and `hydra_prefix_layer` (one causal decoder layer over the target's final states
whose output replaces h_t as the heads' base state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..target import TargetInfo
from .base import DraftHead, chain_metrics, document_causal_mask, positions, shifted, within
from .layers import DraftCache, DraftDecoderLayer, Rotary, draft_llama_config
from .medusa import MedusaHead, ResBlock
from .spec import HeadSpec


class ConditionedResBlock(nn.Module):
    """proj(x) + SiLU(Wx + b) from the (k+2)H-wide head input to H (Hydra's first block).

    W starts at zero and proj at [I, 0, ...] (h_t only): a fresh Hydra head computes what a fresh
    Medusa head does, and learns from there how much of the path to read.
    """

    def __init__(self, hidden_size: int, inputs: int):
        super().__init__()
        self.linear = nn.Linear(inputs * hidden_size, hidden_size)
        self.proj = nn.Linear(inputs * hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.linear.weight)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, :hidden_size].copy_(torch.eye(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + F.silu(self.linear(x))


class HydraHead(DraftHead):
    family = "hydra"
    reads_final_state = True
    title = "Hydra"
    # level by level: a node's children come from the head of its depth, given the node's path
    draft_kind = "sequential"
    fallback_tree = MedusaHead.fallback_tree  # cut to the head's depth by the tree policy

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h, v = info.hidden_size, info.vocab_size
        # head k reads h and k+1 path embeddings; a fresh module per layer and per head
        self.blocks = nn.ModuleList(
            nn.Sequential(ConditionedResBlock(h, k + 2), *[ResBlock(h) for _ in range(spec.num_layers - 1)])
            for k in range(spec.num_heads)
        )
        self.lm_heads = (
            None if spec.shared_lm_head else nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(spec.num_heads))
        )
        self.prefix = None
        if spec.hydra_prefix_layer:
            config = draft_llama_config(info, spec.intermediate_size or info.intermediate_size)
            self.prefix = DraftDecoderLayer(config, h)
            self.rotary = Rotary(config)
            # zero output projections: a fresh layer is the identity, so the heads start from h_t
            nn.init.zeros_(self.prefix.self_attn.o_proj.weight)
            nn.init.zeros_(self.prefix.mlp.down_proj.weight)

    # Per-head LM heads start as copies of the target's (Hydra's reference code does as Medusa's),
    # and each head drafts one depth: the same as Medusa, so the same code.
    init_from_target = MedusaHead.init_from_target
    max_draft_depth = MedusaHead.__dict__["max_draft_depth"]

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        base = "the target's final state"
        if spec.hydra_prefix_layer:
            base = "a causal prefix layer over " + base
        return (
            f"{spec.num_heads} Hydra heads ({spec.num_layers} ResBlock each) on {base} and the embeddings "
            "of the tokens drafted before them"
        )

    # -- the forward pieces the drafter and the loss share -------------------------------------
    def new_prefix_cache(self) -> DraftCache | None:
        return DraftCache(1) if self.prefix is not None else None

    def base_states(self, final: torch.Tensor, cache: DraftCache | None = None, batch=None) -> torch.Tensor:
        """[B, T, H] the heads' base state at every position: the final state itself, or the prefix
        layer's output (causal; with `cache`, the positions continue after the cached ones; a
        packed `batch` keeps it inside each conversation, at the conversation's positions)."""
        x = final.to(self.dtype)
        if self.prefix is None:
            return x
        b, t, _ = x.shape
        mask = None
        if batch is not None and "document" in batch:
            position_ids, mask = positions(batch), document_causal_mask(batch)
        else:
            start = cache.length if cache is not None else 0
            position_ids = torch.arange(start, start + t, device=x.device).unsqueeze(0).expand(b, t)
        cos, sin = self.rotary(x, position_ids)
        # the final state is already normalised: no input norm, as in EAGLE-1's layer
        return self.prefix(x, x, cos, sin, cache, 0, mask)

    def head_logits(self, k: int, base: torch.Tensor, path_ids: torch.Tensor) -> torch.Tensor:
        """[..., V] head k's logits from base [..., H] and path_ids [..., k+1] (root first)."""
        if path_ids.shape[-1] != k + 1:
            raise ValueError(f"head {k} reads {k + 1} path tokens, got {path_ids.shape[-1]}")
        x = torch.cat([base.to(self.dtype), self.embed(path_ids).flatten(-2)], dim=-1)
        y = self.blocks[k](x)
        lm = self.lm_heads[k] if self.lm_heads is not None else self.frozen.lm_head
        return lm(y.to(lm.weight.dtype)).float()

    def teacher_forced_logits(self, input_ids, states, depth, batch=None):
        """As DraftHead's; a packed `batch` (of these input_ids) keeps the prefix layer inside each
        conversation (a path running past a conversation's end is cut from the loss by _counted)."""
        base = self.base_states(states["final"], batch=batch)
        out = []
        for k in range(min(depth, self.spec.num_heads)):
            # at position t the path is the true x_{t+1}..x_{t+k+1}; the tail past the end is 0
            path = torch.stack([shifted(input_ids, j) for j in range(1, k + 2)], dim=-1)
            out.append(self.head_logits(k, base, path))  # predicts token t+k+2
        return out

    # -- training ----------------------------------------------------------------------------
    def _counted(self, batch) -> torch.Tensor:
        """[K, B, T]: position t counts for head k when token t+k+2 exists in its conversation and
        is an assistant token."""
        mask = batch["loss_mask"].bool()
        return torch.stack([shifted(mask, k + 2, False) & within(batch, k + 2) for k in range(self.spec.num_heads)])

    def loss(self, batch, states):
        input_ids = batch["input_ids"]
        logits = self.teacher_forced_logits(input_ids, states, self.spec.num_heads, batch)
        counted = self._counted(batch)
        # Hydra++: the target's distribution of token t+1 sits at position t
        teacher = self.target_logits(states["final"]) if self.spec.hydra_teacher_loss else None
        total = logits[0].new_zeros(())
        metrics = {}
        for k, lk_logits in enumerate(logits):
            mask = counted[k]
            n = mask.sum().clamp(min=1)
            logq = torch.log_softmax(lk_logits, dim=-1)
            if teacher is not None:
                p = torch.softmax(shifted(teacher, k + 1), dim=-1)
                per_pos = -(p * logq).sum(-1)
                wanted = p.argmax(-1)
            else:
                wanted = shifted(input_ids, k + 2)
                per_pos = -logq.gather(-1, wanted.unsqueeze(-1)).squeeze(-1)
            lk = (per_pos * mask).sum() / n
            total = total + self.spec.medusa_decay**k * lk
            metrics[f"loss_{k}"] = lk.item()
            metrics[f"acc_{k}"] = (((logq.argmax(-1) == wanted) & mask).sum() / n).item()
        return total, metrics

    @torch.no_grad()
    def evaluate(self, batch, states):
        greedy = self.target_logits(states["final"]).argmax(-1)  # greedy[t] is the token t+1
        logits = self.teacher_forced_logits(batch["input_ids"], states, self.spec.num_heads, batch)
        # greedy acceptance compares head k with the target's argmax for token t+k+2
        hits = torch.stack([lg.argmax(-1) == shifted(greedy, k + 1) for k, lg in enumerate(logits)])
        return chain_metrics(hits.flatten(1), self._counted(batch).flatten(1))
