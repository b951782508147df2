"""The tree policy: tree.kind and the head decide the tree; the Medusa default tree has one source."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specheads.config.infer import InferJobConfig, TreeConfig, validate
from specheads.config.train import HeadConfig
from specheads.decode.drafters import EagleDrafter, MedusaDrafter, make_drafter
from specheads.decode.policy import (
    DEFAULT_NGRAM_NODES,
    DynamicTreeSpec,
    HybridPolicy,
    describe_policy,
    hybrid_policy_for,
    model_tree_policy,
    tree_policy_for,
)
from specheads.decode.tree import StaticTree, chain_paths, static_tree
from specheads.errors import SpecHeadsError
from specheads.heads import MedusaHead, build_head

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_tree_policies(tiny_target):
    medusa = build_head(HeadConfig(family="medusa", num_heads=2), tiny_target)
    policy = tree_policy_for(medusa, TreeConfig(kind="default"))
    assert isinstance(policy, StaticTree) and policy.layout.max_depth == 2
    with pytest.raises(SpecHeadsError, match="Medusa head drafts at most 2 deep"):
        tree_policy_for(medusa, TreeConfig(kind="chain", depth=3))
    eagle = build_head(HeadConfig(family="eagle"), tiny_target)
    assert tree_policy_for(eagle, TreeConfig(kind="dynamic", total_tokens=7)).total_tokens == 7
    assert isinstance(tree_policy_for(eagle, TreeConfig(kind="default")), DynamicTreeSpec)
    eagle.default_tree = [[0], [1], [0, 0]]
    assert tree_policy_for(eagle, TreeConfig(kind="default")).size == 4
    with pytest.raises(SpecHeadsError, match="paths"):
        tree_policy_for(eagle, TreeConfig(kind="static"))
    with pytest.raises(SpecHeadsError, match="calibration"):
        tree_policy_for(eagle, TreeConfig(kind="auto"))


def test_the_medusa_default_tree_has_one_source(tiny_target):
    """MedusaHead.fallback_tree is the tree; no conf/tree preset repeats it."""
    paths = [list(p) for p in MedusaHead.fallback_tree]
    three = build_head(HeadConfig(family="medusa", num_heads=3), tiny_target)
    assert tree_policy_for(three, TreeConfig(kind="default")).paths == static_tree(paths).paths
    # a deeper head: the same tree plus the top-1 chain down to its last head
    five = build_head(HeadConfig(family="medusa", num_heads=5), tiny_target)
    deeper = tree_policy_for(five, TreeConfig(kind="default")).paths
    assert set(deeper) == {tuple(p) for p in paths + chain_paths(5)}
    for preset in sorted((CONF / "tree").glob("*.yaml")):
        stored = OmegaConf.load(preset).get("paths")
        assert not stored or sorted(map(tuple, stored)) != sorted(map(tuple, paths)), preset


def test_a_draft_model_drafts_the_tree_the_settings_name():
    assert model_tree_policy(TreeConfig()) == static_tree(chain_paths(5))
    assert model_tree_policy(TreeConfig(kind="chain", depth=3)) == static_tree(chain_paths(3))
    assert model_tree_policy(TreeConfig(kind="static", paths=[[0], [1]])) == static_tree([[0], [1]])
    assert model_tree_policy(TreeConfig(kind="dynamic", depth=3, top_k=2, total_tokens=6)) == DynamicTreeSpec(3, 2, 6)
    with pytest.raises(SpecHeadsError, match="not tree=auto"):
        model_tree_policy(TreeConfig(kind="auto"))


def test_the_head_picks_its_drafter_and_its_depth_limit(tiny_target):
    medusa = build_head(HeadConfig(family="medusa", num_heads=2), tiny_target)
    assert isinstance(make_drafter(medusa, static_tree(chain_paths(2))), MedusaDrafter)
    with pytest.raises(SpecHeadsError, match="3 deep"):
        make_drafter(medusa, static_tree(chain_paths(3)))
    eagle3 = build_head(HeadConfig(family="eagle3"), tiny_target)
    assert isinstance(make_drafter(eagle3, static_tree(chain_paths(9))), EagleDrafter)


def test_describe_policy():
    assert describe_policy(static_tree([[0], [1], [0, 0]])) == "static tree (3 nodes, depth 2)"
    assert describe_policy(DynamicTreeSpec(4, 3, 12)) == "dynamic tree (depth 4, top_k 3, 12 nodes)"
    assert (
        describe_policy(DynamicTreeSpec(4, 3, 12, 0.05))
        == "dynamic tree (depth 4, top_k 3, 12 nodes, nodes with p >= 0.05)"
    )


def test_hybrid_policies(tiny_target):
    """The hybrid split: tree=auto's, else the one stored with the head's calibration under
    tree=default, else the head's own tree and tree.ngram_nodes; text only without a head."""
    eagle = build_head(HeadConfig(family="eagle"), tiny_target)
    suffix = {"source": "suffix", "suffix_match": 8, "suffix_history": 16384}  # the default text source
    assert hybrid_policy_for(None, TreeConfig()) == HybridPolicy(None, DEFAULT_NGRAM_NODES, 3, 8, **suffix)
    ngram = hybrid_policy_for(None, TreeConfig(text_source="ngram"))
    assert (ngram.source, ngram.rule) == ("ngram", None)
    plain = hybrid_policy_for(eagle, TreeConfig(kind="chain", depth=2, ngram_nodes=5, ngram_max=2, text_alone=0))
    assert plain == HybridPolicy(static_tree(chain_paths(2)), 5, 2, 0, **suffix)
    eagle.calibration = {"hybrid": {"paths": [[0], [1]], "ngram_nodes": 6}}
    stored = hybrid_policy_for(eagle, TreeConfig(kind="default"))
    assert stored.head.paths == ((0,), (1,)) and stored.ngram_nodes == 6
    assert (stored.text_alone, stored.alone_ngram) == (8, 3)  # a record from before the text-alone rule
    eagle.calibration["hybrid"].update(text_alone=12, text_alone_ngram=2)
    stored = hybrid_policy_for(eagle, TreeConfig(kind="default"))
    assert (stored.text_alone, stored.alone_ngram) == (12, 2)
    given = hybrid_policy_for(eagle, TreeConfig(kind="default", text_alone=0, text_alone_ngram=1))
    assert (given.text_alone, given.alone_ngram) == (0, 1)  # what is asked for wins over the record
    assert hybrid_policy_for(eagle, TreeConfig(kind="default", ngram_nodes=2)).ngram_nodes == 2
    assert hybrid_policy_for(eagle, TreeConfig(kind="chain", depth=3)).head.size == 4  # asked for: not the stored one
    auto = hybrid_policy_for(eagle, TreeConfig(kind="static", paths=[[0]], hybrid_paths=[], ngram_nodes=4))
    assert auto == HybridPolicy(None, 4, 3, 8, **suffix)  # calibration gave the head no node
    assert "hybrid: no head + up to 4 text" in describe_policy(auto)
    assert describe_policy(hybrid_policy_for(eagle, TreeConfig(kind="chain", depth=2))).endswith(
        "; up to 8 text nodes alone after a repeated 3-gram"
    )
    assert describe_policy(given).endswith(
        "text-continuation nodes (suffix, match <= 8, 16384 tokens of earlier answers)"
    )
    assert describe_policy(HybridPolicy(None, 4, 3)).endswith("text-continuation nodes (n-gram <= 3)")
    assert describe_policy(HybridPolicy(None, 4, 3, 6, 2)).endswith("up to 6 text nodes alone after a repeated 2+-gram")
    with pytest.raises(SpecHeadsError, match="text_alone"):
        validate(InferJobConfig(tree=TreeConfig(text_alone=-1)))
    with pytest.raises(SpecHeadsError, match="text_alone_ngram"):
        validate(InferJobConfig(tree=TreeConfig(text_alone_ngram=9)))
    with pytest.raises(SpecHeadsError, match="text_alone_ngram"):
        validate(InferJobConfig(tree=TreeConfig(text_alone_ngram=4, text_source="ngram")))
    for bad in ({"text_source": "trie"}, {"hybrid_rule": "always"}, {"suffix_match": 0}, {"suffix_history": -1}):
        with pytest.raises(SpecHeadsError, match=next(iter(bad))):
            validate(InferJobConfig(tree=TreeConfig(**bad)))
    with pytest.raises(SpecHeadsError, match="trigger"):
        HybridPolicy(None, 4, 2, 6, 3)
    assert "static tree (2 nodes" in describe_policy(stored)


