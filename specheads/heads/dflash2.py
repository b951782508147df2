"""DFlash2: DFlash's block drafter (heads/dflash.py) with two additions, laid out as vLLM's
qwen3_dflash2.py has them (DFlash2Qwen3DecoderLayer, DFlashGroupedConv, CandidateSelector) and
drafted as its dflash2 speculator drafts (v1/worker/gpu/spec_decode/dflash2/speculator.py).

- In-block grouped convolution. Every layer wraps both sublayers in a dynamic grouped 1-D
  convolution over the block's slots (`attention_conv` around attention, `mlp_conv` around the MLP):

      x = input_layernorm(h);            x', c = attention_conv.prepare(x)
      h = h + attention_conv.finish(attention(x'), c)
      y = post_attention_layernorm(h);   y', c = mlp_conv.prepare(y)
      h = h + mlp_conv.finish(mlp(y'), c)

  prepare(x) projects the sublayer's normed input to 2 x taps x groups dynamic weights per slot
  (kernel_projection), convolves x with the first half (side 0) and keeps the second half (side 1)
  for finish, which convolves the sublayer's output with it. A convolution of side s at slot i,
  channel ch in group g = ch // conv_group_size:

      out[i, ch] = sum_{j=0}^{taps-1} [i - j >= 0] (base_kernel[s, j, ch] + delta[i, j, g]) x[i - j, ch]

  with i the slot inside its block (vLLM's row % block_size): backward only and never past slot 0,
  so it never reads another block, whatever the block attention does (vLLM's kernel has no
  forward-looking taps; DFlash's block attention stays non-causal). Only the block's rows are
  convolved: the injected context's keys and values are DFlash's. A fresh head starts as its DFlash
  backbone: base_kernel is 1 at tap 0 and 0 elsewhere, kernel_projection 0.
- Candidate selector. A slot's draft is one of the top selector_top_k tokens of the LM head over
  its final-normed state h (the unary logits), reranked after the token p drafted before it (the
  bonus token at the first slot, a node's own token in a tree):

      score(c) = unary(c) + sum_r predecessor_codebook[p, r] * hidden_projection(h)[r] * successor_codebook[c, r]

  vLLM walks the block slot by slot, drafting the candidate of highest score (temperature 0) and
  caching the scores as the draft's logits, -inf outside the candidates; a tree here takes a node's
  children from the top-ranked candidates of its depth's slot after the node's token (decode/
  drafters.py MarkovBlockDrafter, through draft_block). hidden_projection starts at 0, so a fresh
  selector keeps the LM head's order. Training adds to DFlash's decayed cross-entropy (the unary
  logits over the whole vocabulary) head.selector_loss_weight x the same-weighted cross-entropy of
  the scores over each slot's candidates against the data's token, after the data's token before it
  (what drafting reads wherever the drafts before were right), at the slots whose candidates hold
  that token; it reaches the draft's layers through the unary logits too.

Our names -> vLLM's weight names (qwen3_dflash2.py; the DFlash ones as in export/dflash.py: the
tied k_norm written once per layer, embedding and LM head the target's), i over the draft layers:
  layers.{i}.attention_conv.base_kernel                 -> layers.{i}.attention_conv.base_kernel [2, taps, H]
  layers.{i}.attention_conv.kernel_projection.weight    -> layers.{i}.attention_conv.kernel_projection.weight
                                                           [2 * taps * H / conv_group_size, H]
  layers.{i}.mlp_conv.base_kernel                       -> layers.{i}.mlp_conv.base_kernel
  layers.{i}.mlp_conv.kernel_projection.weight          -> layers.{i}.mlp_conv.kernel_projection.weight
  candidate_selector.predecessor_codebook               -> candidate_selector.predecessor_codebook [V, rank]
  candidate_selector.successor_codebook                 -> candidate_selector.successor_codebook [V, rank]
  candidate_selector.hidden_projection.weight           -> candidate_selector.hidden_projection.weight [rank, H]
and dflash_config's conv_kernel_size, conv_group_size, selector_rank, selector_top_k are
head.conv_kernel_size, head.conv_group_size, head.selector_rank, head.selector_top_k (the four
update_dflash2 carries from the speculators format). vLLM's optional input_embedding_scale,
output_multiplier and final_logit_softcapping are their defaults here (1, 1, none). vLLM sizes the
convolution's block as 1 + num_speculative_tokens: served with K = block_size - 1 it convolves as
trained.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..target import TargetInfo
from .dflash import ChainedBlock, DFlashHead, DFlashLayer
from .spec import HeadSpec


class GroupedConv(nn.Module):
    """vLLM's DFlashGroupedConv: a dynamic grouped convolution over the slots of each block, static
    per-channel weights (base_kernel, one set per side) plus per-slot, per-group weights projected
    from the sublayer's input (kernel_projection)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.num_groups = hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0  # the identity: a fresh convolution passes its input through
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x [B, N, H]: whole blocks of block_size slots each, one after the other (N = A x
        block_size); delta [B, N, taps, groups]: each slot's dynamic weights; base [taps, H]."""
        b, n, h = x.shape
        size = self.block_size
        if n % size:
            raise ValueError(f"{n} rows are not whole blocks of {size} slots")
        blocks = x.view(b, n // size, size, self.num_groups, self.group_size)
        weight = base.view(self.taps, self.num_groups, self.group_size).to(x.dtype)
        weight = weight + delta.view(b, n // size, size, self.taps, self.num_groups, 1).to(x.dtype)
        out = weight[..., 0, :, :] * blocks
        for tap in range(1, min(self.taps, size)):  # slot i reads slot i - tap of its own block
            earlier = F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
            out = out + weight[..., tap, :, :] * earlier
        return out.view(b, n, h)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input x convolved (side 0), and the dynamic weights finish convolves with."""
        delta = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.num_groups)
        return self.convolve(x, delta[:, :, 0], self.base_kernel[0]), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y convolved (side 1) with the weights prepare projected."""
        return self.convolve(y, delta, self.base_kernel[1])


class DFlash2Layer(DFlashLayer):
    """DFlash's decoder layer with each sublayer between a convolution's prepare and finish."""

    def __init__(self, config, spec: HeadSpec):
        super().__init__(config)
        args = (config.hidden_size, spec.conv_kernel_size, spec.conv_group_size, spec.block_size)
        self.attention_conv = GroupedConv(*args)
        self.mlp_conv = GroupedConv(*args)

    def forward(self, h, context: tuple[torch.Tensor, torch.Tensor], k_norm, cos, sin, mask):
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.attention(x, context, k_norm, cos, sin, mask), delta)
        y, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(y), delta)


