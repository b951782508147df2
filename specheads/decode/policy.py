"""The tree policy: which tree a drafter grows, from infer.py's tree settings and the head.

A policy is a static tree of rank paths (tree.py) or an EAGLE-2 dynamic tree (DynamicTreeSpec).
`tree.kind=default` takes the dynamic tree the head's calibration chose, else the head's stored
tree, else its family's fallback tree, else a dynamic tree; `auto` is resolved into a tree by
calibration (bench/calibrate.py) first.
A hybrid policy (HybridPolicy) adds the continuations of the text's own repeats to a head's tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.infer import TreeConfig, resolve_search
from ..errors import SpecHeadsError
from .hybrid_rule import RuleParams
from .tree import StaticTree, chain_paths, static_tree


@dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2: `depth` drafted tokens at most per path, `top_k` children per expanded node,
    `total_tokens` drafted nodes kept (the root is extra).

    min_path_prob > 0: only nodes whose path probability under the head is at least this are
    expanded or kept, so a step where the head is sure of one path (or of none) drafts and
    verifies fewer nodes; a node's path probability never exceeds its parent's, so what is kept
    is still one connected tree."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48
    min_path_prob: float = 0.0

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise SpecHeadsError(f"dynamic tree needs depth, top_k, total_tokens >= 1, got {self}")
        if not 0.0 <= self.min_path_prob < 1.0:
            raise SpecHeadsError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")


TreePolicy = StaticTree | DynamicTreeSpec


def policy_depth(policy: TreePolicy) -> int:
    """The most tokens one path of the policy's trees drafts."""
    return policy.layout.max_depth if isinstance(policy, StaticTree) else policy.depth


def check_depth(head, policy: TreePolicy) -> None:
    """Refuse a tree deeper than the head can draft (a Medusa head drafts one depth per head)."""
    limit = head.max_draft_depth(head.spec)
    depth = policy_depth(policy)
    if limit is not None and depth > limit:
        raise SpecHeadsError(f"the tree is {depth} deep but this {head.title} head drafts at most {limit} deep")


def fallback_policy(head, tree: TreeConfig) -> TreePolicy:
    """A head without a stored tree: its family's fallback tree, cut to the depth the head can
    draft and completed by the top-1 chain to that depth; else a dynamic tree. Either is gated by
    tree.min_path_prob as any other tree is."""
    gate = tree.min_path_prob or 0.0
    tree = resolve_search(tree)  # depth and top_k left None: their defaults
    if head.fallback_tree is None:
        return DynamicTreeSpec(tree.depth, tree.top_k, tree.total_tokens, gate)
    limit = head.max_draft_depth(head.spec)
    paths = {tuple(p) for p in head.fallback_tree if limit is None or len(p) <= limit}
    if limit is not None:
        paths |= {tuple(p) for p in chain_paths(limit)}
    return static_tree(sorted(paths), gate)


def stored_dynamic(head) -> dict | None:
    """The dynamic tree a head's calibration chose over its static tree (bench/calibrate.py's
    record: "policy": "dynamic"), else None."""
    calibration = getattr(head, "calibration", None) or {}
    return calibration.get("dynamic") if calibration.get("policy") == "dynamic" else None


def min_path_prob_for(head, tree: TreeConfig) -> float:
    """tree.min_path_prob, else the one calibrated with the head's stored tree (tree=default only:
    it belongs to that tree), else 0 (every level drafted)."""
    if tree.min_path_prob is not None:
        return tree.min_path_prob
    dynamic = stored_dynamic(head) if tree.kind == "default" else None
    if dynamic is not None:
        return float(dynamic["min_path_prob"])
    if tree.kind == "default" and getattr(head, "default_tree", None):
        return float(((getattr(head, "calibration", None) or {}).get("min_path_prob")) or 0.0)
    return 0.0


