"""The tree policy: which tree a drafter grows, from infer.py's tree settings and the head.

A policy is a static tree of rank paths (tree.py) or an EAGLE-2 dynamic tree (DynamicTreeSpec).
`tree.kind=default` takes the dynamic tree the head's calibration chose, else the head's stored
tree, else its family's fallback tree, else a dynamic tree; `auto` is resolved into a tree by
calibration (bench/calibrate.py) first; either way a calibration record becomes tree settings in
one place (tree_config_from).
A hybrid policy (HybridPolicy) adds the continuations of the text's own repeats to a head's tree.
plan_drafts resolves what a run drafts once, into a DraftPlan (the settings as drafted and each
method's policy) that the benchmark's drafters, its report and the demo take; method_policy is
that resolution for one method (the heads and trees a benchmark compares beside the main one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
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
    tree.min_path_prob as any other tree is. `tree`: resolved (resolved_tree)."""
    gate = tree.min_path_prob or 0.0
    if head.fallback_tree is None:
        return DynamicTreeSpec(tree.depth, tree.top_k, tree.total_tokens, gate)
    limit = head.max_draft_depth(head.spec)
    paths = {tuple(p) for p in head.fallback_tree if limit is None or len(p) <= limit}
    if limit is not None:
        paths |= {tuple(p) for p in chain_paths(limit)}
    return static_tree(sorted(paths), gate)


def stored_dynamic(calibration: dict | None) -> dict | None:
    """The dynamic tree a calibration record chose over its static tree (bench/calibrate.py's
    record: "policy": "dynamic"), else None."""
    calibration = calibration or {}
    return calibration.get("dynamic") if calibration.get("policy") == "dynamic" else None


def dynamic_from(record: dict, gate: float | None = None) -> DynamicTreeSpec:
    """A record's dynamic tree (depth, top_k, total_tokens, min_path_prob), under `gate` if given."""
    floor = record.get("min_path_prob") if gate is None else gate
    return DynamicTreeSpec(int(record["depth"]), int(record["top_k"]), int(record["total_tokens"]), float(floor or 0.0))


def tree_config_from(t: TreeConfig, paths: list | None, record: dict) -> TreeConfig:
    """The tree settings a calibration record has a run draft (tree=auto's own run, and tree=default
    through stored_settings): its dynamic tree (policy dynamic) or its static tree `paths` (its
    default_tree; none: t's kind stays) under its gate, and its hybrid split. A setting given
    explicitly (tree.min_path_prob, the split's keys) stays."""
    dynamic = stored_dynamic(record)
    if dynamic:
        chosen = {k: dynamic[k] for k in ("depth", "top_k", "total_tokens")} | {"kind": "dynamic"}
        chosen["min_path_prob"] = float(dynamic.get("min_path_prob") or 0.0)
    elif paths:
        chosen = {"kind": "static", "min_path_prob": float(record.get("min_path_prob") or 0.0)}
    else:  # no stored tree: tree=default drafts the family's fallback
        chosen = {}
    hybrid = record.get("hybrid") or {}
    gate = float(hybrid.get("min_path_prob") or 0.0)
    if t.min_path_prob is not None:
        chosen["min_path_prob"] = gate = t.min_path_prob
    if t.hybrid_paths is None:  # a split given by hand keeps its own gate, text nodes and rule
        chosen["hybrid_paths"] = hybrid.get("paths")
        chosen["hybrid_min_path_prob"] = gate if hybrid.get("paths") is not None else None
        for k in ("ngram_nodes", "text_alone", "text_alone_ngram"):
            chosen[k] = hybrid.get(k) if getattr(t, k) is None else getattr(t, k)
    return dataclasses.replace(t, **chosen, paths=paths)  # paths: the stored default_tree, chosen or not


def stored_settings(head, tree: TreeConfig) -> TreeConfig:
    """tree=default as the settings the head's stored tree and calibration make (tree_config_from:
    read as tree=auto hands its record to its run); any other kind as given."""
    if tree.kind != "default" or head is None:
        return tree
    return tree_config_from(tree, getattr(head, "default_tree", None), getattr(head, "calibration", None) or {})


