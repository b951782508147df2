"""P-EAGLE (parallel EAGLE, arXiv 2602.01469): the EAGLE-3 draft filling K positions in ONE forward.

Position 1 reads what an EAGLE-3 draft reads (the last token's embedding and the target's fused
features at the last verified position); positions 2..K read the mask token's embedding and a
learned vector `mask_hidden` that stands in for the target features they cannot have (projected by
the same fc as real features, as vLLM does). Attention stays causal: position k sees the real
context and positions 1..k. The K output distributions do not depend on the drafted tokens, so a
tree drawn from their top-k is a Cartesian product, as Medusa's.

Training packs the depths into one forward (COD sampling): depth 0 is every position with real
inputs, depth d a random max(rate^d, min_rate) share of the positions (nested: an anchor drafted
at depth d is drafted at every shallower depth), each element attending to its document's real
context up to its anchor and to the shallower depths of its own chain (`packed_depth_mask`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..target import FrozenTarget, TargetInfo
from .base import chain_metrics, documents, positions, shifted
from .eagle3 import Eagle3Head
from .mask_token import resolve_mask_token_id
from .medusa import MedusaHead
from .objectives import position_loss
from .spec import HeadSpec


def packed_depth_mask(doc: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Bool [..., N, N]: whether packed element i may attend to element j.

    doc, anchor, depth: [..., N] per element (doc < 0: padding, which sees only itself). Element
    (anchor t, depth d) sees the depth-0 elements of its document at anchors <= t (the real
    context up to its own position) and the elements of its own chain (same anchor) at depths
    1..d; at inference, draft position d+1 sees exactly the real context and positions 1..d+1.
    """
    same_doc = (doc[..., :, None] == doc[..., None, :]) & (doc[..., :, None] >= 0)
    context = (depth[..., None, :] == 0) & (anchor[..., None, :] <= anchor[..., :, None])
    chain = (
        (anchor[..., None, :] == anchor[..., :, None])
        & (depth[..., None, :] >= 1)
        & (depth[..., None, :] <= depth[..., :, None])
    )
    eye = torch.eye(doc.shape[-1], dtype=torch.bool, device=doc.device)
    return (same_doc & (context | chain)) | eye


