"""Draft trees as flat node lists: parents, depths, attention mask, root-to-leaf paths.

Node 0 is always the root: the token the target itself chose last (not yet in the target's KV
cache). Every other node is a drafted token; parents come before children, so a node's index is
larger than all of its ancestors' (the order verification, compaction and drafting rely on).

Two ways to get a tree:
- static: a list of rank paths (Medusa `choices`, vLLM `speculative_token_tree`), e.g.
  [[0], [1], [0, 0]] = the top-1 and top-2 children of the root, and the top-1 child of the top-1.
- dynamic (EAGLE-2): candidates scored by cumulative draft log-probability; the best
  `total_tokens` of them are kept (a child never scores above its parent, so the kept set is a
  connected tree).
All functions here are pure: no model, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import torch

from ..errors import SpecHeadsError


@dataclass(frozen=True)
class TreeLayout:
    """The shape of a tree of N nodes (root included)."""

    parents: tuple[int, ...]  # parents[0] = -1; parents[i] < i

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before children")

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0]
        for p in self.parents[1:]:
            depths.append(depths[p] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @property
    def is_chain(self) -> bool:
        """No node has two children: what a target with a recurrent state can verify."""
        return all(len(kids) <= 1 for kids in self.children)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.children) if not k)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, both included."""
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return path[::-1]

    @cached_property
    def mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
        n = self.size
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[p]
        return mask

    @cached_property
    def retrieve(self) -> torch.Tensor:
        """[leaves, max_depth + 1] long: each row is a root-to-leaf path of node ids, padded with -1."""
        rows = [self.path_to(leaf) for leaf in self.leaves]
        width = self.max_depth + 1
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)

    def position_offsets(self, device: Any = None) -> torch.Tensor:
        """[N] long: RoPE position of each node relative to the root (siblings share a position)."""
        return torch.tensor(self.depths, dtype=torch.long, device=device)


@dataclass(frozen=True)
class StaticTree:
    """A static tree: its layout and, for every node, the rank it takes among its parent's top-k."""

    layout: TreeLayout
    ranks: tuple[int, ...]  # ranks[0] = -1 (root)
    paths: tuple[tuple[int, ...], ...]  # the sorted input paths; node i + 1 is paths[i]
    # > 0: the drafter grows level d + 1 only while some node of level d has a path probability
    # (the product of the head's probabilities along it) of at least this; the rest of the tree is
    # left out of that step (neither drafted nor verified)
    min_path_prob: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.min_path_prob < 1.0:
            raise SpecHeadsError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")

    @property
    def size(self) -> int:
        return self.layout.size


def static_tree(paths: Sequence[Sequence[int]], min_path_prob: float = 0.0) -> StaticTree:
    """Build a static tree from rank paths; every prefix of a path must be a path too."""
    try:
        norm = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    except (TypeError, ValueError):
        raise SpecHeadsError(f"a tree must be a list of lists of ranks, got {paths!r}") from None
    if len(norm) != len(list(paths)):
        raise SpecHeadsError("tree paths must not repeat")
    if not norm:
        raise SpecHeadsError("a tree needs at least one path, e.g. [[0]]")
    index = {(): 0}
    parents, ranks = [-1], [-1]
    for i, path in enumerate(norm, start=1):
        if not path or any(r < 0 for r in path):
            raise SpecHeadsError(f"tree path {list(path)} must be a non-empty list of ranks >= 0")
        if path[:-1] not in index:
            raise SpecHeadsError(f"tree path {list(path)} needs its prefix {list(path[:-1])} too")
        index[path] = i
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
    return StaticTree(TreeLayout(tuple(parents)), tuple(ranks), tuple(norm), float(min_path_prob))


@lru_cache(maxsize=256)
def pruned_tree(tree: StaticTree, max_depth: int) -> StaticTree:
    """The tree's paths of at most max_depth tokens (the tree itself when none is deeper). Its
    nodes are the first ones of the tree's (nodes are numbered level by level)."""
    if tree.layout.max_depth <= max_depth:
        return tree
    return static_tree([p for p in tree.paths if len(p) <= max_depth] or [[0]], tree.min_path_prob)


