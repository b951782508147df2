import random

import pytest
import torch
from conftest import fails_for_some_seed

from specheads.decode.tree import (
    FROM_HEAD,
    FROM_TEXT,
    TreeLayout,
    chain_paths,
    full_paths,
    merge_chains,
    pruned_tree,
    select_dynamic,
    static_tree,
)
from specheads.errors import SpecHeadsError


def test_medusa_worked_example():
    # medusa.md section 4.2: choices [[0],[0,0],[1],[0,1]]
    tree = static_tree([[0], [0, 0], [1], [0, 1]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1))
    assert tree.layout.parents == (-1, 0, 0, 1, 1)
    assert tree.layout.depths == (0, 1, 1, 2, 2)
    assert tree.ranks == (-1, 0, 1, 0, 1)
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(tree.layout.mask, expected)
    assert sorted(tree.layout.retrieve.tolist()) == sorted([[0, 1, 4], [0, 1, 3], [0, 2, -1]])
    assert tree.layout.position_offsets().tolist() == [0, 1, 1, 2, 2]


def random_layout(rng: random.Random, n: int) -> TreeLayout:
    return TreeLayout(tuple([-1] + [rng.randrange(i) for i in range(1, n)]))


@pytest.mark.parametrize("seed", range(5))
def test_mask_is_ancestor_closure(seed):
    rng = random.Random(seed)
    layout = random_layout(rng, rng.randint(1, 30))
    for i in range(layout.size):
        ancestors = set(layout.path_to(i))
        assert set(torch.nonzero(layout.mask[i]).flatten().tolist()) == ancestors
        assert layout.depths[i] == len(ancestors) - 1
    # every leaf has exactly one retrieve row, and every node lies on some row
    rows = layout.retrieve.tolist()
    assert len(rows) == len(layout.leaves)
    assert {n for r in rows for n in r if n >= 0} == set(range(layout.size))
    for r in rows:
        nodes = [n for n in r if n >= 0]
        assert nodes == layout.path_to(nodes[-1])


def test_chain_and_full_trees():
    chain = static_tree(chain_paths(4))
    assert chain.layout.parents == (-1, 0, 1, 2, 3)
    assert chain.layout.retrieve.tolist() == [[0, 1, 2, 3, 4]]
    full = static_tree(full_paths(2, 3))
    assert full.size == 1 + 3 + 9
    assert [len(c) for c in full.layout.children[:4]] == [3, 3, 3, 3]


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0, 0]], "prefix"),
        ([], "at least one"),
        ([[0], [0]], "repeat"),
        ([[0], [-1]], "ranks"),
        ("abc", "list"),
    ],
)
def test_bad_static_trees(paths, message):
    with pytest.raises(SpecHeadsError, match=message):
        static_tree(paths)


def test_layout_rejects_children_before_parents():
    with pytest.raises(ValueError):
        TreeLayout((-1, 2, 0))


def random_candidates(rng):
    """Up to 40 candidates in creation order, each a child of the root (-1) or of an earlier one,
    scored as cumulative log-probabilities; a fifth add exactly 0 (ties with their parent, which
    the tie rule must keep)."""
    parents, scores = [], []
    for i in range(rng.randint(1, 40)):
        p = rng.randrange(-1, i)
        parents.append(p)
        scores.append((0.0 if p == -1 else scores[p]) + (0.0 if rng.random() < 0.2 else -rng.random()))
    return parents, scores


def assert_connected(kept, parents, layout):
    """Tree node j + 1 is candidate kept[j], hung below its parent's node (the root for -1)."""
    for j, c in enumerate(kept, start=1):
        p = parents[c]
        assert layout.parents[j] == (0 if p == -1 else kept.index(p) + 1)


@pytest.mark.parametrize("seed", range(10))
def test_select_dynamic_keeps_a_connected_top_set(seed):
    rng = random.Random(seed)
    parents, scores = random_candidates(rng)
    total = rng.randint(0, len(parents))
    kept, layout = select_dynamic(parents, scores, total)
    assert len(kept) == total and kept == sorted(kept)
    # exactly the `total` best scores (as a multiset)
    assert sorted((scores[c] for c in kept), reverse=True) == sorted(scores, reverse=True)[:total]
    assert_connected(kept, parents, layout)


