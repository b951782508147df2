"""The target's KV cache during tree verification (transformers DynamicCache, batch 1).

A verification forward appends all N tree nodes after the committed prefix. Their RoPE positions
(prefix + depth) are passed explicitly, so siblings share a position while occupying different
cache slots. After acceptance, the accepted nodes' keys/values are moved down into contiguous
slots right after the prefix and the rest is cropped: the cache again holds exactly the
committed sequence, as if it had been decoded one token at a time.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ..errors import SpecHeadsError
from .tree import TreeLayout


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    check_cache(cache)
    return cache


def check_cache(cache: DynamicCache) -> None:
    """Tree verification rewrites slots in place; only plain full-attention layers allow it."""
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise SpecHeadsError(
                f"tree verification supports full-attention KV caches only; this target uses "
                f"{type(layer).__name__} (sliding-window or hybrid attention)"
            )


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def cache_prefix(cache: DynamicCache, length: int) -> DynamicCache:
    """A cache holding the first `length` entries of every layer of `cache`, as views: appending to
    it (a DynamicLayer appends by concatenation) or cropping it leaves `cache` as it is. For a drafter
    that runs the target's own layers along a sequence whose cache was filled in one forward
    (calibration); not for compact_cache, which writes in place."""
    view = copy.copy(cache)
    view.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in view.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    return view


def tree_attention_bias(
    tree_mask: torch.Tensor, prefix_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[1, 1, N, prefix + N] additive mask: every node sees the prefix, its ancestors and itself.

    Additive (0 / dtype min) rather than bool, because transformers' eager attention adds the
    mask to the scores while SDPA accepts either form.
    """
    n = tree_mask.shape[0]
    allowed = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree_mask.cpu()], dim=1)
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return bias.to(device)[None, None]


def verify_tree(target, tokens: Sequence[int], layout: TreeLayout, prefix_len: int, cache: DynamicCache):
    """The target's forward over a tree after its `prefix_len` cached tokens; returns its output.

    A 4D mask (prefix + tree mask) and explicit positions: works with the eager and SDPA
    attention implementations. A lone root needs no mask (it sees the whole prefix), and without
    one attention takes its 1-query fast path. All nodes are appended to the cache (compact_cache
    keeps the accepted ones).
    """
    device = target.device
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    bias = None if layout.size == 1 else tree_attention_bias(layout.mask, prefix_len, target.dtype, device)
    positions = (prefix_len + layout.position_offsets(device))[None]
    return target.model(input_ids=ids, attention_mask=bias, position_ids=positions, cache=cache, use_cache=True)


def compact_cache(cache: DynamicCache, prefix_len: int, keep: Sequence[int]) -> None:
    """Keep tree nodes `keep` (ascending node ids, relative to the prefix) and drop the others.

    Node ids along an accepted path are increasing and node j >= its rank j on the path, so
    moving them down in one gather never reads a slot that was already overwritten.
    """
    total = cache_length(cache)
    n_keep = len(keep)
    if list(keep) != list(range(n_keep)):
        src = torch.tensor(keep, dtype=torch.long) + prefix_len
        for layer in cache.layers:
            src_dev = src.to(layer.keys.device)
            layer.keys[..., prefix_len : prefix_len + n_keep, :] = layer.keys.index_select(-2, src_dev)
            layer.values[..., prefix_len : prefix_len + n_keep, :] = layer.values.index_select(-2, src_dev)
    drop = total - prefix_len - n_keep
    if drop < 0:
        raise ValueError(f"cache holds {total} tokens, fewer than prefix {prefix_len} + kept {n_keep}")
    if drop:
        cache.crop(-drop)