def sample_anchors(
    counted: torch.Tensor, rate: float, min_rate: float, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """COD sampling for one sequence: counted bool [D, T] (depth d's target at anchor t exists and
    counts); returns the anchors of depths 1..D-1, nested, depth d keeping max(rate^d, min_rate)
    of the positions in expectation. Depth 0 is every position and is not returned."""
    kept = counted[0]
    out = []
    for d in range(1, counted.shape[0]):
        keep = max(rate**d, min_rate) / max(rate ** (d - 1), min_rate)
        draw = torch.rand(kept.shape, generator=generator, device="cpu").to(kept.device) < keep
        kept = kept & counted[d] & draw
        out.append(kept.nonzero().flatten())
    return out


class PEagleHead(Eagle3Head):
    family = "peagle"
    title = "P-EAGLE"
    draft_kind = "parallel_decoder"
    # the K distributions are independent of the drafted tokens: Medusa's tree suits them
    fallback_tree = MedusaHead.fallback_tree
    # an EAGLE-3 head is a P-EAGLE head's first position: train.init_from may start from one
    grows_from = ("eagle3",)
    own_tensors = ("mask_hidden", "embed_tokens")

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h = info.hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(len(spec.layer_ids) * h) * 0.02)
        # the head's own trained copy of the embedding (filled from the target's in init_from_target)
        self.embed_tokens = nn.Embedding(info.vocab_size, h) if spec.train_embeddings else None

    @classmethod
    def prepare_spec(cls, spec: HeadSpec, target: FrozenTarget) -> None:
        spec.mask_token_id = resolve_mask_token_id(target.tokenizer, target.info.vocab_size, spec.mask_token_id)

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        return (
            f"a P-EAGLE draft ({spec.num_decoder_layers} decoder layer, {spec.parallel_depths} positions "
            f"per draft forward) fusing target layers {layer_ids} (residual stream entering layer k), "
            f"draft vocabulary {spec.draft_vocab_size} of {info.vocab_size}"
        )

    @classmethod
    def max_draft_depth(cls, spec: HeadSpec) -> int | None:
        return spec.parallel_depths

    def init_from_target(self) -> None:
        super().init_from_target()
        if self.embed_tokens is not None:
            with torch.no_grad():
                w = self.frozen.embed_tokens.weight
                self.embed_tokens.weight.copy_(w.to(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return super().embed(input_ids)

    def mask_feature(self) -> torch.Tensor:
        """[H]: the fused feature of every position after the first."""
        return self.fuse_states(self.mask_hidden.to(self.dtype))

    # -- inference -------------------------------------------------------------------------
    def parallel_logits(self, input_ids, features, cache, positions: int) -> torch.Tensor:
        """Feed the accepted rows (input_ids [1, n], fused features [1, n, H]) into the draft cache
        and draft `positions` tokens after the last one in the same forward: [positions, Vd] logits.
        The cache keeps the accepted rows only."""
        start, n = cache.length, input_ids.shape[1]
        extra = max(positions, 1) - 1
        ids = torch.cat([input_ids, input_ids.new_full((1, extra), self.spec.mask_token_id)], dim=1)
        feats = torch.cat([features.to(self.dtype), self.mask_feature().expand(1, extra, -1)], dim=1)
        pos = torch.arange(start, start + n + extra, device=input_ids.device)[None]
        _, logits = self.draft_step(ids, feats, pos, cache)
        cache.crop(start + n)
        return logits[0, n - 1 :]

    # -- training --------------------------------------------------------------------------
    def packed_forward(
        self,
        input_ids,
        features,
        anchors: list[list[torch.Tensor]],
        doc0: torch.Tensor,
        pos0: torch.Tensor | None = None,
    ):
        """Draft logits [B, N, Vd] of the packed elements, and their (anchor, depth, doc) [B, N].

        anchors[b][d-1]: the depth-d anchors of row b; depth 0 is every position, doc0 [B, T] its
        document id per position (< 0: padding), pos0 [B, T] its position in its document (None:
        the row is one document, positions 0, 1, ...); element (t, d) sits at RoPE position
        pos0[t] + d. Rows are padded to the longest with padding elements."""
        b, t = input_ids.shape
        device = input_ids.device
        rows = []
        for r in range(b):
            anchor = torch.cat([torch.arange(t, device=device), *anchors[r]])
            depth = torch.cat(
                [torch.zeros(t, dtype=torch.long, device=device)]
                + [torch.full_like(a, d + 1) for d, a in enumerate(anchors[r])]
            )
            rows.append((anchor, depth, doc0[r][anchor]))
        n = max(len(a) for a, _, _ in rows)

        def padded(x, fill):
            return torch.stack([torch.cat([v, v.new_full((n - len(v),), fill)]) for v in x])

        anchor = padded([a for a, _, _ in rows], 0)
        depth = padded([d for _, d, _ in rows], 0)
        doc = padded([c for _, _, c in rows], -1)
        real = depth == 0
        next_tokens = shifted(input_ids, 1).gather(1, anchor)
        ids = torch.where(real, next_tokens, torch.full_like(next_tokens, self.spec.mask_token_id))
        feats = features.to(self.dtype).gather(1, anchor[..., None].expand(-1, -1, features.shape[-1]))
        feats = torch.where(real[..., None], feats, self.mask_feature().expand_as(feats))
        mask = packed_depth_mask(doc, anchor, depth)[:, None]
        where = anchor if pos0 is None else pos0.gather(1, anchor)
        _, logits = self.draft_step(ids, feats, where + depth, None, attention_mask=mask)
        return logits, anchor, depth, doc

    def loss(self, batch, states):
        target_logits = self.target_logits(states["final"])  # [B,T,V]; position t predicts t+1
        in_vocab_logits = target_logits[..., self.t2d]
        in_vocab_top = self.t2d[target_logits.argmax(-1)]
        k = self.spec.parallel_depths
        counted = torch.stack([self._counted(batch, d) for d in range(k)])  # [K, B, T]
        anchors = [  # drawn from the global RNG, which the trainer seeds
            sample_anchors(counted[:, r], self.spec.depth_keep_rate, self.spec.depth_min_rate, None)
            for r in range(counted.shape[1])
        ]
        logits, anchor, depth, doc = self.packed_forward(
            batch["input_ids"], self.input_features(states), anchors, documents(batch), positions(batch)
        )
        t = in_vocab_logits.shape[1]
        # element (t, d) predicts token t+2+d, whose target distribution sits at t+1+d
        where = (anchor + 1 + depth).clamp(max=t - 1)
        p = torch.softmax(in_vocab_logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1])), dim=-1)
        rows = torch.arange(anchor.shape[0], device=anchor.device)[:, None]
        mask = (doc >= 0) & counted[depth, rows, anchor] & in_vocab_top.gather(1, where)
        logq = torch.log_softmax(logits, dim=-1)
        per_element = position_loss(self.spec.loss_fn, p, logq, self.spec.lk_eta)
        hit = logq.argmax(-1) == p.argmax(-1)
        total = logits.new_zeros(())
        metrics = {}
        for d in range(k):
            m = mask & (depth == d)
            n = m.sum().clamp(min=1)
            loss_d = (per_element * m).sum() / n
            total = total + loss_d
            metrics[f"loss_{d}"] = loss_d.item()
            metrics[f"acc_{d}"] = ((hit & m).sum() / n).item()
        return total, metrics

    def teacher_forced_logits(self, input_ids, states, depth, doc0=None, pos0=None):
        """Every position drafted at every depth (no sampling): [B, T, Vd] per depth 1..depth.
        doc0, pos0 [B, T]: a packed row's documents and positions (None: one document per row)."""
        depth = min(depth, self.spec.parallel_depths)
        b, t = input_ids.shape
        every = torch.arange(t, device=input_ids.device)
        anchors = [[every] * (depth - 1) for _ in range(b)]
        if doc0 is None:
            doc0 = torch.zeros(b, t, dtype=torch.long, device=input_ids.device)
        logits, _, _, _ = self.packed_forward(input_ids, self.input_features(states), anchors, doc0, pos0)
        return [logits[:, d * t : (d + 1) * t].float() for d in range(depth)]

    @torch.no_grad()
    def evaluate(self, batch, states):
        greedy = self.target_logits(states["final"]).argmax(-1)  # greedy[t] = token t+1
        layout = (documents(batch), positions(batch)) if "document" in batch else (None, None)
        outs = self.teacher_forced_logits(batch["input_ids"], states, self.spec.eval_depth, *layout)
        hits, counted = [], []
        for j, logits in enumerate(outs):
            pred = self.draft_to_target(logits.argmax(-1))
            hits.append(pred == shifted(greedy, 1 + j))
            counted.append(self._counted(batch, j))
        return chain_metrics(torch.stack(hits).flatten(1), torch.stack(counted).flatten(1))
