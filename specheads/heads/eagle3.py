"""EAGLE-3: fused low/mid/high target states, a 2H-input draft layer, its own reduced-vocab LM head,
trained with the training-time test (the draft unrolled over its own outputs)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..target import TargetInfo
from .eagle import AutoregressiveHead
from .objectives import position_loss
from .spec import HeadSpec
from .vocab import DraftVocabulary


class Eagle3Head(DraftVocabulary, AutoregressiveHead):
    family = "eagle3"
    title = "EAGLE-3"
    attention_input_factor = 2  # cat(norm(embedding), norm(hidden))

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        h, eps = info.hidden_size, info.rms_norm_eps
        self.fc = nn.Linear(len(spec.layer_ids) * h, h, bias=spec.fc_bias)
        # speculators' input_norm (norm_before_fc): one RMSNorm over the concatenated target states
        self.fc_input_norm = LlamaRMSNorm(len(spec.layer_ids) * h, eps=eps) if spec.norm_before_fc else None
        self.input_norm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(not spec.freeze_lm_head)  # the optimizer takes trainable ones only
        self.register_vocab(spec.draft_vocab_size, info.vocab_size)

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        return (
            f"an EAGLE-3 draft ({spec.num_decoder_layers} decoder layer) fusing target layers "
            f"{layer_ids} (residual stream entering layer k), draft vocabulary "
            f"{spec.draft_vocab_size} of {info.vocab_size}"
        )

    def init_from_target(self) -> None:
        """Start the draft LM head and final norm from the target's rows for the draft vocab.

        The draft head reads norm(h) as the target's LM head reads its final norm, so the target's
        own rows are a far better start than random ones (fewer CPU steps to a useful head).
        """
        with torch.no_grad():
            ids = self.draft_to_target(torch.arange(self.spec.draft_vocab_size, device=self.d2t.device))
            w = self.frozen.lm_head.weight
            self.lm_head.weight.copy_(w[ids.to(w.device)].to(self.lm_head.weight.dtype))
            norm_w = getattr(self.frozen.final_norm, "weight", None)
            if norm_w is not None and norm_w.shape == self.norm.weight.shape:
                self.norm.weight.copy_(norm_w.to(self.norm.weight.dtype))

    def input_features(self, states):
        return self.fuse_states(torch.cat([states[k].to(self.dtype) for k in self.spec.layer_ids], dim=-1))

    def fuse_states(self, fused: torch.Tensor) -> torch.Tensor:
        """[.., n_layers x H] concatenated target states -> the draft's [.., H] feature."""
        return self.fc(fused if self.fc_input_norm is None else self.fc_input_norm(fused))

    def first_layer_residual(self, h):
        return self.hidden_norm(h) if self.spec.norm_before_residual else h

    def fed_back(self, h):
        return self.norm(h) if self.spec.norm_output else h

    def fuse(self, emb, features):
        return features

    def first_layer_input(self, emb, h):
        return torch.cat([self.input_norm(emb), self.hidden_norm(h)], dim=-1)

    def draft_logits(self, h):
        return self.lm_head(self.norm(h)).float()

    def loss(self, batch, states):
        steps = self.spec.ttt_steps
        counted = [self._counted(batch, j) for j in range(steps)]
        # step j at position t predicts token t+2+j, whose target distribution sits at t+1+j: the
        # target's full-vocabulary logits are read at those positions only, once each (on a small
        # target they cost more than the draft itself, and a batch is largely prompts and padding)
        where, needed = [], torch.zeros_like(counted[0])
        for j, m in enumerate(counted):
            b, t = m.nonzero(as_tuple=True)
            where.append((b, t + 1 + j))
            needed[b, t + 1 + j] = True
        row = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
        row[needed] = torch.arange(int(needed.sum()), device=needed.device)
        target_logits = self.target_logits(states["final"][needed])  # [N, V]
        outs = self.unrolled_batch(batch, self.input_features(states), steps)
        total = target_logits.new_zeros(())
        metrics = {}
        for j, (h, m, (b, t)) in enumerate(zip(outs, counted, where)):
            loss_j, acc = self.step_loss(h[m], target_logits[row[b, t]])
            total = total + self.spec.ttt_decay**j * loss_j
            metrics[f"loss_{j}"] = loss_j.item()
            metrics[f"acc_{j}"] = acc.item()
        return total, metrics

    def step_loss(self, h: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, top-1 accuracy) of draft outputs h [N, H] against the target's full-vocabulary
        logits [N, V] at the same states: head.loss_fn between the target's distribution over the
        draft vocabulary and the draft's, averaged over the positions head.loss_positions counts.
        One unrolled step of `loss`, and what the on-policy stage (train/on_policy.py) trains on."""
        keep = self.t2d[target_logits.argmax(-1)]  # a top token outside the draft vocabulary can't be drafted
        keep = keep | (self.spec.loss_positions == "all")
        n = keep.sum().clamp(min=1)
        p = torch.softmax(target_logits[:, self.t2d], dim=-1)
        logq = torch.log_softmax(self.draft_logits(h), dim=-1)
        per_position = position_loss(self.spec.loss_fn, p, logq, self.spec.lk_eta)
        loss = (per_position * keep).sum() / n
        acc = ((logq.argmax(-1) == p.argmax(-1)) & keep).sum() / n
        return loss, acc