@pytest.mark.parametrize("seed", range(10))
def test_select_dynamic_with_a_floor_keeps_the_best_above_it(seed):
    rng = random.Random(seed)
    parents, scores = random_candidates(rng)
    total, floor = rng.randint(0, len(parents)), -rng.random() * 3
    kept, layout = select_dynamic(parents, scores, total, floor)
    above = sorted((s for s in scores if s >= floor), reverse=True)
    assert sorted((scores[c] for c in kept), reverse=True) == above[:total]  # a plain top-k over the floor
    assert_connected(kept, parents, layout)
    if above[total:] or len(above) < len(scores):  # the floor or the budget left some out
        assert len(kept) < len(parents)


def test_select_dynamic_prefers_shallow_high_value_nodes():
    # root children a (-0.1), b (-2.0); a's child c (-0.2 total) beats b.
    kept, layout = select_dynamic([-1, -1, 0], [-0.1, -2.0, -0.2], 2)
    assert kept == [0, 2]
    assert layout.parents == (-1, 0, 1)


def token_paths(tokens, layout):
    """Every node's root-to-node token path (root excluded)."""
    return [tuple(tokens[n] for n in layout.path_to(i)[1:]) for i in range(layout.size)]


def random_head_tree(rng: random.Random, vocab: int):
    """A random tree with distinct tokens among siblings, as a drafter makes it."""
    n = rng.randint(1, 12)
    parents, tokens = [-1], [rng.randrange(vocab)]
    for i in range(1, n):
        p = rng.randrange(i)
        used = {tokens[c] for c in range(1, i) if parents[c] == p}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            break
        parents.append(p)
        tokens.append(rng.choice(free))
    return tokens, TreeLayout(tuple(parents))


def check_merge(merge, seed: int) -> None:
    """The merged tree against a plain model of it, the set of token paths: exactly the head's
    paths and every prefix of every chain, each once, the head's nodes unchanged and first among
    their siblings, and each node's sources saying which of the two contains its path."""
    rng = random.Random(seed)
    vocab = 4  # small: chains often share prefixes with each other and with the head's tree
    tokens, layout = random_head_tree(rng, vocab)
    chains = [[rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(0, 4))]
    merged, mlayout, sources = merge(tokens, layout, chains)
    head_paths = set(token_paths(tokens, layout))
    text_paths = {tuple(c[:m]) for c in chains for m in range(1, len(c) + 1)}
    paths = token_paths(merged, mlayout)
    assert len(paths) == len(set(paths)), "two siblings carry the same token"
    assert set(paths) == head_paths | text_paths | {()}
    assert merged[: len(tokens)] == tokens and mlayout.parents[: layout.size] == layout.parents
    for i, path in enumerate(paths[1:], start=1):
        assert bool(sources[i] & FROM_HEAD) == (i < layout.size)
        assert bool(sources[i] & FROM_TEXT) == (path in text_paths)
    for kids in mlayout.children:
        own = [k for k in kids if k < layout.size]
        assert kids[: len(own)] == tuple(own)  # the head's children come first


@pytest.mark.parametrize("seed", range(40))
def test_merge_chains_is_the_union_of_both_trees(seed):
    check_merge(merge_chains, seed)


def drop_a_sibling(tokens, layout, chains):
    """A broken merge: a chain that would give a node a second added child is left out."""
    known = set(token_paths(tokens, layout))
    branched, kept = set(), []
    for c in chains:
        m = next((m for m in range(1, len(c) + 1) if tuple(c[:m]) not in known), None)
        if m is None:
            continue
        if tuple(c[: m - 1]) in branched:
            continue
        branched.add(tuple(c[: m - 1]))
        known |= {tuple(c[:k]) for k in range(1, len(c) + 1)}
        kept.append(c)
    return merge_chains(tokens, layout, kept)


def test_the_merge_check_fails_on_a_merge_that_drops_a_sibling():
    assert fails_for_some_seed(check_merge, drop_a_sibling, range(40))


def test_pruned_trees_are_the_first_nodes_of_the_tree():
    tree = static_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], min_path_prob=0.2)
    assert pruned_tree(tree, 3) is tree
    two = pruned_tree(tree, 2)
    assert two.paths == ((0,), (1,), (0, 0), (1, 0)) and two.min_path_prob == 0.2
    assert two.layout.parents == tree.layout.parents[: two.size]  # numbered level by level
    assert pruned_tree(tree, 1).size == 3


@pytest.mark.parametrize("gate", [-0.1, 1.0])
def test_a_depth_gate_is_a_probability_below_one(gate):
    with pytest.raises(SpecHeadsError, match="min_path_prob"):
        static_tree([[0]], min_path_prob=gate)
