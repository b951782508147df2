"""The sequential (Hydra) drafter: a node's children come from the head of its depth given the node's
path, one head call per level; with the Hydra++ prefix layer its KV cache follows the committed text."""

import math
import random

import pytest
import torch
from conftest import POLICIES, assert_same_numbers, fails_for_some_seed, hf_greedy, overfit

from specheads.config.infer import TreeConfig
from specheads.config.train import HeadConfig
from specheads.decode.drafters import (
    DraftTable,
    MedusaDrafter,
    SequentialDrafter,
    grow_tree,
    make_drafter,
    make_hybrid_drafter,
    path_tokens,
    text_continuations,
)
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import DynamicTreeSpec, HybridPolicy, tree_policy_for
from specheads.decode.tree import FROM_TEXT, chain_paths, full_paths, static_tree
from specheads.errors import SpecHeadsError
from specheads.heads import MedusaHead, build_head

pytestmark = pytest.mark.usefixtures("one_thread")


def nudged(head, scale=0.05, seed=0):
    """Off the initialisation, whose weights on the path embeddings are zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return head.eval()


def two_parents(root=5):
    """A table: the root with two children (tokens 7 and 9) at depth 1."""
    table = DraftTable()
    table.add(root, -1, 0.0)
    table.add(7, 0, 0.0)
    table.add(9, 0, 0.0)
    return table


def test_hydra_picks_the_sequential_drafter_and_its_depth(tiny_target):
    head = build_head(HeadConfig(family="hydra", num_heads=3), tiny_target)
    assert isinstance(make_drafter(head, static_tree(chain_paths(3))), SequentialDrafter)
    with pytest.raises(SpecHeadsError, match="Hydra head drafts at most 3 deep"):
        make_drafter(head, static_tree(chain_paths(4)))
    # no stored tree: Medusa's default tree cut to the depth, completed by the top-1 chain
    default = tree_policy_for(head, TreeConfig(kind="default"))
    assert set(default.paths) == {p for p in MedusaHead.fallback_tree if len(p) <= 3} | {
        tuple(p) for p in chain_paths(3)
    }


def test_children_depend_on_the_parent_path(tiny_target):
    """Two parents at depth 1 get different child distributions; a Medusa drafter fails this check."""
    head = nudged(build_head(HeadConfig(family="hydra", num_heads=3), tiny_target))
    drafter = SequentialDrafter(head, POLICIES["chain"])
    base = tiny_target.states(torch.tensor([[1, 2, 3, 4]]), final=True).final[0, -1]
    table = two_parents()
    with torch.no_grad():
        rows = drafter.child_logp(base, [1, 2], table)
    assert rows.shape == (2, tiny_target.info.vocab_size)
    assert (rows[0] - rows[1]).abs().max() > 1e-3
    # the same check on Medusa: children depend on the depth only, so both rows are equal
    medusa = nudged(build_head(HeadConfig(family="medusa", num_heads=3), tiny_target))
    m = MedusaDrafter(medusa, POLICIES["chain"])
    m.final = base[None, None]
    logits = torch.log_softmax(medusa.medusa_logits(m.final)[:, 0, 0], -1)
    medusa_rows = logits[torch.tensor([table.depths[i] for i in [1, 2]])]
    assert torch.equal(medusa_rows[0], medusa_rows[1])


def test_one_head_call_per_level_matches_a_node_by_node_loop(tiny_target):
    head = nudged(build_head(HeadConfig(family="hydra", num_heads=3, num_layers=2), tiny_target))
    drafter = SequentialDrafter(head, POLICIES["chain"])
    base = tiny_target.states(torch.tensor([[3, 1, 4, 1, 5]]), final=True).final[0, -1]
    table = two_parents()
    for parent, token in [(1, 11), (1, 12), (2, 13), (0, 14)]:
        table.add(token, parent, 0.0)
    ids = [3, 1, 5, 4, 0, 6]  # mixed depths, in any order
    assert path_tokens(table, 5) == [5, 9, 13]
    with torch.no_grad():
        batched = drafter.child_logp(base, ids, table)
        for r, i in enumerate(ids):
            d = table.depths[i]
            path = torch.tensor(path_tokens(table, i))
            plain = torch.log_softmax(head.head_logits(d, base, path), -1)
            assert_same_numbers(batched[r], plain)


@pytest.mark.parametrize("flags", [{}, {"hydra_prefix_layer": True}], ids=["hydra", "hydra-prefix"])
def test_trained_hydra_gives_exact_greedy_output(flags, tiny_target, sequences):
    torch.manual_seed(0)
    head = build_head(HeadConfig(family="hydra", num_heads=4, **flags), tiny_target)
    batch = {k: torch.ones_like(sequences) for k in ("attention_mask", "loss_mask")}
    batch["input_ids"] = sequences
    s = tiny_target.states(sequences, batch["attention_mask"], final=True)
    head.train()
    overfit(head, batch, {"final": s.final}, steps=40)
    head.eval()
    prompts = [sequences[1:2, :8], sequences[3:4, :8], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])]
    refs = [hf_greedy(tiny_target, p, 24) for p in prompts]
    accepted = []
    for name, policy in POLICIES.items():
        for prompt, ref in zip(prompts, refs):
            res = speculative_generate(
                tiny_target, make_drafter(head, policy), prompt, SamplingConfig(max_new_tokens=24)
            )
            assert res.output_ids == ref, (name, flags)
            accepted += res.accept_lengths
    assert max(accepted) > 1  # drafts were accepted, so KV compaction and catch-up were exercised


def test_prefix_drafter_base_state_follows_the_committed_text(tiny_target, sequences):
    """Fed piece by piece (start, advance), the drafter's base state is the prefix layer over the
    whole committed text (a plain full recomputation); rewind then redraft gives the same tree."""
    head = nudged(build_head(HeadConfig(family="hydra", num_heads=3, hydra_prefix_layer=True), tiny_target))
    drafter = make_drafter(head, POLICIES["wide"])
    text = sequences[2:3, :20]
    final = tiny_target.states(text, final=True).final
    ids = text[0].tolist()
    with torch.no_grad():
        drafter.start(text[:, :8], {"final": final[:, :8]}, ids[8])
        prev = 8
        for end in (8, 11, 12, 16):
            if end > 8:  # the accepted path ids[prev:end] (root first), then the bonus ids[end]
                drafter.advance({"final": final[:, prev:end]}, ids[prev:end], ids[end])
            tree = drafter.draft(ids[end], end, 3)
            full = head.base_states(final[:, :end])[0, -1]
            assert_same_numbers(drafter.base, full)
            assert drafter.cache.length == end
            prev = end
        drafter.rewind(3)
        assert drafter.cache.length == 13
        assert drafter.draft(ids[16], 16, 3) == tree
        assert drafter.cache.length == 16


def plain_continuations(seq, max_ngram, budget, max_len, min_ngram=1):
    """text_continuations written plainly: every earlier occurrence of the last n-gram (longest n
    first, down to min_ngram, then the most recent), its continuation cut at max_len, and the first
    `budget` distinct prefixes in that order: the nodes the text drafter adds, as a set of token paths."""
    order = []
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(seq):
            continue
        for start in reversed(range(len(seq) - n)):
            if seq[start : start + n] == seq[-n:]:
                cont = seq[start + n : start + n + max_len]
                order += [tuple(cont[:m]) for m in range(1, len(cont) + 1)]
    return set(list(dict.fromkeys(order))[:budget])


def chain_prefixes(chains):
    return {tuple(c[:m]) for c in chains for m in range(1, len(c) + 1)}


def check_continuations(find, seed):
    rng = random.Random(seed)
    seq = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
    max_ngram, budget, max_len = rng.randint(1, 4), rng.randint(0, 12), rng.randint(1, 6)
    min_ngram = rng.randint(1, max_ngram)  # > 1: the trigger of a text-alone step
    chains = find(seq, max_ngram, budget, max_len, min_ngram)
    assert chain_prefixes(chains) == plain_continuations(seq, max_ngram, budget, max_len, min_ngram)
    assert all(1 <= len(c) <= max_len for c in chains)


@pytest.mark.parametrize("seed", range(30))
def test_text_continuations_agree_with_a_plain_search(seed):
    check_continuations(text_continuations, seed)


def spent_in_order(chains, budget):
    """The chains' prefixes taken in the given order while the trie of them has at most `budget` nodes."""
    trie, kept = set(), []
    for chain in chains:
        prefix = []
        for t in chain:
            if (*prefix, t) not in trie:
                if len(trie) == budget:
                    break
                trie.add((*prefix, t))
            prefix.append(t)
        if prefix:
            kept.append(prefix)
    return kept


