"""Heads compared side by side in one benchmark run.

bench.heads=[DIR, ...]: each runs as the method `spec:<label>` on the same target, questions and
baselines as the main head, with its own stored tree (tree.kind=default; one calibrated for it on
this machine, when the cache holds one), so the ratios of every head come from one run.
bench.head_dtypes=[DTYPE, ...]: the main head loaded again in each precision (infer.py's
head_dtype values), as the method `spec@<dtype>` with the main head's tree: only the drafting
precision differs from method `spec`.
bench.trees=[SPEC, ...]: the main head (the same object) with other trees (config.infer.
parse_tree_spec), as the method `spec#<SPEC>`: only the tree differs from method `spec`.
"""

from __future__ import annotations

from pathlib import Path

from ..config.infer import TreeConfig, parse_tree_spec
from ..decode.drafters import make_drafter
from ..decode.policy import TreePolicy, method_policy
from ..errors import SpecHeadsError
from ..export import is_exported_dir, open_head, resolve_head_path
from ..heads import HEADS, read_head_config
from .trees import use_cached_tree

SPEC = "spec"


def head_label(path: str | Path) -> str:
    """A short name for a head directory: its own name, or its run's name for DIR/head."""
    p = Path(str(path).rstrip("/"))
    return p.parent.name if p.name == "head" and p.parent.name else p.name


def method_name(label: str) -> str:
    return f"{SPEC}:{label}"


def precision_method(name: str) -> str:
    return f"{SPEC}@{name}"


def tree_method(spec: str) -> str:
    return f"{SPEC}#{spec}"


def open_compared_heads(paths: list[str], session) -> dict[str, tuple[object, TreePolicy, str]]:
    """method name -> (drafter, tree policy, head path) for every extra head, checked against the target."""
    target = session.target
    out: dict[str, tuple[object, TreePolicy, str]] = {}
    main_label = head_label(session.head_dir) if session.head_dir else None
    for path in paths:
        directory = resolve_head_path(path)
        if not is_exported_dir(directory):
            config = read_head_config(directory)
            named = (config.get("target") or {}).get("name")
            if named and named != target.info.name:
                raise SpecHeadsError(f"bench.heads: {path} was trained for {named}, not {target.info.name}")
            family = HEADS.get(config.get("family"))
            if family is not None and family.adapts_target:
                # loading it folds its adapter into the shared target, changing every other method's
                raise SpecHeadsError(
                    f"bench.heads: {path} is a {family.title} head, which changes its target; "
                    "benchmark it alone (head=DIR)"
                )
        label = head_label(path)
        if label == main_label or method_name(label) in out:
            raise SpecHeadsError(f"bench.heads: two heads are named {label!r}; give them distinct directory names")
        head = open_head(directory, target, session.allow_target_mismatch)
        session.draft_like_own_head(head)
        if not is_exported_dir(directory):
            use_cached_tree(head, directory, target, kernels=session.layouts is not None)
        policy = method_policy(head, TreeConfig(kind="default"), SPEC)
        out[method_name(label)] = (make_drafter(head, policy), policy, path)
    return out


def open_precision_variants(names: list[str], session, policy: TreePolicy) -> dict[str, tuple[object, TreePolicy, str]]:
    """method name -> (drafter, tree policy, head path): the session's head in each precision."""
    head = session.head
    if head.adapts_target:
        raise SpecHeadsError(
            f"bench.head_dtypes: a {head.title} head changes its target when loaded; benchmark each precision alone"
        )
    out: dict[str, tuple[object, TreePolicy, str]] = {}
    for name in names:
        variant = open_head(session.head_dir, session.target, session.allow_target_mismatch)
        session.draft_like_own_head(variant, name)
        out[precision_method(name)] = (make_drafter(variant, policy), policy, str(session.head_dir))
    return out


def open_tree_variants(specs: list[str], session) -> dict[str, tuple[object, TreePolicy, str]]:
    """method name -> (drafter, tree policy, head path): the session's head drafting each tree."""
    out: dict[str, tuple[object, TreePolicy, str]] = {}
    for spec in specs:
        policy = method_policy(session.head, parse_tree_spec(spec), SPEC)
        out[tree_method(spec)] = (make_drafter(session.head, policy), policy, str(session.head_dir))
    return out