def named_tree(tree: TreeConfig) -> TreePolicy:
    """The tree the settings name outright (tree=static's paths, a chain of tree.depth, a dynamic
    tree), gated by tree.min_path_prob (0 unless set)."""
    gate = tree.min_path_prob or 0.0
    if tree.kind == "static":
        if not tree.paths:
            raise SpecHeadsError("tree=static needs tree.paths, e.g. 'tree.paths=[[0],[1],[0,0]]'")
        return static_tree(tree.paths, gate)
    if tree.kind == "chain":
        return static_tree(chain_paths(tree.depth), gate)
    if tree.kind == "dynamic":
        return DynamicTreeSpec(tree.depth, tree.top_k, tree.total_tokens, gate)
    raise SpecHeadsError(f"tree.kind={tree.kind} is resolved by calibration, not here")


def resolved_tree(head, tree: TreeConfig) -> TreeConfig:
    """The tree settings a head drafts: the head's stored calibration merged in (tree=default,
    stored_settings) and the search keys left None filled (resolve_search: depth and top_k their
    defaults)."""
    return resolve_search(stored_settings(head, tree))


def head_tree(head, tree: TreeConfig) -> TreePolicy:
    """The tree a head drafts under resolved settings (resolved_tree): tree.kind, or for `default`
    (no stored tree) its family's fallback."""
    policy = fallback_policy(head, tree) if tree.kind == "default" else named_tree(tree)
    check_depth(head, policy)
    return policy


def tree_policy_for(head, tree: TreeConfig) -> TreePolicy:
    """The tree to draft: tree.kind, or for `default` the head's calibrated dynamic tree or stored
    tree, else a family default."""
    return head_tree(head, resolved_tree(head, tree))


def model_tree_policy(tree: TreeConfig) -> TreePolicy:
    """The tree a model drafting for the target grows (a draft model; the target skipping layers):
    tree=default and tree=chain the top-1 chain of tree.depth tokens (5 unless set), tree=static
    its rank paths, tree=dynamic an EAGLE-2 tree, each gated by tree.min_path_prob (0 unless set)
    as a head's is. tree=auto calibrates heads only."""
    return model_tree(resolve_search(tree))


def model_tree(tree: TreeConfig) -> TreePolicy:
    """model_tree_policy under settings whose search keys are resolved (resolve_search)."""
    if tree.kind == "auto":
        raise SpecHeadsError("a draft model drafts tree=default, chain, static or dynamic, not tree=auto")
    return named_tree(dataclasses.replace(tree, kind="chain") if tree.kind == "default" else tree)


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
    alone_ngram: int = 0  # 0: ngram_max (at most trigger_max)
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
            object.__setattr__(self, "alone_ngram", min(self.ngram_max, self.trigger_max))
        if not 1 <= self.alone_ngram <= self.trigger_max:
            raise SpecHeadsError(f"the text-alone trigger must be 1..{self.trigger_max} tokens, got {self.alone_ngram}")
        if self.source not in TEXT_SOURCES:
            raise SpecHeadsError(f"the text source must be one of {', '.join(TEXT_SOURCES)}, got {self.source!r}")
        if self.rule is not None and self.source != "suffix":
            raise SpecHeadsError("the adaptive hybrid rule needs tree.text_source=suffix")

    @property
    def trigger_max(self) -> int:
        """The longest repeat the source matches: the longest text-alone trigger."""
        return self.suffix_match if self.source == "suffix" else self.ngram_max


Policy = TreePolicy | HybridPolicy


# what a calibrated hybrid split stores of its text source (as the tree settings name them)
TEXT_SETTINGS = ("text_source", "ngram_max", "suffix_match", "suffix_history")


def text_settings(tree: TreeConfig, stored: dict | None = None) -> dict:
    """The text source's settings: a calibrated split's own (`stored`, its record: what it was
    scored with) where it has them, else the tree settings'."""
    return {k: (stored or {}).get(k, getattr(tree, k)) for k in TEXT_SETTINGS}