def ngram_order(lengths):
    """text_continuations with the n-gram lengths tried in `lengths(min_ngram, max_ngram)` order."""

    def find(seq, max_ngram, budget, max_len, min_ngram):
        unbounded = len(seq) * max_len + 1
        chains = [c for n in lengths(min_ngram, max_ngram) for c in text_continuations(seq, n, unbounded, max_len, n)]
        return spent_in_order(chains, budget)

    return find


def test_the_continuation_check_fails_on_shortest_ngram_first():
    """Every n-gram length is searched, shortest first, so the weakest matches take the budget; the
    same search longest first passes (the variant differs in its order only)."""
    longest_first = ngram_order(lambda lo, hi: range(hi, lo - 1, -1))
    shortest_first = ngram_order(lambda lo, hi: range(lo, hi + 1))
    assert not fails_for_some_seed(check_continuations, longest_first, range(30))
    assert fails_for_some_seed(check_continuations, shortest_first, range(30))


def test_the_continuation_check_fails_when_min_ngram_is_ignored():
    def all_lengths(seq, max_ngram, budget, max_len, min_ngram):
        return text_continuations(seq, max_ngram, budget, max_len)  # a 1-gram match still drafts

    assert fails_for_some_seed(check_continuations, all_lengths, range(30))


def test_without_a_head_the_hybrid_drafter_is_prompt_lookup(tiny_target):
    """No head: only the text's continuations, through the package's own loop, exact greedy."""
    drafter = make_hybrid_drafter(None, HybridPolicy(None, ngram_nodes=4, ngram_max=2))
    assert drafter.layer_ids == [] and drafter.head is None
    prompt = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6]])
    drafter.start(prompt, {}, 9)
    tokens, layout = drafter.draft(9, 8, 10)
    assert tokens == [9] and layout.size == 1  # "6 9" never occurred: nothing to propose
    drafter.advance({}, [9], 5)
    drafter.advance({}, [5], 6)
    tokens, layout = drafter.draft(6, 10, 10)
    # "5 6" occurred three times before: the most recent continuation first (it takes 3 of the 4
    # nodes), then the one before; its shorter 1-gram matches find no budget left
    leaves = [[tokens[n] for n in layout.path_to(leaf)[1:]] for leaf in layout.leaves]
    assert sorted(leaves) == [[8], [9, 5, 6]]
    assert set(drafter.sources[1:]) == {FROM_TEXT}
    res = speculative_generate(tiny_target, drafter, prompt, SamplingConfig(max_new_tokens=12))
    assert res.output_ids == hf_greedy(tiny_target, prompt, 12)