def tree_policy_for(head, tree: TreeConfig) -> TreePolicy:
    """The tree to draft: tree.kind, or for `default` the head's calibrated dynamic tree or stored
    tree, else a family default."""
    tree = resolve_search(tree)  # depth and top_k left None: their defaults
    kind = tree.kind
    gate = min_path_prob_for(head, tree)
    if kind == "static":
        if not tree.paths:
            raise SpecHeadsError("tree=static needs tree.paths, e.g. 'tree.paths=[[0],[1],[0,0]]'")
        policy: TreePolicy = static_tree(tree.paths, gate)
    elif kind == "chain":
        policy = static_tree(chain_paths(tree.depth), gate)
    elif kind == "dynamic":
        policy = DynamicTreeSpec(tree.depth, tree.top_k, tree.total_tokens, gate)
    elif kind == "default" and stored_dynamic(head) is not None:
        dyn = stored_dynamic(head)
        policy = DynamicTreeSpec(dyn["depth"], dyn["top_k"], dyn["total_tokens"], gate)
    elif kind == "default":
        policy = static_tree(head.default_tree, gate) if head.default_tree else fallback_policy(head, tree)
    else:
        raise SpecHeadsError(f"tree.kind={kind} is resolved by calibration, not here")
    check_depth(head, policy)
    return policy


TEXT_SOURCES = ("suffix", "ngram")
DEFAULT_NGRAM_NODES = 8  # text-continuation nodes of a hybrid tree that no calibration chose
# text-alone nodes after a repeated ngram_max-gram that no calibration chose: 8 measured best of
# hybrid's uncalibrated settings on the dev MT-bench (BENCHMARKS.md)
DEFAULT_TEXT_ALONE = 8


@dataclass(frozen=True)
class HybridPolicy:
    """The hybrid drafter's budget: the head's tree (None: no head drafting) and at most
    `ngram_nodes` nodes continuing the text's last n-gram (n <= ngram_max) where it occurred before."""

    head: TreePolicy | None
    ngram_nodes: int = DEFAULT_NGRAM_NODES
    ngram_max: int = 3
    # > 0: a step whose last alone_ngram (or more, up to ngram_max) tokens occurred earlier in the
    # text drafts the text's continuations alone, text_alone nodes at most: no head drafting
    text_alone: int = 0
    alone_ngram: int = 0  # 0: ngram_max
    # where the text's continuations come from: ngram = prompt lookup's matches of the last n-gram
    # (n <= ngram_max), most recent first; suffix = decode/suffix.py's frequency-scored continuations
    # of the longest repeated suffix (up to suffix_match tokens), with up to suffix_history tokens of
    # the process's earlier answers indexed too
    source: str = "ngram"
    suffix_match: int = 8
    suffix_history: int = 0
    # None: the fixed split above (ngram_nodes merged, text_alone after a repeat); else each step's
    # choice by decode/hybrid_rule.py from these calibrated numbers (the suffix source only)
    rule: RuleParams | None = None

    def __post_init__(self):
        if self.alone_ngram == 0:
            object.__setattr__(self, "alone_ngram", self.ngram_max)
        trigger_max = self.suffix_match if self.source == "suffix" else self.ngram_max
        if not 1 <= self.alone_ngram <= trigger_max:
            raise SpecHeadsError(f"the text-alone trigger must be 1..{trigger_max} tokens, got {self.alone_ngram}")
        if self.source not in TEXT_SOURCES:
            raise SpecHeadsError(f"the text source must be one of {', '.join(TEXT_SOURCES)}, got {self.source!r}")
        if self.rule is not None and self.source != "suffix":
            raise SpecHeadsError("the adaptive hybrid rule needs tree.text_source=suffix")


