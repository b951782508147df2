"""DSpark (arXiv 2607.05147, DeepSeek): DFlash's block drafter (heads/dflash.py) with two small heads
on the block's final-normed slot states, laid out as speculators' DSparkDraftModel has them (vLLM
serves that format with its `dspark` method).

- Markov head: a low-rank bias on each drafting slot's logits from the token before the one the
  slot drafts, bias = markov_w2(markov_w1[prev]) (markov_w1: an r-wide embedding of every target
  token, markov_w2: r -> vocabulary, zero at first so that a fresh head drafts as its DFlash
  backbone); "gated" scales the embedding by sigmoid(gate_proj([state; embedding])) first. The
  block's drafts then depend on each other: drafting runs the block once, then goes slot by slot,
  each slot biased by the token drafted at the slot before it (in a tree, a node's children by the
  node's own token, the root's by the bonus token). Training biases each slot by the data's token
  before its label, which is what drafting reads wherever the drafts before it were right.
- Confidence head: a linear map of each drafting slot's state (and the previous token's Markov
  embedding, head.confidence_head_with_markov) to one logit, the slot's own acceptance rate, as
  speculators trains it (models/dspark/metrics.py compute_metrics): the target is
  accept_rate = sum_v min(q_v, p_v) = 1 - TV(p, q), the overlap of the slot's draft distribution q
  (softmax of its Markov-biased logits, temperature 1) with the target's p for the same token,
  detached, under binary cross-entropy with soft targets; each slot's term weighs its depth's decay
  exp(-(d - 1) / gamma), and their sum is divided by the NUMBER of trained slots (speculators'
  _masked_decayed_mean, not the sum of the weights), times head.confidence_head_alpha. The
  cumulative acceptance up to depth d is then the product of the slots' predictions along the
  chain (speculators' confidence_cumprod metric, vLLM's adaptive verification's survival
  probability): drafting stops the block at the first depth where that product along the block's
  top-1 chain falls below head.confidence_threshold (0: never); a tree is cut at that depth.

Slot numbering. Our anchor t is the last position whose target features the block reads; slot 0
holds token t+1 (at inference the bonus token) at position t+1. With head.sample_from_anchor (the
default, speculators' and DeepSpec's) slot k drafts token t+2+k: depth 1 comes from slot 0 itself
and a block of B slots drafts B tokens. DFlash, and DSpark with sample_from_anchor=false, draft
token t+1+k from slots k >= 1 (B - 1 tokens). speculators and DeepSpec call our t+1 the anchor (the
position that holds the bonus token; the context stops before it), so their slot k is our slot k;
the draft at depth d weighs exp(-(d - 1) / gamma) everywhere (DeepSpec's exp(-k / gamma) over slots
from 0). A DFlash head's slot k drafts what a DSpark head's slot k - 1 drafts: one apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..target import TargetInfo
from .dflash import ChainedBlock, DFlashHead
from .spec import HeadSpec


class MarkovHead(nn.Module):
    """The logit bias of a slot from the token before the one it drafts (speculators' MarkovHead names)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        self.head_type = head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def forward(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[..., V]: the bias of slots with states h [..., H] whose previous tokens are prev [...]."""
        e = self.embed(prev).to(h.dtype)
        if self.head_type == "gated":
            e = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e
        return self.markov_w2(e)


class ConfidenceHead(nn.Module):
    """One logit per slot: its predicted acceptance rate (speculators' ConfidenceHead names)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkHead(DFlashHead):
    family = "dspark"
    title = "DSpark"
    draft_kind = "markov_block"  # one block forward, then slot by slot: MarkovBlockDrafter

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h, rank = info.hidden_size, spec.markov_rank
        self.markov_head = MarkovHead(info.vocab_size, rank, h, spec.markov_head_type)
        self.confidence_head = None
        if spec.enable_confidence_head:
            self.confidence_head = ConfidenceHead(h + (rank if spec.confidence_head_with_markov else 0))

    @classmethod
    def draft_slot0(cls, spec: HeadSpec) -> int:
        return 0 if spec.sample_from_anchor else 1

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        confidence = ", and a confidence head that stops a block early" if spec.enable_confidence_head else ""
        return (
            f"a DSpark draft ({spec.dflash_layers} non-causal decoder layers, blocks of {spec.block_size} drafting up "
            f"to {cls.max_draft_depth(spec)} tokens, each slot's logits biased by a rank-{spec.markov_rank} "
            f"{spec.markov_head_type} Markov head from the token drafted before it{confidence}) with target layers "
            f"{layer_ids} (residual stream entering layer k) injected into every layer's keys and values, the "
            f"target's embedding and LM head shared"
        )

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.draft_logits(h) + self.markov_head(prev, h).float()

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[...]: the confidence head's logit for slots with states h [..., H] after tokens prev [...]."""
        if self.spec.confidence_head_with_markov:
            h = torch.cat([h, self.markov_head.embed(prev).to(h.dtype)], dim=-1)
        return self.confidence_head(h).float()

    # -- inference -------------------------------------------------------------------------
    def draft_block(self, input_ids, features, cache, depth: int) -> DraftBlock:
        """Feed the accepted rows into the context cache and run one block (block_states): its
        drafting slots for depths 1..depth."""
        slot0 = self.draft_slot0(self.spec)
        h = self.block_states(input_ids, features, cache)[0, slot0 : slot0 + max(depth, 1)]
        return DraftBlock(self, h)

    def parallel_logits(self, input_ids, features, cache, positions: int) -> torch.Tensor:
        """[positions, V]: the block's logits along its top-1 chain, the first slot biased by the
        bonus token (input_ids' last), each later one by the slot before's top-1 draft."""
        return self.draft_block(input_ids, features, cache, positions).chain(int(input_ids[0, -1]))[1]

    # -- training --------------------------------------------------------------------------
    def loss(self, batch, states):
        blocks = self.training_blocks(batch, states)
        ids, kept = batch["input_ids"], blocks.kept
        h, depth = blocks.h[kept], blocks.depth[kept]
        prev = ids.gather(1, blocks.where - 1)[kept]  # the data's token before each drafted one
        logits = self.slot_logits(h, prev)
        total, metrics = self.decayed_loss(logits, ids.gather(1, blocks.where)[kept], depth)
        if self.confidence_head is None:
            return total, metrics
        target = self.acceptance_rate(blocks, logits, states)
        confidence = self.confidence_logits(h, prev)
        bce = F.binary_cross_entropy_with_logits(confidence, target.to(confidence.dtype), reduction="none")
        # speculators' _masked_decayed_mean: the decayed terms over the number of trained slots
        confidence_loss = (bce * self.depth_weight(depth)).sum() / (len(bce) + 1e-8)
        metrics["confidence_loss"] = confidence_loss.item()
        error = (torch.sigmoid(confidence) - target).abs()
        metrics["confidence_error"] = error.mean().item() if error.numel() else 0.0
        return total + self.spec.confidence_head_alpha * confidence_loss, metrics

    @torch.no_grad()
    def acceptance_rate(self, blocks, logits: torch.Tensor, states) -> torch.Tensor:
        """The confidence head's targets, one per trained slot (`logits` [n, V] their drafts, in
        blocks.kept's order): sum_v min(q_v, p_v) = 1 - TV(p, q) between the slot's draft
        distribution q and the target's p for the token it drafts (at `where`), both softmaxes in
        float32 at temperature 1 (speculators' tv_loss), detached."""
        rows = torch.arange(len(blocks.h), device=logits.device)[:, None].expand_as(blocks.where)[blocks.kept]
        where = blocks.where[blocks.kept]
        target = self.target_logits(states["final"][rows, where - 1])  # the target's logits for the token at `where`
        q = torch.softmax(logits.float(), dim=-1)
        p = torch.softmax(target.float(), dim=-1)
        return torch.minimum(q, p).sum(dim=-1)


class DraftBlock(ChainedBlock):
    """One drafted block: the final-normed states [D, H] of its drafting slots (depths 1..D) and their
    DFlash logits, to which each node's Markov bias is added as the tree grows."""

    def __init__(self, head: DSparkHead, h: torch.Tensor):
        self.head = head
        self.h = h
        self.base = head.draft_logits(h)

    def logits(self, depths: list[int], prev: list[int]) -> torch.Tensor:
        """[n, V]: the draft logits at each depth (1..D) after each previous token."""
        at = torch.tensor(depths, device=self.h.device) - 1
        prev_ids = torch.tensor(prev, device=self.h.device)
        return self.base[at] + self.head.markov_head(prev_ids, self.h[at]).float()

    def confidence(self, depths: list[int], prev: list[int]) -> torch.Tensor:
        """[n]: each depth's (1..D) predicted acceptance rate after each previous token (one slot's,
        not the block's up to it)."""
        at = torch.tensor(depths, device=self.h.device) - 1
        return torch.sigmoid(self.head.confidence_logits(self.h[at], torch.tensor(prev, device=self.h.device)))

    def stop_depth(self, root: int) -> int:
        """The deepest depth to draft: the last before the first one where the predicted cumulative
        acceptance, the product of the slots' predicted acceptance rates along the top-1 chain after
        `root`, is below head.confidence_threshold (D: never stopped)."""
        threshold = self.head.spec.confidence_threshold
        if threshold <= 0 or self.head.confidence_head is None:
            return len(self.h)
        prev, survival = root, 1.0
        for d in range(1, len(self.h) + 1):
            survival *= float(self.confidence([d], [prev])[0])
            if survival < threshold:
                return d - 1
            prev = int(self.logits([d], [prev])[0].argmax())
        return len(self.h)