def fixed_children(probs_by_depth):
    """child_logp giving every node at depth d the same distribution probs_by_depth[d] over 4
    tokens; token t of the draft vocabulary is target token 10 * (depth + 1) + t."""

    def child_logp(ids, table):
        return torch.stack([torch.tensor(probs_by_depth[table.depths[i]]).log() for i in ids])

    return child_logp


def gated_growth_by_hand(paths, probs_by_depth, gate):
    """A plain rendering of the depth gate: level d + 1 is drafted while the best path probability
    among the level-d nodes that have children in the tree is at least `gate`."""
    kept = [tuple(p) for p in sorted(paths, key=lambda p: (len(p), p))]
    depth = 1
    while depth < max(len(p) for p in kept):
        parents = {p[:depth] for p in kept if len(p) == depth + 1}
        best = max(math.prod(sorted(probs_by_depth[d], reverse=True)[r] for d, r in enumerate(p)) for p in parents)
        if best < gate:
            break
        depth += 1
    return [p for p in kept if len(p) <= depth]


GATES = [0.0, 0.3, 0.45, 0.6, 0.99]


def check_gated_growth(grow, gate):
    """grow (grow_tree or a variant) keeps the levels the hand rendering of the gate keeps, as the
    ungated tree cut there."""
    paths = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]
    probs = {0: [0.6, 0.3, 0.05, 0.05], 1: [0.1, 0.8, 0.05, 0.05], 2: [0.25, 0.25, 0.25, 0.25]}
    tokens, layout = grow(
        7, fixed_children(probs), lambda ids: ids + 100, static_tree(paths, min_path_prob=gate), max_depth=9
    )
    full_tokens, full_layout = grow_tree(7, fixed_children(probs), lambda ids: ids + 100, static_tree(paths), 9)
    kept = gated_growth_by_hand(paths, probs, gate)
    assert layout == static_tree(kept).layout and tokens == full_tokens[: layout.size]
    assert (layout == full_layout) == (len(kept) == len(paths))