def text_policy(tree: TreeConfig, stored: dict | None = None) -> HybridPolicy:
    """The text drafter alone, its source resolved by text_settings: the one tree=auto steps along
    its answers to score a split, and the source hybrid_policy_for drafts that split with."""
    s = text_settings(tree, stored)
    return HybridPolicy(
        None,
        ngram_max=int(s["ngram_max"]),
        source=s["text_source"],
        suffix_match=int(s["suffix_match"]),
        suffix_history=int(s["suffix_history"]),
    )


def alone_trigger(text: HybridPolicy, given: int | None) -> int:
    """The text-alone trigger drafted: the one given (stored or asked for), as long as the source
    matches at most; none given: the text policy's own."""
    return text.alone_ngram if given is None else min(int(given), text.trigger_max)


def calibrated_split(tree: TreeConfig) -> bool:
    """Whether the hybrid split drafted is the head's calibration's: tree=default's stored one, or
    the one tree=auto just chose (tree.hybrid_paths)."""
    return tree.kind == "default" or tree.hybrid_paths is not None


def hybrid_policy_for(head, tree: TreeConfig) -> HybridPolicy:
    """The hybrid tree to draft: the split of the settings (tree.hybrid_paths with their gate
    tree.hybrid_min_path_prob, tree.ngram_nodes and the text-alone rule), which tree=auto sets and
    tree=default reads from the head's calibration (stored_settings); without a split, the head's
    own tree (tree_policy_for) and tree.ngram_nodes text nodes. A setting given explicitly
    (tree.min_path_prob included) wins over a stored one, except the text source: a calibrated
    split drafts from the one it was scored with (text_policy: its record's, where stored).
    Without a head: text only."""
    return head_and_text(head, tree.min_path_prob, resolved_tree(head, tree))


def head_and_text(head, given_gate: float | None, tree: TreeConfig) -> HybridPolicy:
    """hybrid_policy_for under resolved settings (resolved_tree); `given_gate`: tree.min_path_prob
    as given, before the head's calibration set one (it overrides an adaptive rule's gate)."""
    stored = ((getattr(head, "calibration", None) or {}).get("hybrid") or {}) if head is not None else {}
    paths = tree.hybrid_paths
    gate = tree.hybrid_min_path_prob if tree.hybrid_min_path_prob is not None else tree.min_path_prob
    text = text_policy(tree, stored if calibrated_split(tree) else None)
    rule = stored_rule(stored, tree, text.source) if head is not None else None
    if head is None:
        policy = None
    elif rule is not None:  # the rule drafts the head's tree it was fitted with, under its gate
        policy = rule_tree(stored["rule"], given_gate)
    elif paths is not None:  # [] : the calibration gave the head no node
        policy = static_tree(paths, float(gate or 0.0)) if paths else None
    else:
        policy = head_tree(head, tree)
    if policy is not None:
        check_depth(head, policy)
    nodes = DEFAULT_NGRAM_NODES if tree.ngram_nodes is None else int(tree.ngram_nodes)
    alone = DEFAULT_TEXT_ALONE if tree.text_alone is None else int(tree.text_alone)
    return dataclasses.replace(
        text,
        head=policy,
        ngram_nodes=nodes,
        text_alone=alone,
        alone_ngram=alone_trigger(text, tree.text_alone_ngram),
        rule=rule,
    )


def rule_tree(record: dict, gate: float | None) -> TreePolicy | None:
    """The head tree an adaptive rule (its record) was fitted with, under its own gate unless `gate`
    is given: the calibrated dynamic tree, drafted as spec drafts it, else static paths ([]: none)."""
    if record.get("dynamic"):
        return dynamic_from(record["dynamic"], gate)
    paths = record.get("paths") or []
    floor = record.get("min_path_prob") if gate is None else gate
    return static_tree(paths, float(floor or 0.0)) if paths else None


