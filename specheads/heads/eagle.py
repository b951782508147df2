"""EAGLE-1, and the autoregressive-drafter machinery it shares with EAGLE-3.

Token shift: the draft input at position t is (feature of target position t, token t+1) and its
output predicts token t+2. The output is fed back as the next step's feature.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..target import TargetInfo
from .base import DraftHead, chain_metrics, document_causal_mask, positions, shifted, within
from .layers import DraftCache, DraftDecoderLayer, Rotary, draft_llama_config
from .spec import HeadSpec


class AutoregressiveHead(DraftHead):
    """A draft decoder that runs step by step with its own KV cache (EAGLE-1 and EAGLE-3)."""

    attention_input_factor = 1  # width of layer 0's attention input, in units of hidden size
    draft_kind = "autoregressive"

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        self.llama_config = draft_llama_config(info, spec.intermediate_size)
        h = info.hidden_size
        self.layers = nn.ModuleList(
            DraftDecoderLayer(self.llama_config, h * (self.attention_input_factor if i == 0 else 1))
            for i in range(spec.num_decoder_layers)
        )
        # layers after the first are plain pre-norm Llama layers
        self.extra_input_norms = nn.ModuleList(
            LlamaRMSNorm(h, eps=info.rms_norm_eps) for _ in range(spec.num_decoder_layers - 1)
        )
        self.rotary = Rotary(self.llama_config)

    # -- family-specific pieces ------------------------------------------------------------
    def fuse(self, emb: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The residual stream entering layer 0."""
        raise NotImplementedError

    def first_layer_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def input_features(self, states: dict[Any, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    # -- one pass through the decoder layers ----------------------------------------------------
    def first_layer_residual(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream layer 0 adds its attention to: the fused state itself."""
        return h

    def fed_back(self, h: torch.Tensor) -> torch.Tensor:
        """What a draft step passes to the next one as its feature: its last layer's output."""
        return h

    def _layer_inputs(self, i: int, emb: torch.Tensor, h: torch.Tensor):
        if i == 0:
            return self.first_layer_input(emb, h), self.first_layer_residual(h)
        return self.extra_input_norms[i - 1](h), h

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def draft_step(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | None,
        attention_mask: torch.Tensor | None = None,
    ):
        """Run T new draft positions; returns (the feature each feeds back [B,T,H], draft logits
        [B,T,Vd])."""
        emb = self.embed(input_ids)
        h = self.fuse(emb, features.to(self.dtype))
        cos, sin = self.rotary(h, position_ids)
        for i, layer in enumerate(self.layers):
            x, residual = self._layer_inputs(i, emb, h)
            h = layer(x, residual, cos, sin, cache, i, attention_mask)
        return self.fed_back(h), self.draft_logits(h)

    def unrolled(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test: `steps` chained draft steps at every position at once.

        Step j at position t reads token t+1+j and its own step j-1 output, sits at RoPE position
        t+j, and attends to the step-0 keys 0..t plus its own chain, as a depth-j draft does. A
        packed row passes its position_ids and document mask (heads.base.document_causal_mask):
        positions restart, and the step-0 keys seen are those of the query's own conversation.
        """
        b, t = input_ids.shape
        positions = position_ids
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
        context: list[tuple | None] = [None] * len(self.layers)
        chains: list[list] = [[] for _ in self.layers]
        outputs, feat = [], features.to(self.dtype)
        for j in range(steps):
            emb = self.embed(shifted(input_ids, 1 + j))
            h = self.fuse(emb, feat)
            cos, sin = self.rotary(h, positions + j)
            for i, layer in enumerate(self.layers):
                x, residual = self._layer_inputs(i, emb, h)
                h, kv = layer.forward_unrolled(x, residual, cos, sin, context[i], chains[i], mask)
                if j == 0:
                    context[i] = kv
                else:
                    chains[i].append(kv)
            outputs.append(h)
            feat = self.fed_back(h)
        return outputs

    def teacher_forced_logits(self, input_ids, states, depth):
        outs = self.unrolled(input_ids, self.input_features(states), depth)  # step j at t predicts t+2+j
        return [self.draft_logits(h).float() for h in outs]

    # -- evaluation shared by both families ----------------------------------------------------
    def _counted(self, batch: dict[str, torch.Tensor], j: int) -> torch.Tensor:
        """Positions t whose step-j prediction (token t+2+j) exists in t's conversation and is an
        assistant token."""
        return shifted(batch["loss_mask"].bool(), 2 + j, False) & within(batch, 2 + j)

    def unrolled_batch(self, batch: dict[str, torch.Tensor], features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """`unrolled` over a batch, packed or not."""
        if "document" not in batch:
            return self.unrolled(batch["input_ids"], features, steps)
        return self.unrolled(batch["input_ids"], features, steps, positions(batch), document_causal_mask(batch))

    @torch.no_grad()
    def evaluate(self, batch, states):
        greedy = self.target_logits(states["final"]).argmax(-1)  # greedy[t] = token t+1
        outs = self.unrolled_batch(batch, self.input_features(states), self.spec.eval_depth)
        hits, counted = [], []
        for j, h in enumerate(outs):
            pred = self.draft_to_target(self.draft_logits(h).argmax(-1))
            hits.append(pred == shifted(greedy, 1 + j))
            counted.append(self._counted(batch, j))
        return chain_metrics(torch.stack(hits).flatten(1), torch.stack(counted).flatten(1))


class EagleHead(AutoregressiveHead):
    """EAGLE-1: fc(embedding, feature) -> one decoder layer -> the target's frozen LM head.

    The feature is the target's post-norm final state; the draft regresses the next feature.
    """

    family = "eagle"
    reads_final_state = True
    title = "EAGLE-1"

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h = info.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        return f"an EAGLE-1 draft ({spec.num_decoder_layers} decoder layer) on the target's final state"

    def input_features(self, states):
        return states["final"]

    def fuse(self, emb, features):
        return self.fc(torch.cat([emb, features], dim=-1))

    def first_layer_input(self, emb, h):
        # the fused input is built from an already normalised feature: no input norm
        return h

    def draft_logits(self, h):
        lm_head = self.frozen.lm_head
        return lm_head(h.to(lm_head.weight.dtype)).float()

    def _noisy(self, features: torch.Tensor) -> torch.Tensor:
        if not self.training or self.spec.noise == "none" or self.spec.noise_std == 0:
            return features
        if self.spec.noise == "uniform":
            return features + (torch.rand_like(features) - 0.5) * self.spec.noise_std
        return features + torch.randn_like(features) * self.spec.noise_std

    def loss(self, batch, states):
        final = states["final"]
        features = self._noisy(final.to(self.dtype))
        pred = self.unrolled_batch(batch, features, 1)[0]  # predicts final[t + 1]
        target_feat = shifted(final, 1).to(pred.dtype)
        mask = self._counted(batch, 0)
        n = mask.sum().clamp(min=1)
        m = mask.unsqueeze(-1).to(pred.dtype)
        feature_loss = (F.smooth_l1_loss(pred, target_feat, reduction="none").mean(-1, keepdim=True) * m).sum() / n
        target_p = torch.softmax(self.target_logits(target_feat), dim=-1)
        logp = torch.log_softmax(self.draft_logits(pred), dim=-1)
        token_loss = -((target_p * logp).sum(-1) * mask).sum() / n
        loss = self.spec.feature_loss_weight * feature_loss + self.spec.token_loss_weight * token_loss
        acc = ((logp.argmax(-1) == target_p.argmax(-1)) & mask).sum() / n
        return loss, {"feature_loss": feature_loss.item(), "token_loss": token_loss.item(), "acc_0": acc.item()}
