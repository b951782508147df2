"""Some of the target's own decoder layers, run over new tokens on the target's own KV cache.

A drafter that drafts with the target itself (an early-exit head's first L layers; a target with
layers skipped) runs a subset of its decoder layers over tree nodes between two verifications, on
the cache that the verification forward reads (kv.py):

    hidden = run_layers(target, layers, hidden, positions, cache, visible)   # appends to `layers`
    ...                                                                       # more levels
    crop_layers(cache, layers, prefix_len)                                    # before verification

run_layers calls each layer as the model's own forward does (transformers' Llama decoder layer:
the hidden states, a 4D additive mask, explicit position ids and their rotary (cos, sin), the
cache, which the layer's attention updates at its own layer index), so a node's output equals the
model's own state at that layer for the node's sequence: its committed prefix, its ancestors in
the tree and itself. Positions are explicit, as in verify_tree: siblings share a position (prefix
+ depth) while occupying different cache slots. Only the layers run get new entries; the others
keep exactly the committed sequence, and crop_layers drops the new entries again, so that the
cache holds the committed sequence in every layer when the target verifies.

The input of layer 0 is `target.embed_tokens(ids)`; the output of layer k is the stream entering
layer k + 1 (layer id k + 1 of target.py's convention), before the final norm. This holds for the
Llama family (Llama, Mistral, Qwen2, Qwen3), whose forward is embed -> layers -> norm; others (Gemma
scales its embedding, some models interleave other blocks) are refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ..errors import SpecHeadsError
from .kv import check_cache

# model types whose decoder is embed_tokens -> layers (each called as LlamaDecoderLayer is) -> norm
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def check_layer_family(target) -> None:
    """Refuse, in one line, a target whose decoder layers run_layers cannot call on their own."""
    model_type = target.info.model_type
    decoder = target.model.get_decoder()
    if model_type not in LLAMA_FAMILY or not hasattr(decoder, "rotary_emb"):
        raise SpecHeadsError(
            f"running a target's own layers to draft needs a Llama-family target ({', '.join(LLAMA_FAMILY)}); "
            f"{target.info.name} is a {model_type} model"
        )


def layers_length(cache: DynamicCache, layers: Sequence[int]) -> int:
    """The number of entries each of `layers` holds (the same for all of them, or ValueError)."""
    if not layers:
        raise ValueError("no layers given")
    lengths = {int(cache.layers[i].get_seq_length()) for i in layers}
    if len(lengths) != 1:
        raise ValueError(f"layers {list(layers)} hold different numbers of entries: {sorted(lengths)}")
    return lengths.pop()


def attention_bias(visible: torch.Tensor | None, past: int, n: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """[1, 1, n, past + n] additive mask from bool `visible` [n, past + n] (which slots each new
    token sees); None: causal (every cached slot, and the new ones up to itself), which for a lone
    new token is no mask at all (attention's one-query path, as the model's own decode step)."""
    if visible is None:
        if n == 1:
            return None
        visible = torch.cat([torch.ones(n, past, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
    if tuple(visible.shape) != (n, past + n):
        raise ValueError(f"visible is {tuple(visible.shape)}, expected ({n}, {past + n}): new tokens x cached + new")
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    return bias.masked_fill(~visible.to(device), torch.finfo(dtype).min)[None, None]


def run_layers(
    target,
    layers: Sequence[int],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the target's decoder `layers` (ascending indices) in order over n new tokens.

    Args:
        target: a FrozenTarget of the Llama family (check_layer_family).
        layers: the decoder layers to run; each must hold the same number of cache entries, `past`.
        hidden: [1, n, H] the stream entering the first of them (target.embed_tokens(ids) for layer 0).
        positions: [n] or [1, n] the new tokens' RoPE positions (a tree node: prefix + depth).
        cache: the target's own cache; each layer run appends the n tokens' keys and values to its
            own entries (slots past .. past + n - 1), the other layers are left as they are.
        visible: bool [n, past + n], the slots each new token attends to (the committed prefix, its
            ancestors' slots and its own); None: causal.

    Returns:
        [1, n, H] the stream leaving the last layer run (pre final norm).
    """
    check_cache(cache)
    device, n = hidden.device, hidden.shape[1]
    past = layers_length(cache, layers)
    positions = positions.reshape(1, -1).to(device)
    mask = attention_bias(visible, past, n, hidden.dtype, device)
    rotary = target.model.get_decoder().rotary_emb(hidden, positions)
    for i in layers:
        hidden = target.layers[i](
            hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, position_embeddings=rotary
        )
    return hidden


def crop_layers(cache: DynamicCache, layers: Sequence[int], length: int) -> None:
    """Drop every entry of `layers` after the first `length` (the inverse of run_layers: back to
    the committed sequence). A layer holding fewer than `length` entries is an error."""
    for i in layers:
        layer = cache.layers[i]
        extra = int(layer.get_seq_length()) - length
        if extra < 0:
            raise ValueError(f"layer {i} holds {length + extra} entries, fewer than {length}")
        if extra:
            layer.crop(-extra)
