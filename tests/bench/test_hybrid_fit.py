"""tree=auto's fit of the adaptive hybrid rule: the text positions against the loop's own trees,
the priors against their plain formulas."""

import random

import pytest

from specheads.bench.hybrid_fit import MAX_TEXT, MIN_EXPECTED, fit_rule, per_answer, simulate, text_positions
from specheads.decode.hybrid_rule import TEXT_BUDGETS
from specheads.decode.policy import HybridPolicy
from specheads.decode.suffix import SuffixIndex
from specheads.decode.tree import TreeLayout, merge_chains

SUFFIX = HybridPolicy(None, source="suffix", suffix_match=4, suffix_history=100)  # the text drafter walked


def greedy_walk(tokens, layout, truth):
    """Drafts a tree accepts along `truth` under greedy verification: walk down while a child
    carries the next true token."""
    node, k = 0, 0
    while k < len(truth):
        node = next((c for c in layout.children[node] if tokens[c] == truth[k]), None)
        if node is None:
            break
        k += 1
    return k


def random_answers(seed):
    rng = random.Random(seed)
    vocab = rng.randint(2, 6)
    prompts, contexts = [], []
    for _ in range(rng.randint(1, 3)):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        answer = [rng.randrange(vocab) for _ in range(rng.randint(2, 16))]
        prompts.append(ids)
        contexts.append(ids + answer)
    return rng, prompts, contexts


@pytest.mark.parametrize("seed", range(10))
def test_text_positions_are_what_the_loop_would_draft_and_accept(seed):
    """At each position: the draft equals a fresh index over the answers before and the text so
    far, and its accepted length for each budget is what verifying the merged tree accepts."""
    _, prompts, contexts = random_answers(seed)
    drafts, accepted = text_positions(SUFFIX, prompts, contexts)
    for a, (ids, full) in enumerate(zip(prompts, contexts)):
        assert len(drafts[a]) == len(full) - len(ids) - 1
        for i, t in enumerate(range(len(ids) - 1, len(full) - 2)):
            fresh = SuffixIndex(4, 100)
            for earlier_ids, earlier in zip(prompts[:a], contexts[:a]):
                fresh.start_request(earlier_ids)
                fresh.extend(earlier[len(earlier_ids) :])
            fresh.start_request(ids)
            fresh.extend(full[len(ids) : t + 2])
            assert drafts[a][i] == fresh.draft(MAX_TEXT, MAX_TEXT)
            for g in range(MAX_TEXT + 1):
                tokens, layout, _ = merge_chains([full[t + 1]], TreeLayout((-1,)), drafts[a][i].chains(g))
                assert accepted[a][i][g] == greedy_walk(tokens, layout, full[t + 2 :])


@pytest.mark.parametrize("seed", range(5))
def test_the_priors_follow_their_plain_formulas(seed):
    rng, prompts, contexts = random_answers(seed)
    drafts, accepted = text_positions(SUFFIX, prompts, contexts)
    heads = per_answer([rng.randint(0, 3) for _ in range(sum(len(d) for d in drafts))], contexts, prompts)
    params = fit_rule(drafts, accepted, heads, (10.0, 12.0, 14.0), draft_ms=2.0, head_nodes=3, lookup_ms=0.1)
    flat = [(d, a, h) for answer in zip(drafts, accepted, heads) for d, a, h in zip(*answer)]
    h = sum(x for _, _, x in flat) / len(flat)
    assert params.head_accept == pytest.approx(h)
    used = [(d, a, x, g) for d, a, x in flat for g in {min(b, len(d.paths)) for b in TEXT_BUDGETS} if g]
    expected = sum(d.expected(g) for d, _, _, g in used)
    r = sum(a[g] for _, a, _, g in used) / expected if expected else 1.0
    assert params.text_ratio == pytest.approx(r)
    xs = [min(h, params.text_expected(d, g)) for d, _, _, g in used]
    ys = [max(x, a[g]) - max(h, params.text_expected(d, g)) for d, a, x, g in used]
    slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs) if any(xs) else 0.0
    assert params.overlap == pytest.approx(min(max(slope, 0.0), 1.0))
    sim = simulate(params, drafts, accepted, heads)
    assert sum(sim["choices"].values()) == len(flat) and sim["tau"] >= 1.0


@pytest.mark.parametrize("seed", range(5))
def test_the_ratio_table_counts_each_cell_plainly(seed):
    """Each cell: accepted over expected text tokens of the positions with that matched length
    whose nodes that budget's column holds, shrunk toward the column's pool where it is thin."""
    rng, prompts, contexts = random_answers(seed)
    drafts, accepted = text_positions(SUFFIX, prompts, contexts)
    heads = [[0] * len(d) for d in drafts]
    params = fit_rule(drafts, accepted, heads, (10.0,), 1.0, 1, 0.0)
    flat = [(d, a) for answer in zip(drafts, accepted) for d, a in zip(*answer)]
    for m, row in enumerate(params.text_ratios, start=1):
        for col, budget in enumerate(TEXT_BUDGETS):
            lower = TEXT_BUDGETS[col - 1] if col else -1
            cell = [
                (a[g], d.expected(g))
                for d, a in flat
                for g in {min(b, len(d.paths)) for b in TEXT_BUDGETS} - {0}
                if lower < g <= budget
            ]
            pool = [(o, e) for o, e in cell]
            mine = [
                (a[g], d.expected(g))
                for d, a in flat
                if d.match == m
                for g in {min(b, len(d.paths)) for b in TEXT_BUDGETS} - {0}
                if lower < g <= budget
            ]
            obs, exp = sum(o for o, _ in mine), sum(e for _, e in mine)
            pool_exp = sum(e for _, e in pool)
            prior = sum(o for o, _ in pool) / pool_exp if pool_exp else params.text_ratio
            shrink = max(MIN_EXPECTED - exp, 0.0)
            assert row[col] == pytest.approx((obs + shrink * prior) / (exp + shrink)), (m, budget)