def test_a_stored_hybrid_split_is_drafted_under_the_gate_it_was_calibrated_with(tiny_target):
    """The hybrid record's min_path_prob gates its head part (tree=default), tree=auto's split
    carries its own (tree.hybrid_min_path_prob); tree.min_path_prob given explicitly wins over a
    stored one; a record from before the gate was stored was scored ungated, and is drafted so."""
    eagle = build_head(HeadConfig(family="eagle"), tiny_target)
    eagle.default_tree = [[0], [1]]
    eagle.calibration = {"min_path_prob": 0.05, "hybrid": {"paths": [[0], [0, 0], [1]], "min_path_prob": 0.2}}
    assert hybrid_policy_for(eagle, TreeConfig(kind="default")).head.min_path_prob == 0.2
    assert tree_policy_for(eagle, TreeConfig(kind="default")).min_path_prob == 0.05  # the head's tree: its own gate
    assert hybrid_policy_for(eagle, TreeConfig(kind="default", min_path_prob=0.1)).head.min_path_prob == 0.1
    del eagle.calibration["hybrid"]["min_path_prob"]
    assert hybrid_policy_for(eagle, TreeConfig(kind="default")).head.min_path_prob == 0.0
    auto = TreeConfig(
        kind="static", paths=[[0]], min_path_prob=0.05, hybrid_paths=[[0], [0, 0]], hybrid_min_path_prob=0.3
    )
    assert hybrid_policy_for(eagle, auto).head.min_path_prob == 0.3
    auto.hybrid_min_path_prob = None  # a split given by hand: the tree's gate, as before
    assert hybrid_policy_for(eagle, auto).head.min_path_prob == 0.05


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_an_explicit_min_path_prob_gates_the_fallback_tree(tiny_target, family):
    """A head with no stored tree drafts its family's fallback tree: tree.min_path_prob gates it as
    it gates every other tree, and the description says so."""
    head = build_head(HeadConfig(family=family, num_heads=3), tiny_target)
    assert not head.default_tree
    policy = tree_policy_for(head, TreeConfig(kind="default", min_path_prob=0.05))
    assert isinstance(policy, StaticTree) and policy.min_path_prob == 0.05
    assert "p >= 0.05" in describe_policy(policy)
    assert tree_policy_for(head, TreeConfig(kind="default")).min_path_prob == 0.0


