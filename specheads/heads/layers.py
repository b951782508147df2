"""The draft decoder layer shared by EAGLE-1 and EAGLE-3, with an explicit KV cache.

Two attention paths over the same weights:
- `forward`: inference; new queries attend to everything cached plus the new keys (causal among
  the new ones, or an explicit tree mask);
- `forward_unrolled`: training-time test; at unrolled step j the query at position t sees the
  step-0 keys 0..t (the real context) and its own chain's keys k_1[t]..k_j[t], which is what the
  query of a depth-j draft token sees at inference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from ..target import TargetInfo


def draft_llama_config(info: TargetInfo, intermediate_size: int) -> LlamaConfig:
    """A one-layer Llama config with the target's width, heads and RoPE."""
    rope = dict(info.rope_parameters) or {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaConfig(
        hidden_size=info.hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        num_hidden_layers=1,
        rms_norm_eps=info.rms_norm_eps,
        max_position_embeddings=info.max_position_embeddings,
        vocab_size=info.vocab_size,
        rope_parameters=rope,
        hidden_act="silu",
    )


class DraftCache:
    """Keys/values per draft layer, [B, kv_heads, S, head_dim], in buffers preallocated with spare
    room and grown by doubling: appending writes in place (no concatenation of the whole cache at
    every draft step), cropping only moves the length, compaction gathers into the front."""

    def __init__(self, num_layers: int, capacity: int = 256):
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    @property
    def length(self) -> int:
        return self.layer_length(0)

    def layer_length(self, layer: int) -> int:
        return self.lengths[layer]

    def _reserve(self, layer: int, like: torch.Tensor, needed: int) -> None:
        buf = self.keys[layer]
        if buf is not None and buf.shape[2] >= needed:
            return
        size = max(self.capacity, needed, 2 * buf.shape[2] if buf is not None else 0)
        b, h, _, d = like.shape
        keys, values = (like.new_empty(b, h, size, d) for _ in range(2))
        n = self.lengths[layer]
        if buf is not None and n:
            keys[:, :, :n] = buf[:, :, :n]
            values[:, :, :n] = self.values[layer][:, :, :n]
        self.keys[layer], self.values[layer] = keys, values

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v after the layer's entries; returns views of all entries so far."""
        start, n = self.lengths[layer], k.shape[2]
        self._reserve(layer, k, start + n)
        self.keys[layer][:, :, start : start + n] = k
        self.values[layer][:, :, start : start + n] = v
        self.lengths[layer] = start + n
        return self.keys[layer][:, :, : start + n], self.values[layer][:, :, : start + n]

    def crop(self, n_keep: int) -> None:
        """Drop everything after the first n_keep slots."""
        self.lengths = [min(n, n_keep) for n in self.lengths]

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the slots at `indices` (in that order): compaction after tree acceptance."""
        for i, k in enumerate(self.keys):
            if k is not None and self.lengths[i]:
                n = len(indices)
                self.keys[i][:, :, :n] = k.index_select(2, indices)
                self.values[i][:, :, :n] = self.values[i].index_select(2, indices)
                self.lengths[i] = n


class DraftAttention(nn.Module):
    def __init__(self, config: LlamaConfig, input_size: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.num_heads // self.num_kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA over grouped KV heads. torch's CPU kernels read the groups in place, mask or not
        (no copy of the draft cache at every step); CUDA's fused kernels cannot take a mask and
        groups together, so there the heads are repeated."""
        if q.device.type == "cpu":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, self.expand_kv(k), self.expand_kv(v), attn_mask=mask)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DraftDecoderLayer(nn.Module):
    """Llama decoder layer whose attention may read a wider input than the residual stream.

    EAGLE-1: input = residual = fc output (no input norm: the fused feature is already normalised).
    EAGLE-3: input = cat(norm(embedding), norm(hidden)) of width 2H, residual = hidden.
    Early exit: input = norm(hidden), residual = hidden; without an MLP (mlp=False) by default,
    Kangaroo's attention-only adapter.
    """

    def __init__(self, config: LlamaConfig, input_size: int, mlp: bool = True):
        super().__init__()
        self.self_attn = DraftAttention(config, input_size)
        if mlp:
            self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = LlamaMLP(config)
        else:
            self.mlp = None

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = residual + attn_out
        return h if self.mlp is None else h + self.mlp(self.post_attention_layernorm(h))

    def forward(
        self, x, residual, cos, sin, cache: DraftCache | None, layer_index: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = attn.project(x, cos, sin)
        t = q.shape[2]
        if cache is not None:
            past = cache.layer_length(layer_index)
            k, v = cache.append(layer_index, k, v)
        else:
            past = 0
        if mask is None and t > 1:  # one new query sees every slot: no mask, SDPA's one-query path
            mask = causal_mask_with_past(t, past, q.device)
        return self.finish(residual, attn.output(attn.attend(q, k, v, mask)))

    def forward_unrolled(self, x, residual, cos, sin, context: tuple | None, chain: list, mask=None):
        """One training-time-test step.

        context: (k0, v0) of step 0, or None at step 0 (then this step's keys become the context).
        chain: (k_j, v_j) of steps 1..j-1 at the same positions; this step's keys are appended.
        mask: which context keys each query sees, bool [B, 1, T, T] (a packed row's conversations
        apart, heads.base.document_causal_mask); None: causal over the row.
        Returns (output, (k, v) of this step).
        """
        attn = self.self_attn
        q, k, v = attn.project(x, cos, sin)
        scale = 1.0 / math.sqrt(attn.head_dim)
        t = q.shape[2]
        seen = mask if mask is not None else causal_mask_with_past(t, 0, q.device)
        if context is None:
            out = F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), attn_mask=seen)
            return self.finish(residual, attn.output(out)), (k, v)
        k0, v0 = context
        ctx_scores = torch.matmul(q, attn.expand_kv(k0).transpose(-1, -2)) * scale  # [B,h,T,T]
        ctx_scores = ctx_scores.masked_fill(~seen, float("-inf"))
        diag_keys = [kk for kk, _ in chain] + [k]
        diag_values = [vv for _, vv in chain] + [v]
        diag_scores = torch.stack([(q * attn.expand_kv(kk)).sum(-1) * scale for kk in diag_keys], dim=-1)  # [B,h,T,j]
        probs = torch.softmax(torch.cat([ctx_scores, diag_scores], dim=-1).float(), dim=-1).to(q.dtype)
        ctx_probs, diag_probs = probs[..., :t], probs[..., t:]
        out = torch.matmul(ctx_probs, attn.expand_kv(v0))
        for i, vv in enumerate(diag_values):
            out = out + diag_probs[..., i : i + 1] * attn.expand_kv(vv)
        return self.finish(residual, attn.output(out)), (k, v)


def causal_mask_with_past(t: int, past: int, device) -> torch.Tensor:
    """Bool [t, past + t]: every new query sees all past slots and the new ones up to itself."""
    new = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(t, past, dtype=torch.bool, device=device), new], dim=1)


class Rotary(nn.Module):
    """Thin wrapper over transformers' RoPE (handles llama3 / yarn / linear scaling types)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.rope = LlamaRotaryEmbedding(config)

    def forward(self, like: torch.Tensor, position_ids: torch.Tensor):
        return self.rope(like, position_ids)
