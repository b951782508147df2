"""SDPA attention that keeps grouped-query key/value heads unrepeated under an attention mask.

transformers' SDPA path repeats the key/value heads up to the query heads (a copy of every layer's
whole KV cache, at every forward) whenever a mask is given, because CUDA's fused kernels cannot
take a mask and grouped heads together. A tree verification always carries a mask. torch's CPU
flash kernel takes both: the result is the same to the bit (tests/kernels/test_gqa_attention.py), and the
copy is gone (SmolLM2-135M, 300 cached tokens, 2 queries: 151 -> 67 us per layer here).

`install` switches a target that runs "sdpa" to this implementation; everything it does not
handle (no mask, one query, no grouped heads, not on CPU, a position bias) goes to transformers'
own SDPA.
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "specheads_gqa_sdpa"


def gqa_sdpa_forward(module: nn.Module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    masked_gqa = (
        attention_mask is not None
        and query.shape[2] > 1  # one query: transformers folds the groups into rows, no copy either
        and getattr(module, "num_key_value_groups", 1) > 1
        and query.device.type == "cpu"
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
    )
    if not masked_gqa:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the masks SDPA takes


def install(model: nn.Module) -> bool:
    """Run `model`'s SDPA attention through gqa_sdpa_forward; False (nothing changed) unless it
    runs "sdpa"."""
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True


def uninstall(model: nn.Module) -> None:
    if model.config._attn_implementation == NAME:
        model.set_attn_implementation("sdpa")


@contextlib.contextmanager
def stock_attention(model: nn.Module):
    """Within the block `model` runs transformers' own SDPA."""
    installed = model.config._attn_implementation == NAME
    if installed:
        uninstall(model)
    try:
        yield
    finally:
        if installed:
            install(model)