@pytest.mark.parametrize("gate", GATES)
def test_a_gated_static_tree_stops_where_no_path_is_likely_enough(gate):
    check_gated_growth(grow_tree, gate)


class LastStepScores(DraftTable):
    """A draft table that keeps each node's last step's log-probability instead of its path's."""

    def add(self, token, parent, score):
        return super().add(token, parent, score - (self.scores[parent] if parent >= 0 else 0.0))


def test_the_gate_check_fails_when_the_gate_reads_one_probability_only():
    """grow_tree gating on the last step's probability (its table keeps no path scores) fails the
    check, and the hand rendering tells the two gates apart."""

    def last_step_gate(*args, **kwargs):
        return grow_tree(*args, **kwargs, table=LastStepScores())

    assert fails_for_some_seed(check_gated_growth, last_step_gate, GATES)
    paths = [[0], [0, 0], [0, 0, 0]]
    probs = {0: [0.6, 0.4, 0, 0], 1: [0.7, 0.3, 0, 0], 2: [0.5, 0.5, 0, 0]}
    assert gated_growth_by_hand(paths, probs, 0.5) == [(0,), (0, 0)]  # 0.6 * 0.7 = 0.42 < 0.5 <= 0.7


@pytest.mark.parametrize("floor", [0.0, 0.05, 0.2, 0.35, 0.7])
def test_a_floored_dynamic_tree_is_the_unfloored_one_cut_at_the_floor(floor):
    """With room for every candidate, the floor only removes: the nodes whose path probability
    is below it, and no level is drafted once no node of the level above reaches it."""
    probs = {0: [0.6, 0.3, 0.05, 0.05], 1: [0.1, 0.8, 0.05, 0.05], 2: [0.25, 0.25, 0.25, 0.25]}
    calls = []

    def counted(ids, table):
        calls.append(list(ids))
        return fixed_children(probs)(ids, table)

    def path_probs(tokens, layout):  # each node's token path -> the product of the head's probabilities on it
        return {
            tuple(tokens[n] for n in layout.path_to(i)): math.prod(
                probs[d][tokens[n] - 100] for d, n in enumerate(layout.path_to(i)[1:])
            )
            for i in range(layout.size)
        }

    spec = DynamicTreeSpec(depth=3, top_k=2, total_tokens=64)
    full = path_probs(*grow_tree(7, fixed_children(probs), lambda ids: ids + 100, spec, max_depth=9))
    floored = DynamicTreeSpec(depth=3, top_k=2, total_tokens=64, min_path_prob=floor)
    got = path_probs(*grow_tree(7, counted, lambda ids: ids + 100, floored, max_depth=9))
    assert set(got) == {path for path, p in full.items() if p >= floor}
    deepest = max(len(path) - 1 for path in got)
    assert len(calls) == min(deepest + 1, 3)  # a level is drafted only below a node above the floor
    assert (len(got) < len(full)) == (floor > 0)  # the check can fail: every floor here cuts the tree


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_tree_drafts_equal_each_path_drafted_alone(family, tiny_target):
    """Every node of a drafted tree gets the children the head gives its path drafted alone, one
    token after another with nothing else in the draft cache: what the tree's attention masks
    (several nodes of a level in one draft forward, beside their cousins' cache slots) must reproduce."""
    from conftest import quick_head

    head = quick_head(tiny_target, family)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), tiny_target.capture(head.target_layer_ids(), final=head.reads_final) as store:
        root = int(tiny_target.model(prompt).logits[0, -1].argmax())
    states, length = dict(store), prompt.shape[1]
    drafter = make_drafter(head, static_tree(full_paths(3, 2)))
    drafter.start(prompt, states, root)
    with torch.no_grad():
        tokens, layout = drafter.draft(root, length, max_depth=9)

    @torch.no_grad()
    def alone(path):  # the head's draft logits after the root and `path`, drafted one token at a time
        cache = head.new_cache()
        ids = torch.cat([prompt[:, 1:], torch.tensor([[root]])], dim=1)
        hidden, logits = head.draft_step(ids, head.input_features(states), torch.arange(length)[None], cache)
        for depth, token in enumerate(path, start=1):
            step = torch.tensor([[token]]), hidden[:, -1:], torch.tensor([[length - 1 + depth]])
            hidden, logits = head.draft_step(*step, cache)
        return logits[0, -1]

    assert layout.size == 15
    for node in range(layout.size):
        if layout.children[node]:
            path = [tokens[n] for n in layout.path_to(node)[1:]]
            expected = head.draft_to_target(torch.topk(alone(path), 2).indices).tolist()
            assert [tokens[c] for c in layout.children[node]] == expected, (node, path)


