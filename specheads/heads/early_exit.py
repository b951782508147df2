"""Early exit (Kangaroo, Liu et al. 2024): the target's own first L layers draft.

The draft of the token after position t is the target's residual stream leaving its first L decoder
layers at t (layer id L in our convention: the stream entering layer L), through a trained adapter
(one decoder layer: attention over the earlier positions' layer-L states, no MLP unless
head.adapter_mlp) and a norm, read by the target's own frozen LM head. Only the adapter and the
norm train; L is head.exit_layer.

Training reads the target's layer-L states of the true sequence (online or from a feature cache)
and fits the adapter's next-token distribution to the target's own (soft cross-entropy). Those
states are exactly what drafting computes along a path: a drafted node's layer-L state is the
target's first L layers run over it, on the target's own KV cache of the committed prefix
(decode/target_layers.py, decode/drafters.EarlyExitDrafter), so teacher forcing here is exact,
not an approximation of the draft's own outputs as for EAGLE.

With head.draft_vocab the draft reads only the LM head's rows of the draft_vocab_size most frequent
answer tokens of the training data (EAGLE-3's reduced vocabulary): on a small target the full LM head
is much of a drafted level's cost (a fifth of SmolLM2-135M's weights). The loss stays the full
distribution's; a target token outside the draft vocabulary is never drafted.

A fresh adapter is the identity (its output projections start at zero) and its norm starts as the
target's final norm: an untrained head drafts the target's own logit lens at layer L, and with
L = every layer, the target's own next token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..target import FrozenTarget, TargetInfo
from .base import DraftHead, chain_metrics, document_causal_mask, positions, shifted, within
from .layers import DraftCache, DraftDecoderLayer, Rotary, draft_llama_config
from .spec import HeadSpec
from .vocab import DraftVocabulary


class EarlyExitHead(DraftVocabulary, DraftHead):
    family = "early_exit"
    vocab_from_data = True  # its draft vocabulary picks rows of the target's own LM head
    title = "early-exit (Kangaroo)"
    # a drafted node runs the target's first exit_layer layers, then the adapter (decode.drafters.EarlyExitDrafter)
    draft_kind = "early_exit"
    # a chain: every drafted level costs exit_layer target layers; a path stops where the head's
    # confidence falls below tree.min_path_prob (Kangaroo's early-exit threshold)
    fallback_tree = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h, eps = info.hidden_size, info.rms_norm_eps
        self.llama_config = draft_llama_config(info, spec.intermediate_size)
        self.input_norm = LlamaRMSNorm(h, eps=eps)
        self.layer = DraftDecoderLayer(self.llama_config, h, mlp=spec.adapter_mlp)
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.rotary = Rotary(self.llama_config)
        if spec.draft_vocab_size < info.vocab_size:
            self.register_vocab(spec.draft_vocab_size, info.vocab_size)
        # outside the module tree, as the frozen parts: the target whose first layers draft, and
        # the LM head's rows of the draft vocabulary (copied once: slicing them per level costs)
        self.__dict__["_target"] = None
        self.__dict__["_rows"] = (None, None)
        # the adapter starts as the identity: what it adds to the residual stream starts at zero
        nn.init.zeros_(self.layer.self_attn.o_proj.weight)
        if self.layer.mlp is not None:
            nn.init.zeros_(self.layer.mlp.down_proj.weight)

    def attach(self, target: FrozenTarget) -> EarlyExitHead:
        super().attach(target)
        self.__dict__["_target"] = target
        return self

    @property
    def frozen_target(self) -> FrozenTarget:
        """The target the head drafts with (its first exit_layer layers run for every drafted node)."""
        if self._target is None:
            raise RuntimeError("head is not attached to a target; call head.attach(target)")
        return self._target

    @property
    def exit_layer(self) -> int:
        return int(self.spec.exit_layer)

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        adapter = "an attention + MLP adapter layer" if spec.adapter_mlp else "an attention-only adapter layer"
        return (
            f"an early-exit draft (Kangaroo): the target's first {spec.exit_layer} of {info.num_layers} layers "
            f"and {adapter}, read by the target's LM head"
        )

    def target_layer_ids(self) -> list[int]:
        return [self.exit_layer]

    def init_from_target(self) -> None:
        """The adapter's norm starts as the target's final norm, which the LM head was trained behind."""
        norm_w = getattr(self.frozen.final_norm, "weight", None)
        if norm_w is not None and norm_w.shape == self.norm.weight.shape:
            with torch.no_grad():
                self.norm.weight.copy_(norm_w.to(self.norm.weight.dtype))

    # -- the adapter ------------------------------------------------------------------------------
    def new_cache(self) -> DraftCache:
        return DraftCache(1)

    def adapt(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The adapter over layer-L states [B, T, H] at their positions (appended to `cache` when
        given; mask: bool [B or 1, 1, T, cached + T], None = causal). Returns its output [B, T, H]."""
        h = hidden.to(self.dtype)
        cos, sin = self.rotary(h, position_ids)
        return self.layer(self.input_norm(h), h, cos, sin, cache, 0, attention_mask)

    def full_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits [.., V] (float) of the token after each position, through the target's LM head."""
        lm_head = self.frozen.lm_head
        return lm_head(self.norm(out).to(lm_head.weight.dtype)).float()

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """What drafting ranks: full_logits, or only the draft vocabulary's [.., Vd] (draft ids)."""
        if not self.has_draft_vocab:
            return self.full_logits(out)
        weight = self.frozen.lm_head.weight
        key, rows = self._rows
        # the cached rows follow the maps (a load rewrites d2t in place) and the LM head's storage
        now = (self.d2t.data_ptr(), self.d2t._version, weight.data_ptr(), weight.dtype)
        if key != now:
            rows = weight.detach()[self.draft_to_target(torch.arange(self.d2t.numel(), device=weight.device))]
            self.__dict__["_rows"] = (now, rows)
        return F.linear(self.norm(out).to(rows.dtype), rows).float()

    def adapted(self, batch: dict[str, torch.Tensor], states) -> torch.Tensor:
        """The adapter's output at every position of a (packed or unpacked) training batch: position t
        drafts token t + 1 from the layer-L states of positions 0..t of its own conversation."""
        mask = document_causal_mask(batch)  # None unpacked: causal over the row
        return self.adapt(states[self.exit_layer], positions(batch), None, mask)

    def teacher_forced_logits(self, input_ids, states, depth):
        # along the true sequence the drafted node at depth d is the token after position t + d, whose
        # layer-L state is the true one: depth d is the adapter's logits d positions on
        logits = self.draft_logits(self.adapted({"input_ids": input_ids}, states))
        return [shifted(logits, d) for d in range(1, depth + 1)]

    # -- training -----------------------------------------------------------------------------------
    def _counted(self, batch: dict[str, torch.Tensor], j: int) -> torch.Tensor:
        """Positions t whose depth-j draft (token t+1+j) exists in t's conversation and is an
        assistant token."""
        return shifted(batch["loss_mask"].bool(), 1 + j, False) & within(batch, 1 + j)

    def loss(self, batch, states):
        mask = self._counted(batch, 0)
        n = mask.sum().clamp(min=1)
        # only the counted positions reach the LM head: on a small target its full-vocabulary
        # logits, their softmaxes and their backward cost more than the target's forward, and a
        # batch's prompts and padding are a large share of its positions
        out = self.adapted(batch, states)[mask]  # the adapter itself attends over every position
        target_p = torch.softmax(self.target_logits(states["final"][mask]), dim=-1)  # position t: token t+1
        logq = torch.log_softmax(self.full_logits(out), dim=-1)
        loss = -(target_p * logq).sum() / n
        acc = (logq.argmax(-1) == target_p.argmax(-1)).sum() / n
        return loss, {"loss_0": loss.item(), "acc_0": acc.item()}

    @torch.no_grad()
    def evaluate(self, batch, states):
        greedy = self.target_logits(states["final"]).argmax(-1)  # greedy[t] = token t+1
        hit = self.draft_to_target(self.draft_logits(self.adapted(batch, states)).argmax(-1)) == greedy
        hits = [shifted(hit, j, False) for j in range(self.spec.eval_depth)]
        counted = [self._counted(batch, j) for j in range(self.spec.eval_depth)]
        return chain_metrics(torch.stack(hits).flatten(1), torch.stack(counted).flatten(1))
