"""tree=auto's dynamic trees: price EAGLE-2 trees with a floor (decode.policy.DynamicTreeSpec).

At every answer position of the calibration answers the head drafts a dynamic tree exactly as
decoding does after accepting the true text up to there: the drafter is fed the target's own
states one true token at a time. That tree is grown with no floor and no cut (grow_tree's table
keeps every drafted node and its path score), and what each smaller setting would draft at the
same position follows from it without drafting again:
- the first d levels of a deeper growth are the growth of a d-deep tree: levels are grown in
  order, and a level's frontier (its top_k nodes by path score) depends only on the levels above;
- a floor p drops the nodes scored below it, and nothing else: a node above it keeps its place in
  every frontier (the nodes above it in a frontier scored higher, so they pass the floor too), so
  a floored tree is the unfloored tree cut at the floor; the drafter grows level j + 1 only while
  some level-j node reaches p, which sets how many drafting calls the step costs;
- n nodes keep the n best-scored nodes left (tree.select_dynamic), so the step accepts the true
  path's nodes down to the first that, or any node above it, ranks n or later.
The expected tokens per second of each (top_k, depth, nodes, floor) weigh that acceptance against
the target's verification cost per tree size and the drafting cost per number of levels drafted,
timed with the real drafter, over the steps the loop would take along the answers (bench/walk.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..decode.drafters import DraftTable, make_drafter
from ..decode.kv import cache_prefix, new_cache
from ..decode.policy import DynamicTreeSpec
from .walk import walk, walked_tau

TOP_K = (2, 3, 4)  # children per expanded node, and nodes expanded per level
MAX_DEPTH = 4  # deepest dynamic tree weighed
NODES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # drafted nodes kept per step


@dataclass(frozen=True)
class Growth:
    """One position's unfloored, uncut dynamic tree: its drafted nodes in the order
    select_dynamic ranks them (path score descending, earlier node first), and where the true
    continuation's nodes stand in that order, depth 1 first, while the tree holds it."""

    depths: tuple[int, ...]
    scores: tuple[float, ...]
    truth: tuple[int, ...]

    def cut(self, depth: int, min_path_prob: float) -> tuple[list[int], int, int]:
        """For the tree `depth` deep under the floor: the true path's ranks among the nodes left
        (those reaching the floor), how many nodes are left, and the levels drafted."""
        floor = math.log(min_path_prob) if min_path_prob > 0 else -math.inf
        ranks = []
        for i in self.truth[:depth]:
            if self.scores[i] < floor:
                break
            # every node ranked before i scored at least as high, so it is above the floor too
            ranks.append(sum(1 for d in self.depths[:i] if d <= depth))
        left = sum(1 for d, s in zip(self.depths, self.scores) if d <= depth and s >= floor)
        reached = {d for d, s in zip(self.depths, self.scores) if s >= floor}
        levels = 1
        while levels < depth and levels in reached:
            levels += 1
        return ranks, left, levels

    def accepted(self, depth: int, min_path_prob: float, nodes: int) -> tuple[int, int, int]:
        """(drafts accepted, tree size with the root, levels drafted) of DynamicTreeSpec(depth,
        top_k, nodes, min_path_prob) at this position."""
        ranks, left, levels = self.cut(depth, min_path_prob)
        return accepted_within(ranks, nodes), min(nodes, left) + 1, levels


def accepted_within(ranks: Sequence[int], nodes: int) -> int:
    """The true path's nodes kept by an n-node cut: down to the first that (or one above it)
    ranks n or later."""
    k = 0
    for rank in ranks:
        if rank >= nodes:
            break
        k += 1
    return k


def growth_of(table: DraftTable, truth: Sequence[int]) -> Growth:
    """The drafted table (root first) ranked as select_dynamic ranks it, and the true path in it."""
    order = sorted(range(1, len(table.tokens)), key=lambda i: (-table.scores[i], i))
    rank = {node: r for r, node in enumerate(order)}
    path, node = [], 0
    for token in truth:
        child = next((c for c in order if table.parents[c] == node and table.tokens[c] == token), None)
        if child is None:
            break
        path.append(rank[child])
        node = child
    return Growth(
        tuple(table.depths[i] for i in order),
        tuple(table.scores[i] for i in order),
        tuple(path),
    )