def chain_paths(depth: int) -> list[list[int]]:
    """The top-1 chain of `depth` drafted tokens: [[0], [0, 0], ...]."""
    return [[0] * d for d in range(1, depth + 1)]


def spine_paths(depth: int, width: int) -> list[list[int]]:
    """The top-1 chain of `depth` tokens with the next width - 1 ranks beside each of its nodes as
    leaves: a drafter that runs one node per level (the spine) drafts it at a chain's cost, and
    the verification takes the alternatives almost for free where a forward is bound by its
    per-layer overhead rather than its tokens (one-row decoding on a CPU)."""
    return [[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(width)]


def full_paths(depth: int, width: int) -> list[list[int]]:
    """Every path of up to `depth` ranks below `width` (a full width-ary tree)."""
    out: list[list[int]] = []
    level: list[list[int]] = [[]]
    for _ in range(depth):
        level = [p + [r] for p in level for r in range(width)]
        out.extend(level)
    return out


def select_dynamic(
    parents: Sequence[int], scores: Sequence[float], total_tokens: int, min_score: float = -math.inf
) -> tuple[list[int], TreeLayout]:
    """EAGLE-2 rerank: keep the `total_tokens` best candidates by score as one connected tree.

    Candidates are numbered in creation order (a parent before its children); parents[i] is a
    candidate index or -1 for a child of the root. Scores are cumulative log-probabilities, so a
    child never beats its parent; ties go to the earlier candidate, which keeps every ancestor of
    a kept node. Candidates scoring below `min_score` are left out; a child of a left-out parent
    scores below it too, so the rest stays connected. Returns (kept candidate indices in ascending
    order, layout of root + kept), where tree node j + 1 is candidate kept[j].
    """
    n = len(parents)
    if len(scores) != n:
        raise ValueError("parents and scores must have the same length")
    if total_tokens < 0:
        raise ValueError("total_tokens must be >= 0")
    order = sorted((i for i in range(n) if scores[i] >= min_score), key=lambda i: (-float(scores[i]), i))
    kept = sorted(order[:total_tokens])
    node_of = {c: j + 1 for j, c in enumerate(kept)}
    tree_parents = [-1]
    for c in kept:
        p = parents[c]
        if p != -1 and p not in node_of:
            raise ValueError(f"candidate {c} kept without its parent {p}: scores must not grow with depth")
        tree_parents.append(0 if p == -1 else node_of[p])
    return kept, TreeLayout(tuple(tree_parents))


# where a node of a merged tree came from (a bit mask: a node both sources drafted has both bits)
FROM_HEAD = 1
FROM_TEXT = 2


def merge_chains(
    tokens: Sequence[int], layout: TreeLayout, chains: Sequence[Sequence[int]]
) -> tuple[list[int], TreeLayout, tuple[int, ...]]:
    """Hang token chains below the root of a drafted tree, as one tree (a token trie).

    A chain walks down from the root through the child that already carries its next token and
    adds a node where none does, so shared prefixes share nodes and no parent gets two children
    with the same token. The tree's own nodes keep their ids and the added ones come after them
    (parents still before children), so at every node the tree's own children come before the
    added ones: the order verify.speculative_accept's proof for mixed siblings relies on.

    Returns (tokens, layout, sources): sources[i] is FROM_HEAD for the tree's own nodes,
    FROM_TEXT for added ones, both bits for a tree node a chain also passed through (root: 0).
    """
    tokens = list(tokens)
    parents = list(layout.parents)
    sources = [0] + [FROM_HEAD] * (len(tokens) - 1)
    child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for i in range(1, len(tokens)):
        child_of.setdefault((parents[i], tokens[i]), i)
    for chain in chains:
        node = 0
        for t in chain:
            t = int(t)
            nxt = child_of.get((node, t))
            if nxt is None:
                nxt = len(tokens)
                tokens.append(t)
                parents.append(node)
                sources.append(0)
                child_of[node, t] = nxt
            sources[nxt] |= FROM_TEXT
            node = nxt
    return tokens, TreeLayout(tuple(parents)), tuple(sources)
