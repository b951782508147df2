"""DFlash (arXiv 2602.06036, z-lab): a small non-causal decoder that fills a whole block of drafts
in ONE forward, conditioned on the target through its keys and values.

Anchor t is the last position whose target features are known. Its block is block_size slots at
positions t+1, t+2, ...: slot 0 holds token t+1 (at inference the target's bonus token), the others
the mask token (heads/mask_token.py); slot k >= 1 predicts token t+1+k. Queries come from the block
only. Every layer attends to
  - the context: the target's states at positions 0..t (layer_ids, our numbering), fused once by
    hidden_norm(fc(cat(...))) and projected by THAT layer's k_proj / v_proj (then k_norm and RoPE at
    the context position); the fused context never runs through the layers ("KV injection");
  - every slot of its own block, both ways (non-causal).
The layers are Qwen3's (pre-norm RMSNorm, per-head q/k RMSNorm, RoPE, GQA, SwiGLU) whatever the
target; the target's embedding and LM head are shared and frozen, so the head stores neither (vLLM
shares the target's when a draft checkpoint has none).

k_norm is ONE parameter for every layer: vLLM 0.32's CPU build normalises all layers' context keys
with layer 0's k_norm (tests/engines/test_vllm_cpu_ops.py), so only a tied head is served there as
it was trained. Exports write one identical copy per layer.

Training draws random anchors per sequence (from the global RNG, which the trainer seeds; a new
draw every step), runs all their blocks in one forward under `block_attention_mask`, and weighs the
cross-entropy on the data's token at slot k by exp(-(k-1)/gamma).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, rotate_half

from ..target import FrozenTarget, TargetInfo
from .base import DraftHead, chain_metrics, documents, positions, shifted, within
from .layers import DraftAttention, DraftCache, Rotary, draft_llama_config
from .mask_token import resolve_mask_token_id
from .medusa import MedusaHead
from .spec import HeadSpec

# anchors per forward of teacher_forced_logits (evaluation, calibration): bounds its attention scores
TEACHER_FORCED_CHUNK = 96


def block_attention_mask(
    ctx_doc: torch.Tensor, elem_doc: torch.Tensor, elem_anchor: torch.Tensor, elem_block: torch.Tensor
) -> torch.Tensor:
    """Bool [..., N, T + N]: whether block element i may attend to context position p (the first T
    keys) or to block element j (the last N keys).

    ctx_doc [..., T]: the document of each context position (< 0: padding). elem_doc, elem_anchor,
    elem_block [..., N]: each element's document (< 0: a padding element, which sees only itself),
    anchor and block. An element sees its own document's positions up to and including its anchor,
    and every element of its own block: never another document, another block, or a position after
    its anchor (which at inference is not verified yet)."""
    real = elem_doc[..., :, None] >= 0
    positions = torch.arange(ctx_doc.shape[-1], device=ctx_doc.device)
    context = real & (ctx_doc[..., None, :] == elem_doc[..., :, None]) & (positions <= elem_anchor[..., :, None])
    block = real & (elem_block[..., :, None] == elem_block[..., None, :])
    eye = torch.eye(elem_doc.shape[-1], dtype=torch.bool, device=elem_doc.device)
    return torch.cat([context, block | eye], dim=-1)


def sample_block_anchors(candidates: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """Up to n distinct anchors, in order, drawn uniformly from the positions where candidates [T] is true."""
    where = candidates.nonzero().flatten()
    if len(where) <= n:
        return where
    pick = torch.randperm(len(where), generator=generator, device="cpu")[:n].to(where.device)
    return where[pick].sort().values


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (transformers' rotate-half layout, vLLM's is_neox_style) on [B, heads, S, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(DraftAttention):
    """DraftAttention's projections and SDPA, with Qwen3's per-head q_norm; k_norm is the head's
    shared one, passed in."""

    def __init__(self, config):
        super().__init__(config, config.hidden_size)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim)

    def context_kv(self, ctx, k_norm, cos, sin):
        """Keys and values [B, kv_heads, C, head_dim] of the fused context (already hidden_norm'ed)."""
        k = k_norm(self.heads(self.k_proj(ctx), self.num_kv_heads)).transpose(1, 2)
        v = self.heads(self.v_proj(ctx), self.num_kv_heads).transpose(1, 2)
        return rope(k, cos, sin), v

    def block_qkv(self, x, k_norm, cos, sin):
        q = self.q_norm(self.heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        k = k_norm(self.heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self.heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return rope(q, cos, sin), rope(k, cos, sin), v


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose keys and values start with the injected context's."""

    def __init__(self, config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, context: tuple[torch.Tensor, torch.Tensor], k_norm, cos, sin, mask):
        h = h + self.attention(self.input_layernorm(h), context, k_norm, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def attention(self, x, context: tuple[torch.Tensor, torch.Tensor], k_norm, cos, sin, mask):
        """The attention sublayer's output for the normed block states x: its queries over the
        context's keys and values, then the block's."""
        attn = self.self_attn
        q, k, v = attn.block_qkv(x, k_norm, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        return attn.output(attn.attend(q, k, v, mask))


@dataclass
class TrainingBlocks:
    """The blocks of one training forward (packed_hidden), [B, N] per element: its final-normed state
    h [B, N, H], its anchor, the depth it drafts (1: the token after the bonus token; < 1: a slot
    that drafts nothing), where the token it drafts sits, whether that token is in the element's own
    document (`inside`) and whether the loss counts it (`kept`: inside and an assistant token)."""

    h: torch.Tensor
    anchor: torch.Tensor
    depth: torch.Tensor
    where: torch.Tensor
    inside: torch.Tensor
    kept: torch.Tensor


class DFlashHead(DraftHead):
    family = "dflash"
    title = "DFlash"
    draft_kind = "parallel_decoder"  # every depth in one draft forward: ParallelDecoderDrafter
    # the block's distributions do not depend on the drafted tokens: Medusa's tree suits them
    fallback_tree = MedusaHead.fallback_tree

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        config = draft_llama_config(info, spec.intermediate_size)
        h, eps = info.hidden_size, info.rms_norm_eps
        self.fc = nn.Linear(len(spec.layer_ids) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.k_norm = LlamaRMSNorm(info.head_dim, eps=eps)  # tied across layers (module docstring)
        self.layers = nn.ModuleList(self.new_layer(config) for _ in range(spec.dflash_layers))
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.rotary = Rotary(config)

    def new_layer(self, config) -> DFlashLayer:
        """One decoder layer of the draft (DFlash2 wraps its sublayers in convolutions)."""
        return DFlashLayer(config)

    @classmethod
    def prepare_spec(cls, spec: HeadSpec, target: FrozenTarget) -> None:
        spec.mask_token_id = resolve_mask_token_id(target.tokenizer, target.info.vocab_size, spec.mask_token_id)

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        return (
            f"a DFlash draft ({spec.dflash_layers} non-causal decoder layers, blocks of {spec.block_size}: up to "
            f"{spec.block_size - 1} drafts per forward) with target layers {layer_ids} (residual stream entering "
            f"layer k) injected into every layer's keys and values, the target's embedding and LM head shared"
        )

    @classmethod
    def draft_slot0(cls, spec: HeadSpec) -> int:
        """The block slot that drafts depth 1 (the token after the bonus token, which slot 0 holds);
        slot k drafts depth k - draft_slot0 + 1."""
        return 1

    @classmethod
    def max_draft_depth(cls, spec: HeadSpec) -> int | None:
        return spec.block_size - cls.draft_slot0(spec)

    def init_from_target(self) -> None:
        """The draft's final norm feeds the target's LM head as the target's final norm does: start from it."""
        w = getattr(self.frozen.final_norm, "weight", None)
        if w is not None and w.shape == self.norm.weight.shape:
            with torch.no_grad():
                self.norm.weight.copy_(w.to(self.norm.weight.device, self.norm.weight.dtype))

    def input_features(self, states) -> torch.Tensor:
        """fc(cat(states)) [B, T, H]: what vLLM's combine_hidden_states computes (hidden_norm comes later)."""
        return self.fc(torch.cat([states[k].to(self.dtype) for k in self.spec.layer_ids], dim=-1))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target_logits(h)  # the target's LM head over the draft's final-normed state

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The draft logits [..., V] of drafting slots with final-normed states h [..., H]; prev [...]:
        the token before the one each drafts, which DFlash's independent slots do not read."""
        return self.draft_logits(h)

    def new_cache(self) -> DraftCache:
        """The context keys and values of each layer (never the block's)."""
        return DraftCache(len(self.layers))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ctx = self.hidden_norm(features.to(self.dtype))
        cos, sin = self.rotary(ctx, positions)
        return [layer.self_attn.context_kv(ctx, self.k_norm, cos, sin) for layer in self.layers]

    def block_forward(self, ids, positions, context, mask) -> torch.Tensor:
        """The final-normed draft states [B, N, H] of block elements `ids` at RoPE `positions`, each
        layer's keys and values prefixed with `context` (one (k, v) per layer)."""
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        for layer, kv in zip(self.layers, context):
            h = layer(h, kv, self.k_norm, cos, sin, mask)
        return self.norm(h)

    # -- inference -------------------------------------------------------------------------
    def parallel_logits(self, input_ids, features, cache: DraftCache, positions: int) -> torch.Tensor:
        """Feed the accepted rows into the context cache (block_states), then draft from one block:
        [positions, V] logits."""
        h = self.block_states(input_ids, features, cache)
        return self.draft_logits(h[0, 1 : 1 + max(positions, 1)])

    def block_states(self, input_ids, features, cache: DraftCache) -> torch.Tensor:
        """Feed the accepted rows (fused features [1, n, H] of the next n context positions, and
        input_ids [1, n]: the token after each, the last one the target's bonus token) into the
        context cache, then run one block after them: its final-normed states [1, block_size, H].

        The block always has the trained block_size slots: inside it attention goes both ways, so a
        shorter block would change every draft; a shallower tree takes the first rows."""
        start, n = cache.length, input_ids.shape[1]
        device = input_ids.device
        pos = torch.arange(start, start + n, device=device)[None]
        context = []
        for i, (k, v) in enumerate(self.context_kv(features, pos)):
            context.append(cache.append(i, k, v))
        b = self.spec.block_size
        ids = torch.cat([input_ids[:, -1:], input_ids.new_full((1, b - 1), self.spec.mask_token_id)], dim=1)
        return self.block_forward(ids, torch.arange(start + n, start + n + b, device=device)[None], context, None)

    # -- training --------------------------------------------------------------------------
    def packed_hidden(
        self, input_ids, features, anchors: list[torch.Tensor], doc0: torch.Tensor, pos0: torch.Tensor | None = None
    ):
        """All blocks of each row in one forward: the final-normed states [B, N, H] of the N = A x
        block_size elements (A: the most anchors of a row; shorter rows padded with padding blocks),
        and each element's anchor, slot and document [B, N] (document < 0: padding).

        anchors[r]: row r's anchors; doc0 [B, T]: the document of each position (< 0: padding);
        pos0 [B, T]: its position in its document (None: positions 0, 1, ... of the row): context
        position p sits at RoPE position pos0[p], slot k of anchor t at pos0[t] + 1 + k."""
        b, t = input_ids.shape
        size, device = self.spec.block_size, input_ids.device
        a = max(1, max(len(x) for x in anchors))
        anchor = torch.zeros(b, a, dtype=torch.long, device=device)
        real = torch.zeros(b, a, dtype=torch.bool, device=device)
        for r, x in enumerate(anchors):
            anchor[r, : len(x)], real[r, : len(x)] = x, True
        anchor, real = anchor.repeat_interleave(size, dim=1), real.repeat_interleave(size, dim=1)
        slot = torch.arange(size, device=device).repeat(a).expand(b, -1)
        block = torch.arange(a, device=device).repeat_interleave(size).expand(b, -1)
        doc = torch.where(real, doc0.gather(1, anchor), -1)
        first = shifted(input_ids, 1).gather(1, anchor)  # token anchor + 1
        ids = torch.where(slot == 0, first, torch.full_like(first, self.spec.mask_token_id))
        if pos0 is None:
            pos0 = torch.arange(t, device=device).expand(b, -1)
        context = self.context_kv(features, pos0)
        mask = block_attention_mask(doc0, doc, anchor, block)[:, None]
        return self.block_forward(ids, pos0.gather(1, anchor) + 1 + slot, context, mask), anchor, slot, doc

    def training_blocks(self, batch, states) -> TrainingBlocks:
        """Draw this step's anchors and run all their blocks in one forward (packed_hidden)."""
        input_ids = batch["input_ids"]
        t = input_ids.shape[1]
        doc0 = documents(batch)
        counted = (doc0 >= 0) & batch["loss_mask"].bool()
        # anchor t: token t+1 of its conversation exists (slot 0) and the first draft's token t+2 counts
        candidates = within(batch, 1) & within(batch, 2) & shifted(counted, 2, False)
        # drawn from the global RNG, which the trainer seeds: anchors_per_sequence per conversation,
        # so a packed row draws for each of its conversations what it would draw alone
        anchors = [
            torch.cat(
                [
                    sample_block_anchors(candidates[r] & (doc0[r] == d), self.spec.anchors_per_sequence, None)
                    for d in range(max(int(doc0[r].max()) + 1, 1))
                ]
            )
            for r in range(len(input_ids))
        ]
        h, anchor, slot, doc = self.packed_hidden(
            input_ids, self.input_features(states), anchors, doc0, positions(batch)
        )
        depth = slot - self.draft_slot0(self.spec) + 1
        where = (anchor + 1 + depth).clamp(max=t - 1)  # depth d drafts token anchor + 1 + d
        inside = (depth >= 1) & (doc >= 0) & (anchor + 1 + depth < t) & (doc0.gather(1, where) == doc)
        return TrainingBlocks(h, anchor, depth, where, inside, inside & counted.gather(1, where))

    def loss(self, batch, states):
        blocks = self.training_blocks(batch, states)
        input_ids, kept = batch["input_ids"], blocks.kept
        labels = input_ids.gather(1, blocks.where)[kept]
        logits = self.slot_logits(blocks.h[kept], input_ids.gather(1, blocks.where - 1)[kept])
        return self.decayed_loss(logits, labels, blocks.depth[kept])

    def depth_weight(self, depth: torch.Tensor) -> torch.Tensor:
        """The loss weight of a draft at depth d (1, 2, ...): exp(-(d - 1) / gamma)."""
        return torch.exp(-(depth - 1).float() / self.spec.dflash_gamma)

    def decayed_loss(self, logits, labels, depth):
        """The cross-entropy of drafts at depths `depth` (1, 2, ...) weighted exp(-(depth - 1) / gamma),
        and per-depth metrics."""
        ce = F.cross_entropy(logits, labels, reduction="none")
        weight = self.depth_weight(depth)
        total = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
        hit = logits.argmax(-1) == labels
        metrics = {}
        for d in range(self.max_draft_depth(self.spec)):
            at = depth == d + 1
            n = at.sum().clamp(min=1)
            metrics[f"loss_{d}"] = ((ce * at).sum() / n).item()
            metrics[f"acc_{d}"] = ((hit & at).sum() / n).item()
        return total, metrics

    def teacher_forced_logits(self, input_ids, states, depth, doc0=None, pos0=None):
        """Every position an anchor (in chunks): [B, T, V] per depth 1..depth; at depth d position t
        holds the slot drafting depth d of the block anchored at t, the draft for token t+1+d (the
        token before it, which a DSpark slot reads, taken from the sequence). doc0, pos0 [B, T]: a
        packed row's documents and positions (None: one document per row)."""
        depth = min(depth, self.max_draft_depth(self.spec))
        slot0 = self.draft_slot0(self.spec)
        b, t = input_ids.shape
        features = self.input_features(states)
        if doc0 is None:
            doc0 = torch.zeros(b, t, dtype=torch.long, device=input_ids.device)
        outs = [None] * depth
        for start in range(0, t, TEACHER_FORCED_CHUNK):
            chunk = torch.arange(start, min(start + TEACHER_FORCED_CHUNK, t), device=input_ids.device)
            h, _, _, _ = self.packed_hidden(input_ids, features, [chunk] * b, doc0, pos0)
            h = h.view(b, len(chunk), self.spec.block_size, -1)
            for d in range(depth):  # depth d + 1 drafts token t+2+d after token t+1+d
                logits = self.slot_logits(h[:, :, slot0 + d], shifted(input_ids, 1 + d)[:, chunk])
                if outs[d] is None:
                    outs[d] = logits.new_empty(b, t, logits.shape[-1])
                outs[d][:, chunk] = logits
        return outs

    @torch.no_grad()
    def evaluate(self, batch, states):
        greedy = self.target_logits(states["final"]).argmax(-1)  # greedy[t] = token t+1
        layout = (documents(batch), positions(batch)) if "document" in batch else (None, None)
        outs = self.teacher_forced_logits(batch["input_ids"], states, self.spec.eval_depth, *layout)
        hits, seen = [], []
        for j, logits in enumerate(outs):  # depth j+1 at position t drafts token t+2+j
            hits.append(logits.argmax(-1) == shifted(greedy, 1 + j))
            seen.append(shifted(batch["loss_mask"].bool(), 2 + j, False) & within(batch, 2 + j))
        return chain_metrics(torch.stack(hits).flatten(1), torch.stack(seen).flatten(1))


class ChainedBlock:
    """A drafted block whose slot logits depend on the token drafted before (DSpark's Markov bias,
    DFlash2's selector): `h` holds its drafting slots' states [D, H] and `logits(depths, prev)` the
    draft logits at each depth after each previous token. chain is the top-1 walk through it (a
    chain is vLLM's greedy walk for both)."""

    h: torch.Tensor

    def logits(self, depths: list[int], prev: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def chain(self, root: int) -> tuple[list[int], torch.Tensor]:
        """The top-1 chain after `root` (the bonus token): its D tokens and their logits [D, V]."""
        tokens, rows = [root], []
        for d in range(1, len(self.h) + 1):
            rows.append(self.logits([d], [tokens[-1]])[0])
            tokens.append(int(rows[-1].argmax()))
        return tokens[1:], torch.stack(rows)