def hybrid_policy_for(head, tree: TreeConfig) -> HybridPolicy:
    """The hybrid tree to draft. tree=auto's split (tree.hybrid_paths with their gate
    tree.hybrid_min_path_prob, tree.ngram_nodes and the text-alone rule, set by calibration) first;
    with tree=default, the split stored with the head's calibration, its head part gated as the
    calibration scored it (the record's min_path_prob); else the head's own tree (tree_policy_for)
    and tree.ngram_nodes text nodes. A setting given explicitly (tree.min_path_prob included) wins
    over a stored one. Without a head: text only."""
    stored = ((getattr(head, "calibration", None) or {}).get("hybrid") or {}) if head is not None else {}
    nodes, alone, alone_ngram = tree.ngram_nodes, tree.text_alone, tree.text_alone_ngram
    gate = tree.min_path_prob
    if tree.hybrid_paths is not None:
        paths = tree.hybrid_paths
        gate = tree.hybrid_min_path_prob if tree.hybrid_min_path_prob is not None else gate
    elif tree.kind == "default" and stored.get("paths") is not None:
        paths = stored["paths"]
        gate = stored.get("min_path_prob") if gate is None else gate
        nodes = stored.get("ngram_nodes") if nodes is None else nodes
        alone = stored.get("text_alone") if alone is None else alone
        alone_ngram = stored.get("text_alone_ngram") if alone_ngram is None else alone_ngram
    else:
        paths = None
    rule = stored_rule(stored, tree) if head is not None else None
    if rule is not None:  # the rule drafts the head's tree it was fitted with, under its gate
        paths = stored["rule"]["paths"]
        gate = tree.min_path_prob if tree.min_path_prob is not None else stored["rule"].get("min_path_prob", 0.0)
    if head is None:
        policy = None
    elif paths is not None:
        # [] : the calibration gave the head no node
        policy = static_tree(paths, float(gate or 0.0)) if paths else None
        if policy is not None:
            check_depth(head, policy)
    else:
        policy = tree_policy_for(head, tree)
    nodes = DEFAULT_NGRAM_NODES if nodes is None else int(nodes)
    alone = DEFAULT_TEXT_ALONE if alone is None else int(alone)
    source = tree.text_source
    trigger_max = tree.suffix_match if source == "suffix" else tree.ngram_max
    alone_ngram = tree.ngram_max if alone_ngram is None else min(int(alone_ngram), trigger_max)
    return HybridPolicy(
        policy,
        nodes,
        tree.ngram_max,
        alone,
        alone_ngram,
        source=source,
        suffix_match=tree.suffix_match,
        suffix_history=tree.suffix_history,
        rule=rule,
    )


def stored_rule(stored_hybrid: dict, tree: TreeConfig) -> RuleParams | None:
    """The adaptive rule calibrated with the hybrid split in use (tree.hybrid_rule=adaptive, the
    suffix source, and a split from the same calibration: tree=default's stored one or the one
    tree=auto just chose), else None: the fixed split."""
    record = stored_hybrid.get("rule")
    same_split = tree.kind == "default" or tree.hybrid_paths is not None
    if tree.hybrid_rule != "adaptive" or tree.text_source != "suffix" or not record or not same_split:
        return None
    return RuleParams.from_record(record)


def describe_text_alone(nodes: int, trigger: int, ngram_max: int) -> str:
    """The text-alone rule in words ("" when off): also how tree=auto reports the rule it chose."""
    if not nodes:
        return ""
    return f"; up to {nodes} text nodes alone after a repeated {trigger}{'+' if trigger < ngram_max else ''}-gram"


def describe_policy(policy: TreePolicy | HybridPolicy) -> str:
    if isinstance(policy, HybridPolicy):
        head = describe_policy(policy.head) if policy.head is not None else "no head"
        if policy.source == "suffix":
            history = f", {policy.suffix_history} tokens of earlier answers" if policy.suffix_history else ""
            source = f"suffix, match <= {policy.suffix_match}{history}"
        else:
            source = f"n-gram <= {policy.ngram_max}"
        if policy.rule is not None:
            budgets = "/".join(str(g) for g in policy.rule.text_budgets if g)
            return f"hybrid, adaptive per step: {head} or not, + 0/{budgets} text nodes ({source})"
        alone = describe_text_alone(policy.text_alone, policy.alone_ngram, policy.ngram_max)
        return f"hybrid: {head} + up to {policy.ngram_nodes} text-continuation nodes ({source}){alone}"
    if isinstance(policy, StaticTree):
        gate = (
            f", a level drafted while a path into it has p >= {policy.min_path_prob:g}" if policy.min_path_prob else ""
        )
        return f"static tree ({policy.size - 1} nodes, depth {policy.layout.max_depth}{gate})"
    floor = f", nodes with p >= {policy.min_path_prob:g}" if policy.min_path_prob else ""
    return f"dynamic tree (depth {policy.depth}, top_k {policy.top_k}, {policy.total_tokens} nodes{floor})"