@pytest.mark.parametrize("family", ["eagle", "peagle", "dflash", "hydra-prefix"])
def test_rewind_after_a_skipped_step_keeps_what_that_step_queued(family, tiny_target, sequences):
    """rewind(n) queues the last n fed positions again before the ones a step drafted without the
    head (HybridDrafter's text-alone step) left queued, not over them: the next tree and cache are
    those of a drafter never rewound."""
    from conftest import quick_head

    text = sequences[2:3, :20]
    ids = text[0].tolist()
    trees = []
    for rewind in (False, True):
        if family == "hydra-prefix":
            torch.manual_seed(0)
            head = nudged(build_head(HeadConfig(family="hydra", num_heads=3, hydra_prefix_layer=True), tiny_target))
        else:
            head = quick_head(tiny_target, family)
        drafter = make_drafter(head, POLICIES["wide"])
        found = tiny_target.states(text, layer_ids=drafter.layer_ids, final=drafter.reads_final)
        states = {**found.hidden, **({"final": found.final} if found.final is not None else {})}

        def cut(a, b, states=states):
            return {k: v[:, a:b] for k, v in states.items()}

        with torch.no_grad():
            drafter.start(text[:, :8], cut(0, 8), ids[8])
            drafter.draft(ids[8], 8, 3)
            drafter.advance(cut(8, 11), ids[8:11], ids[11])
            drafter.draft(ids[11], 11, 3)
            drafter.advance(cut(11, 13), ids[11:13], ids[13])
            drafter.advance(cut(13, 16), ids[13:16], ids[16])  # a step drafted without the head
            if rewind:
                drafter.rewind(2)
            trees.append(drafter.draft(ids[16], 16, 3))
        assert drafter.cache.length == 16
    assert trees[0] == trees[1]
