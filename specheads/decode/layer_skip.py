"""Layer skipping: the target drafts for itself with some of its decoder layers skipped, no training
(self-speculative decoding: Draft & Verify, Zhang et al., 2023; SWIFT, Xia et al., 2024).

Drafting (`LayerSkipDrafter`, the drafter protocol of drafters.py; it reads no captured state):
each level of the tree runs the target's embedding, the decoder layers it keeps (all but
`skipped`), its final norm and LM head over the level's nodes, on the target's own KV cache
(drafters.grow_on_target_layers, target_layers.run_layers). The committed prefix's keys and values
there are the full model's, as Draft & Verify shares them: only the drafted nodes go through the
reduced stack. The kept layers' drafted entries are cropped before the tree is returned; the
skipped layers never get any. Nothing of the target is changed, so the verification that follows
runs every layer on the committed sequence alone.

Which layers to skip, how deep to draft and where to stop on low confidence (tree.min_path_prob)
is what bench/layer_skip.py calibrates on this machine and keeps in its cache, with, on request, a
draft vocabulary: the ids of the target's most frequent answer tokens, whose LM-head rows alone a
level reads (the full head is a large share of a small target's weights; a target token outside
them is never drafted, which costs acceptance, never correctness).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import SpecHeadsError
from .drafters import DraftTable, grow_on_target_layers
from .policy import TreePolicy
from .target_layers import check_layer_family
from .tree import TreeLayout


def check_skipped(num_layers: int, skipped: Sequence[int]) -> tuple[int, ...]:
    """The skipped layers, sorted and checked: indices of decoder layers, at least one kept."""
    try:
        layers = sorted({int(i) for i in skipped})
    except (TypeError, ValueError):
        raise SpecHeadsError(f"skip.layers must be decoder layer indices, got {list(skipped)!r}") from None
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise SpecHeadsError(f"skip.layers {bad} are not decoder layers of this target (0..{num_layers - 1})")
    if len(layers) == num_layers:
        raise SpecHeadsError(f"skip.layers skips all {num_layers} decoder layers: keep at least one")
    return tuple(layers)


def kept_layers(num_layers: int, skipped: Sequence[int]) -> list[int]:
    """The decoder layers a draft runs, ascending."""
    gone = set(check_skipped(num_layers, skipped))
    return [i for i in range(num_layers) if i not in gone]


class VocabReader:
    """The target's final norm and LM head over all its tokens, or over a draft vocabulary (sorted
    target ids) whose LM-head rows are copied once, contiguous, so a level reads only them."""

    def __init__(self, target, vocab: Sequence[int] | None = None):
        self.target = target
        self.ids = None
        if vocab is not None:
            ids = sorted({int(i) for i in vocab})
            size = target.lm_head.weight.shape[0]
            if not ids or ids[0] < 0 or ids[-1] >= size:
                raise SpecHeadsError(f"a draft vocabulary holds target token ids 0..{size - 1}, got {len(ids)} ids")
            self.ids = torch.tensor(ids, dtype=torch.long, device=target.lm_head.weight.device)
            self.weight = target.lm_head.weight.detach()[self.ids].contiguous()
            bias = target.lm_head.bias
            self.bias = bias.detach()[self.ids].contiguous() if bias is not None else None

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        normed = self.target.final_norm(states)
        if self.ids is None:
            return self.target.lm_head(normed)
        return torch.nn.functional.linear(normed, self.weight, self.bias)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of drafted ids (indices into the draft vocabulary)."""
        return ids if self.ids is None else self.ids[ids.to(self.ids.device)]


class LayerSkipDrafter:
    """Drafts with the target itself, `skipped` decoder layers left out (module docstring)."""

    layer_ids: list[int] = []  # reads no captured target state
    reads_final = False
    head = None  # not a head: no head calibration, no draft precision of a head's

    def __init__(self, target, skipped: Sequence[int], policy: TreePolicy, vocab: Sequence[int] | None = None):
        check_layer_family(target)
        self.target = target
        self.policy = policy
        self.skipped = check_skipped(len(target.layers), skipped)
        self.layers = kept_layers(len(target.layers), self.skipped)
        self.reader = VocabReader(target, vocab)
        self.target_cache = None  # the target's own KV cache (bind_target_cache)
        self.table: DraftTable | None = None  # every node the last draft() drafted (grow_tree)

    def bind_target_cache(self, cache) -> None:
        self.target_cache = cache

    def start(self, prompt_ids: torch.Tensor, states: dict, root: int) -> None:
        pass

    def advance(self, states: dict, tokens: Sequence[int], bonus: int) -> None:
        pass  # the target's cache, which the loop keeps, is all the drafter reads

    def rewind(self, n: int) -> None:
        pass  # nothing of its own to redo

    def node_positions(self, prefix_len: int, depths: list[int]) -> list[int]:
        """RoPE positions of drafted nodes: the root sits at prefix_len, a node at depth d d further."""
        return [prefix_len + d for d in depths]

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """The target's own logits [.., V] (over the draft vocabulary, if any) from the stream
        leaving its last decoder layer."""
        return self.reader.logits(states)

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        if self.target_cache is None:
            raise RuntimeError("a layer-skip drafter drafts on the target's cache: call bind_target_cache first")
        held = sorted({int(layer.get_seq_length()) for layer in self.target_cache.layers})
        if held != [prefix_len]:
            raise RuntimeError(f"layer-skip drafter out of step: {prefix_len} committed tokens, the cache holds {held}")
        self.table = DraftTable()
        return grow_on_target_layers(
            self.target, self.layers, self.target_cache, root, prefix_len, max_depth, self.policy, self.table,
            lambda states, positions, visible, ids: self.logits(states)[0], self.node_positions,
            self.reader.to_target,
        )  # fmt: skip
