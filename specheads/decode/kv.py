"""The target's KV cache during tree verification (transformers DynamicCache, batch 1).

A verification forward appends all N tree nodes after the committed prefix. Their RoPE positions
(prefix + depth) are passed explicitly, so siblings share a position while occupying different
cache slots. After acceptance, the accepted nodes' keys/values are moved down into contiguous
slots right after the prefix and the rest is cropped: the cache again holds exactly the
committed sequence, as if it had been decoded one token at a time.

Sliding-window and chunked layers (gemma3, gpt-oss, phi3, llama4) keep every key like full ones,
so that one gather compacts all layers alike; the tree mask gives each kind of layer its own
window or chunk, counted in the positions a node would have in the committed sequence (prefix +
depth), as transformers' own masks count them.

Layers with a recurrent state (linear attention, Mamba: qwen3_next, falcon_h1, granitemoehybrid)
fold every token of a forward into one state: tree siblings would see each other there, and the
rejected tail of a chain cannot be cropped out. Such a target verifies chains only (a tree is
refused in one line); its states are saved before the forward and, unless the whole chain was
accepted, restored and advanced by the accepted tokens alone (one more forward over them).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from ..errors import SpecHeadsError
from ..target import recurrent_layer_types
from .tree import TreeLayout


def new_cache(model, recurrent: bool = False) -> DynamicCache:
    """The cache of a model verified in trees: a full DynamicLayer for every attention layer,
    sliding-window and chunked ones too (the tree mask applies their windows). A model with
    recurrent-state layers is refused unless the caller verifies chains and restores the state
    (recurrent=True: speculative_generate)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    check_cache(cache, recurrent, model.config)
    return cache


def recurrent_refusal(config, what: str) -> SpecHeadsError:
    """The one line refusing `what` on a target with recurrent-state layers, and what works instead."""
    kinds = ", ".join(recurrent_layer_types(config)) or "recurrent"
    model_type = config.get_text_config(decoder=True).model_type
    return SpecHeadsError(
        f"{what} is refused for {model_type}: its {kinds} layers (linear attention / Mamba) keep a recurrent "
        "state, not per-token keys, which cannot branch or be cropped; draft chains instead (tree=chain, "
        "no hybrid text nodes)"
    )


def check_cache(cache: DynamicCache, recurrent: bool = False, config=None) -> None:
    """Verification rewrites key slots in place: plain DynamicLayers allow it; a recurrent state
    (linear attention, Mamba) only where the caller verifies chains and restores it (recurrent=True),
    and not beside a window that drops keys (hybrid_sliding)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, DynamicSlidingWindowLayer):
            if recurrent:
                continue
            if config is not None:
                raise recurrent_refusal(config, "tree verification")
        if type(layer) is not DynamicLayer:
            raise SpecHeadsError(
                f"tree verification supports full-attention KV caches only; this target uses "
                f"{type(layer).__name__} (sliding-window or hybrid attention)"
            )


def has_recurrent_state(cache: DynamicCache) -> bool:
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


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


def attention_spans(config) -> dict[str, tuple[str, int] | None]:
    """What each of the target's attention layer types sees, by transformers' layer type name:
    None for every earlier position, ("window", w) for the last w positions (itself included),
    ("chunk", c) for the earlier positions of its own chunk of c. A config without layer_types has
    one type for all layers, read as transformers reads it: sliding_window, else
    attention_chunk_size, else full attention."""
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    types = getattr(text, "layer_types", None)
    if not types:
        types = ["sliding_attention" if window else "chunked_attention" if chunk else "full_attention"]
    spans = {"sliding_attention": ("window", window), "chunked_attention": ("chunk", chunk)}
    return {t: spans.get(t) for t in types}


def tree_attention_bias(
    tree_mask: torch.Tensor,
    prefix_len: int,
    dtype: torch.dtype,
    device: torch.device,
    span: tuple[str, int] | None = None,
    key_positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """[1, 1, n, prefix + m] additive mask of n queries, the last n of m tree keys (n = m for a
    verified tree): each sees the prefix and the tree keys its row of the [n, m] tree_mask allows,
    within `span` (attention_spans) of its own position. Positions are counted per key slot: the
    prefix's are 0..prefix-1, a tree key's is key_positions[j], by default prefix + depth (a square
    tree_mask, where a node's depth is its number of ancestors, the row's sum minus one).

    Additive (0 / dtype min) rather than bool, because transformers' eager attention adds the
    mask to the scores while SDPA accepts either form.
    """
    n, m = tree_mask.shape
    tree_mask = tree_mask.cpu()
    allowed = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree_mask], dim=1)
    if span is not None:
        if key_positions is None:
            tree_positions = prefix_len + tree_mask.sum(1) - 1
        else:
            tree_positions = torch.as_tensor(key_positions, dtype=torch.long)
        key = torch.cat([torch.arange(prefix_len), tree_positions])
        allowed &= within_span(span, tree_positions[m - n :], key)
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return bias.to(device)[None, None]


def within_span(span: tuple[str, int], query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """[queries, keys]: which key positions a query position sees through a ("window", w) or
    ("chunk", c) span, as transformers' sliding-window and chunked masks count them."""
    kind, size = span
    if kind == "window":
        return key[None] > query[:, None] - size
    return key[None] // size == query[:, None] // size