class CandidateSelector(nn.Module):
    """vLLM's CandidateSelector: the low-rank score of each candidate after a previous token."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        scale = rank**-0.25  # a bilinear term of about the size of (W h) once W is trained
        self.predecessor_codebook = nn.Parameter(scale * torch.randn(vocab_size, rank))
        self.successor_codebook = nn.Parameter(scale * torch.randn(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)  # a fresh selector keeps the LM head's order

    def forward(self, candidates: torch.Tensor, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor):
        """Scores [..., k] of candidates [..., k] (their unary logits [..., k]) at slots of states
        h [..., H] after tokens prev [...]."""
        edge = self.predecessor_codebook[prev] * self.hidden_projection(h)
        pair = torch.einsum("...r,...kr->...k", edge, self.successor_codebook[candidates])
        return unary.float() + pair.float()


class DFlash2Head(DFlashHead):
    family = "dflash2"
    title = "DFlash2"
    # one block forward, then slot by slot, a node's children reranked after its token: MarkovBlockDrafter
    draft_kind = "markov_block"

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        self.candidate_selector = CandidateSelector(
            info.hidden_size, info.vocab_size, spec.selector_rank, spec.selector_top_k
        )

    def new_layer(self, config) -> DFlash2Layer:
        return DFlash2Layer(config, self.spec)

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        return (
            f"a DFlash2 draft ({spec.dflash_layers} non-causal decoder layers, their sublayers wrapped in "
            f"{spec.conv_kernel_size}-tap grouped convolutions over each block of {spec.block_size}, up to "
            f"{cls.max_draft_depth(spec)} drafts per forward, each slot's top-{spec.selector_top_k} reranked by a "
            f"rank-{spec.selector_rank} selector after the token drafted before it) with target layers {layer_ids} "
            f"(residual stream entering layer k) injected into every layer's keys and values, the target's "
            f"embedding and LM head shared"
        )

    def rerank(self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k candidates [..., k] of unary logits [..., V] (slots of states h [..., H] after
        tokens prev [...]), best unary first, and the selector's scores of them [..., k]."""
        unary_k, candidates = torch.topk(unary, self.spec.selector_top_k, dim=-1)
        return candidates, self.candidate_selector(candidates, unary_k, h, prev)

    def reranked_logits(self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The draft logits [..., V]: the selector's scores at the candidates, -inf elsewhere (vLLM's
        cached draft logits)."""
        candidates, scores = self.rerank(unary, h, prev)
        return torch.full_like(unary, float("-inf")).scatter(-1, candidates, scores)

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.reranked_logits(self.draft_logits(h), h, prev)

    # -- inference -------------------------------------------------------------------------
    def draft_block(self, input_ids, features, cache, depth: int) -> SelectorBlock:
        """Feed the accepted rows into the context cache and run one block (block_states): its
        drafting slots for depths 1..depth."""
        h = self.block_states(input_ids, features, cache)[0, 1 : 1 + max(depth, 1)]
        return SelectorBlock(self, h)

    def parallel_logits(self, input_ids, features, cache, positions: int) -> torch.Tensor:
        """[positions, V]: the block's reranked logits along vLLM's walk, the first slot after the
        bonus token (input_ids' last), each later one after the slot before's drafted token."""
        return self.draft_block(input_ids, features, cache, positions).chain(int(input_ids[0, -1]))[1]

    # -- training --------------------------------------------------------------------------
    def loss(self, batch, states):
        blocks = self.training_blocks(batch, states)
        ids, kept = batch["input_ids"], blocks.kept
        h, depth = blocks.h[kept], blocks.depth[kept]
        labels, prev = ids.gather(1, blocks.where)[kept], ids.gather(1, blocks.where - 1)[kept]
        unary = self.draft_logits(h)
        total, metrics = self.decayed_loss(unary, labels, depth)
        selector, metrics_selector = self.selector_loss(unary, h, prev, labels, depth)
        metrics.update(metrics_selector)
        return total + self.spec.selector_loss_weight * selector, metrics

    def selector_loss(self, unary, h, prev, labels, depth):
        """The depth-weighted cross-entropy of the selector's scores over each slot's candidates
        against its label, over the slots whose candidates hold it; and its metrics."""
        candidates, scores = self.rerank(unary, h, prev)
        hit = candidates == labels[:, None]  # one-hot where the label is a candidate, else all false
        covered = hit.any(-1)
        ce = -(torch.log_softmax(scores, dim=-1) * hit).sum(-1)
        weight = self.depth_weight(depth) * covered
        loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
        n = max(len(labels), 1)
        drafted = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
        return loss, {
            "selector_loss": loss.item(),
            "selector_coverage": covered.sum().item() / n,  # the label among the top-k
            "selector_acc": (drafted == labels).sum().item() / n,  # the reranked draft is the label
        }


class SelectorBlock(ChainedBlock):
    """One drafted block for MarkovBlockDrafter: the final-normed states [D, H] of its drafting
    slots (depths 1..D) and their unary logits, reranked after each node's token as the tree grows."""

    def __init__(self, head: DFlash2Head, h: torch.Tensor):
        self.head = head
        self.h = h
        self.unary = head.draft_logits(h)

    def rerank(self, depths: list[int], prev: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates [n, k] at each depth (1..D) and their scores [n, k] after each previous token."""
        at = torch.tensor(depths, device=self.h.device) - 1
        return self.head.rerank(self.unary[at], self.h[at], torch.tensor(prev, device=self.h.device))

    def logits(self, depths: list[int], prev: list[int]) -> torch.Tensor:
        """[n, V]: the draft logits at each depth after each previous token (-inf off the candidates)."""
        at = torch.tensor(depths, device=self.h.device) - 1
        return self.head.reranked_logits(self.unary[at], self.h[at], torch.tensor(prev, device=self.h.device))

    def stop_depth(self, root: int) -> int:
        """The deepest depth to draft: the whole block (DFlash2 has no confidence stop)."""
        return len(self.h)