def test_a_plan_resolves_the_settings_once_and_drafts_what_each_method_resolves(tiny_target, monkeypatch):
    """plan_drafts merges the head's calibration into the tree settings once for every method it
    plans, into one frozen DraftPlan, and each method's policy is the one method_policy resolves."""
    import dataclasses

    import specheads.decode.policy as policy

    eagle = build_head(HeadConfig(family="eagle"), tiny_target)
    eagle.default_tree = [[0], [1]]
    eagle.calibration = {"min_path_prob": 0.05, "hybrid": {"paths": [[0], [0, 0]], "min_path_prob": 0.2}}
    methods = ("spec", "hybrid", "lookup", "suffix", "draft")
    expected = {m: policy.method_policy(eagle, TreeConfig(), m, 6) for m in methods}
    real, merged = policy.stored_settings, []
    monkeypatch.setattr(policy, "stored_settings", lambda head, tree: merged.append(tree) or real(head, tree))
    plan = policy.plan_drafts(eagle, TreeConfig(), methods, 6)
    assert len(merged) == 1 and plan.tree.kind == "static" and plan.tree.min_path_prob == 0.05
    assert {m: plan.policy(m) for m in methods} == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tree = TreeConfig()
    with pytest.raises(SpecHeadsError, match="not planned"):
        plan.policy("skip")