def tree_attention_masks(
    config,
    tree_mask: torch.Tensor,
    prefix_len: int,
    dtype: torch.dtype,
    device,
    key_positions: Sequence[int] | None = None,
):
    """A tree forward's attention_mask (verify_tree's, a draft model's): tree_attention_bias for
    each layer type's span; one tensor where every layer sees alike (every model's forward takes
    it), else one per layer type, the dict that forwards of models mixing kinds of layers (gemma3,
    gpt-oss, llama4, qwen2) take as theirs."""
    spans = attention_spans(config)
    masks = {
        t: tree_attention_bias(tree_mask, prefix_len, dtype, device, span, key_positions) for t, span in spans.items()
    }
    return next(iter(masks.values())) if len(set(spans.values())) == 1 else masks


def verify_tree(target, tokens: Sequence[int], layout: TreeLayout, prefix_len: int, cache: DynamicCache):
    """The target's forward over a tree after its `prefix_len` cached tokens; returns its output.

    A 4D mask (prefix + tree mask, each layer's window) and explicit positions: works with the
    eager and SDPA attention implementations. A lone root needs no mask (it sees the whole prefix),
    and without one attention takes its 1-query fast path; nor does a chain on a target with a
    recurrent state (the model's own causal masks; a tree there is refused). All nodes are
    appended to the cache (commit keeps the accepted ones).
    """
    device = target.device
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    recurrent = has_recurrent_state(cache)
    if recurrent and not layout.is_chain:
        raise recurrent_refusal(target.model.config, f"a draft tree ({layout.size} nodes, branching)")
    mask = None
    if layout.size > 1 and not recurrent:
        mask = tree_attention_masks(target.model.config, layout.mask, prefix_len, target.dtype, device)
    positions = (prefix_len + layout.position_offsets(device))[None]
    return target.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)


def save_states(cache: DynamicCache) -> list | None:
    """Copies of the cache's recurrent and convolution states (None without any): what commit
    restores when a verified chain is not accepted whole."""
    if not has_recurrent_state(cache):
        return None
    saved = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            saved.append(
                {
                    name: {i: None if t is None else t.clone() for i, t in getattr(layer, name).items()}
                    for name in ("conv_states", "recurrent_states")
                }
            )
        else:
            saved.append(None)
    return saved


def commit(target, cache: DynamicCache, prefix_len: int, tokens: Sequence[int], path: Sequence[int], saved) -> int:
    """Leave the cache holding the committed sequence: prefix + the accepted `path` of `tokens`;
    returns the target forwards that took (0 or 1), which a step's cost and tau count.

    Without recurrent states (saved None) compact_cache moves the accepted keys down. With them, a
    chain accepted whole is already the committed sequence; otherwise the states saved before the
    verification (save_states) are put back, every attention layer cropped to the prefix, and the
    accepted tokens run again: the state then holds them and none of the rejected ones.
    """
    if saved is None:
        compact_cache(cache, prefix_len, path)
        return 0
    if len(path) == len(tokens):
        return 0
    for layer, states in zip(cache.layers, saved):
        if states is not None:
            for name, by_index in states.items():
                getattr(layer, name).update({i: None if t is None else t.clone() for i, t in by_index.items()})
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            layer.keys, layer.values = layer.keys[..., :prefix_len, :], layer.values[..., :prefix_len, :]
    device = target.device
    ids = torch.tensor([[tokens[i] for i in path]], dtype=torch.long, device=device)
    positions = torch.arange(prefix_len, prefix_len + len(path), device=device)[None]
    target.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return 1


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