def stored_rule(stored_hybrid: dict, tree: TreeConfig, source: str) -> RuleParams | None:
    """The adaptive rule calibrated with the hybrid split in use (tree.hybrid_rule=adaptive, the
    suffix source drafting, and a split from the same calibration: calibrated_split), else None:
    the fixed split."""
    record = stored_hybrid.get("rule")
    if tree.hybrid_rule != "adaptive" or source != "suffix" or not record or not calibrated_split(tree):
        return None
    return RuleParams.from_record(record)


@dataclass(frozen=True)
class DraftPlan:
    """What a run drafts, resolved once: the tree settings (tree.*, or the ones tree=auto just
    chose) with the head's stored calibration merged in and the search defaults filled, and each
    drafting method's policy under them. The benchmark's drafters, its report, the assistant's draft
    length and the demo all take it, so no setting is resolved again downstream."""

    given: TreeConfig  # the tree settings as given: an explicit key wins over a stored one
    tree: TreeConfig  # as the head drafts them (resolved_tree)
    policies: tuple[tuple[str, Policy], ...]  # (method, what it drafts), in the order asked

    def policy(self, method: str) -> Policy:
        for m, policy in self.policies:
            if m == method:
                return policy
        raise SpecHeadsError(f"method {method} was not planned (planned: {', '.join(m for m, _ in self.policies)})")


def plan_drafts(head, tree: TreeConfig, methods: Iterable[str], text_nodes: int = DEFAULT_NGRAM_NODES) -> DraftPlan:
    """The DraftPlan of `methods` under these tree settings: the one place a setting (and the head's
    stored calibration, stored_settings) becomes a policy. spec: the head's tree; hybrid: the head's
    tree and the text's repeats; lookup and suffix: that text source alone, text_nodes nodes
    (bench.prompt_lookup_num_tokens); draft and skip: a model drafting for the target (a draft
    model; the target skipping layers given by hand), from the settings alone."""
    searched = resolve_search(tree)  # the search keys commute with the stored calibration's merge
    drafted = stored_settings(head, searched)
    policies = tuple((m, planned_policy(head, tree, searched, drafted, m, text_nodes)) for m in methods)
    return DraftPlan(tree, drafted, policies)


def planned_policy(
    head, given: TreeConfig, searched: TreeConfig, drafted: TreeConfig, method: str, text_nodes: int
) -> Policy:
    """One method's policy of plan_drafts: `searched` the settings' own (resolve_search), `drafted`
    with the head's calibration merged in (resolved_tree)."""
    if method == "spec":
        return head_tree(head, drafted)
    if method == "hybrid":
        return head_and_text(head, given.min_path_prob, drafted)
    if method == "lookup":
        return HybridPolicy(None, text_nodes, given.ngram_max)
    if method == "suffix":
        t = given
        return HybridPolicy(
            None, text_nodes, t.ngram_max, source="suffix", suffix_match=t.suffix_match, suffix_history=t.suffix_history
        )
    if method in ("draft", "skip"):
        return model_tree(searched)
    raise SpecHeadsError(f"method {method} drafts no tree of its own")


def method_policy(head, tree: TreeConfig, method: str, text_nodes: int = DEFAULT_NGRAM_NODES) -> Policy:
    """What one benchmark method drafts under these tree settings (plan_drafts, for that method)."""
    return plan_drafts(head, tree, (method,), text_nodes).policy(method)


def describe_text_alone(nodes: int, trigger: int, ngram_max: int) -> str:
    """The text-alone rule in words ("" when off): also how tree=auto reports the rule it chose."""
    if not nodes:
        return ""
    return f"; up to {nodes} text nodes alone after a repeated {trigger}{'+' if trigger < ngram_max else ''}-gram"


def describe_source(policy: HybridPolicy) -> str:
    """The text source in words: also how tree=auto reports the source it scored a split with."""
    if policy.source == "suffix":
        history = f", {policy.suffix_history} tokens of earlier answers" if policy.suffix_history else ""
        return f"suffix, match <= {policy.suffix_match}{history}"
    return f"n-gram <= {policy.ngram_max}"


def describe_policy(policy: Policy) -> str:
    if isinstance(policy, HybridPolicy):
        head = describe_policy(policy.head) if policy.head is not None else "no head"
        source = describe_source(policy)
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