@torch.no_grad()
def grow_along(
    target, head, ids: Sequence[int], answer_start: int, widths: Sequence[int], depth: int
) -> dict[int, list[Growth]]:
    """Per top_k in `widths`, the full dynamic tree at each answer position, rooted at answer
    tokens 0..n-2 as calibrate.rank_vectors' positions are; the drafter catches up one true token
    per step. One target forward serves every width (and, for a drafter that runs the target's own
    layers, fills the cache whose first r entries it drafts on at answer token r)."""
    drafters = {k: make_drafter(head, DynamicTreeSpec(depth, k, total_tokens=1)) for k in widths}
    first = next(iter(drafters.values()))
    seq = torch.tensor([list(ids)], device=target.device)
    binds = hasattr(first, "bind_target_cache")
    cache = new_cache(target.model) if binds else None
    with target.capture(first.layer_ids, final=first.reads_final) as store:
        target.model(seq, cache=cache, use_cache=binds)
    states = dict(store)

    def at(lo: int, hi: int) -> dict:
        return {k: v[:, lo:hi] for k, v in states.items()}

    out: dict[int, list[Growth]] = {}
    for k, drafter in drafters.items():
        drafter.start(seq[:, :answer_start], at(0, answer_start), int(ids[answer_start]))
        out[k] = []
        for r in range(answer_start, len(ids) - 1):
            if binds:
                drafter.bind_target_cache(cache_prefix(cache, r))
            drafter.draft(int(ids[r]), r, depth)
            out[k].append(growth_of(drafter.table, [int(x) for x in ids[r + 1 : r + 1 + depth]]))
            drafter.advance(at(r, r + 1), [int(ids[r])], int(ids[r + 1]))
    return out


def rule_candidate(positions: Sequence[Growth], spec: DynamicTreeSpec, draft_s: dict[int, float]) -> dict:
    """`spec` as a head tree the adaptive hybrid rule may choose (hybrid_fit.calibrate_rule): the
    drafts it accepts at each position, and its nodes (root excluded) and drafting ms per step on
    average; draft_s[levels]: the drafting seconds of a step that drafts that many levels."""
    steps = [g.accepted(spec.depth, spec.min_path_prob, spec.total_tokens) for g in positions]
    count = max(len(steps), 1)
    return {
        "dynamic": spec,
        "accepted": [a for a, _, _ in steps],
        "nodes": sum(size - 1 for _, size, _ in steps) / count,
        "draft_ms": 1e3 * sum(draft_s[levels] for _, _, levels in steps) / count,
    }


def dynamic_choice(
    growths: dict[int, list[Growth]],
    verify_s: Sequence[float],
    draft_s: dict[int, dict[int, float]],
    max_depth: int,
    nodes: Sequence[int] = NODES,
    gates: Sequence[float] = (0.0,),
    *,
    lengths: Sequence[int],
) -> list[dict]:
    """Expected tau and tokens/s of every (top_k, depth, nodes, floor): growths per top_k (the
    positions of answers of `lengths` positions each, walk.answer_lengths), verify_s[m] the seconds
    of a target forward of m query tokens, draft_s[top_k][levels] the drafting seconds of a step
    that drafts that many levels. Each setting walks the answers as the loop steps through them
    (walk.walk): tau is their tokens per step taken, tokens/s per second of those steps."""
    tokens = sum(lengths)
    rows = []
    for top_k, positions in growths.items():
        for depth in range(1, max_depth + 1):
            for gate in gates:
                cuts = [g.cut(depth, gate) for g in positions]
                drafting = [draft_s[top_k][levels] for _, _, levels in cuts]
                for n in nodes:
                    steps = walk(lengths, [accepted_within(ranks, n) for ranks, _, _ in cuts])
                    seconds = sum(verify_s[min(n, cuts[i][1]) + 1] + drafting[i] for i in steps)
                    rows.append(
                        {
                            "top_k": top_k,
                            "depth": depth,
                            "nodes": n,
                            "min_path_prob": gate,
                            "tau": walked_tau(lengths, len(steps)),
                            "tokens_per_s": tokens / seconds if seconds else 0.0,
                        }
                    )
    return rows
