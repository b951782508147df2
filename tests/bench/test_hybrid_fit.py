"""tree=auto's fit of the adaptive hybrid rule: the text positions against the loop's own trees,
the priors against their plain formulas."""

import pytest
from conftest import random_requests, tree_accepts

from specheads.bench.hybrid_fit import (
    MAX_TEXT,
    MIN_EXPECTED,
    answer_truths,
    fit_rule,
    per_answer,
    simulate,
    text_positions,
    verified_nodes,
)
from specheads.decode.hybrid_rule import TEXT_BUDGETS, AdaptiveRule, RuleParams
from specheads.decode.policy import HybridPolicy
from specheads.decode.suffix import SuffixIndex, TextDraft
from specheads.decode.tree import TreeLayout, merge_chains

SUFFIX = HybridPolicy(None, source="suffix", suffix_match=4, suffix_history=100)  # the text drafter walked


@pytest.mark.parametrize("seed", range(10))
def test_text_positions_are_what_the_loop_would_draft_and_accept(seed):
    """At each position: the draft equals a fresh index over the answers before and the text so
    far, and its accepted length for each budget is what verifying the merged tree accepts."""
    _, prompts, contexts = random_requests(seed)
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
                assert accepted[a][i][g] == tree_accepts(tokens, layout, full[t + 2 :])


@pytest.mark.parametrize("seed", range(5))
def test_the_priors_follow_their_plain_formulas(seed):
    rng, prompts, contexts = random_requests(seed)
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
    truths = answer_truths(prompts, contexts)
    assert params.shared == 0.0  # without the truths no node is known shared
    params = fit_rule(drafts, accepted, heads, (10.0, 12.0, 14.0), 2.0, 3, 0.1, truths)
    flat_truths = [t for answer in truths for t in answer]
    used = [
        (d, x, g, t)
        for (d, _, x), t in zip(flat, flat_truths)
        for g in {min(b, len(d.paths)) for b in TEXT_BUDGETS}
        if g
    ]
    # the text's first g nodes that are prefixes of the head's accepted path, counted plainly
    ys = [sum(len(p) <= x and list(p) == t[: len(p)] for p in d.paths[:g]) for d, x, g, t in used]
    xs = [min(h, params.text_expected(d, g)) for d, _, g, _ in used]
    slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs) if any(xs) else 0.0
    assert params.shared == pytest.approx(min(max(slope, 0.0), 1.0))
    sim = simulate(params, drafts, accepted, heads, truths=truths)
    assert same(sim, plain_simulation(params, drafts, accepted, heads, truths)) and sim["tau"] >= 1.0


@pytest.mark.parametrize("seed", range(5))
def test_the_ratio_table_counts_each_cell_plainly(seed):
    """Each cell: accepted over expected text tokens of the positions with that matched length
    whose nodes that budget's column holds, shrunk toward the column's pool where it is thin."""
    rng, prompts, contexts = random_requests(seed)
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


def same(sim, expected) -> bool:
    """Two simulations agree: the same choices, tau and tokens per second (up to rounding)."""
    return (
        sim["choices"] == expected["choices"]
        and sim["tau"] == pytest.approx(expected["tau"])
        and sim["tokens_per_s"] == pytest.approx(expected["tokens_per_s"])
    )


def plain_nodes(head_nodes, head_tokens, draft, g):
    """Nodes a step verifies, counted plainly: the root, the head's nodes, and the text's first g
    nodes (token paths below the root) that are not on the head's accepted path (head_tokens)."""
    on_head = {tuple(head_tokens[:k]) for k in range(1, len(head_tokens) + 1)}
    return 1 + head_nodes + len(set(draft.paths[:g]) - on_head)


def plain_simulation(params, drafts, text_accepted, head_accepted, truths, has_head=True, walked=True, merged=True):
    """The rule run as the loop runs it, written plainly: per answer a fresh rule; at the step's
    position it chooses, the step accepts the longer of what its drafted sources accept, the rule
    observes it, and the next step is that many positions on plus one (walked=False: every
    position a step, the scoring before; merged=False: the head's and the text's nodes priced
    apart, the pricing before)."""
    rule = AdaptiveRule(params, has_head)
    tokens = steps = 0
    cost_ms = 0.0
    kinds = {}
    for answer in zip(drafts, text_accepted, head_accepted, truths):
        rule.start()
        n, i = len(answer[0]), 0
        while i < n:
            draft, acc, a_head, truth = (x[i] for x in answer)
            choice = rule.choose(draft)
            a_text = acc[choice.text_nodes]
            got = max(a_head, a_text) if choice.head else a_text
            steps += 1
            tokens += min(1 + got, n - i) if walked else 1 + got  # nothing past the answer's end
            head_nodes, head_tokens = (params.head_nodes, truth[:a_head]) if choice.head else (0, [])
            if merged:
                nodes = plain_nodes(head_nodes, head_tokens, draft, choice.text_nodes)
            else:
                nodes = 1 + head_nodes + len(draft.paths[: choice.text_nodes])
            cost_ms += params.verify(nodes) + (params.draft_ms if choice.head else 0.0)
            cost_ms += params.lookup_ms if choice.text_nodes else 0.0
            kind = ("head+text" if choice.text_nodes else "head") if choice.head else "text"
            kind = kind if choice.head or choice.text_nodes else "plain"
            kinds[kind] = kinds.get(kind, 0) + 1
            rule.observe(choice, params.text_expected(draft, choice.text_nodes), a_head, a_text)
            i += 1 + got if walked else 1
    return {"tau": tokens / steps if steps else 1.0, "tokens_per_s": 1e3 * tokens / cost_ms, "choices": kinds}


def test_a_node_both_sources_drafted_is_verified_once():
    """Head [a, b, c] accepted along the truth and text [a, b, c, d]: the merged tree holds the
    root, the head's 3 nodes and the text's d, 5 tokens (priced 1 + 3 + 4 = 8 before); a text
    chain off the head's path shares nothing."""
    a, b, c, d = 11, 12, 13, 14
    assert verified_nodes(3, [a, b, c], [[a, b, c, d]]) == 5
    assert verified_nodes(3, [a, b, c], [[b, c]]) == 6
    assert verified_nodes(5, [a], [[a, b], [a, c, d]]) == 1 + 5 + 3
    assert verified_nodes(0, [], [[a, b]]) == 3


def copied_run():
    """Two answers without text repeats whose head accepts long runs (an answer copying its prompt):
    a rule that always drafts the head's tree (verification costs the same for every size)."""
    params = RuleParams((10.0,) * 8, draft_ms=0.0, head_nodes=2, head_accept=1.0, lookup_ms=0.0)
    head = [[5, 5, 5, 5, 5, 5, 0, 0], [2, 0, 9, 1]]
    drafts = [[TextDraft()] * len(h) for h in head]
    text = [[(0,) * (MAX_TEXT + 1)] * len(h) for h in head]
    truths = [[list(range(20))] * len(h) for h in head]
    return params, drafts, text, head, truths


def test_simulate_walks_each_answer_as_the_loop_steps():
    """Answer 1 (8 positions): a step at 0 accepts 5, then 6 and 7 accept none: 3 steps for 8
    tokens; answer 2 (4 positions): 0 accepts 2, 3 accepts what is left: 2 steps for 4 tokens.
    Per position it was (6 * 6 + 1 + 1 + 3 + 1 + 10 + 2) / 12 = 4.5 tokens a step."""
    params, drafts, text, head, truths = copied_run()
    sim = simulate(params, drafts, text, head, truths=truths)
    assert sim["choices"] == {"head": 5}
    assert sim["tau"] == pytest.approx(12 / 5) and sim["tokens_per_s"] == pytest.approx(1e3 * 12 / (5 * 10.0))
    assert same(sim, plain_simulation(params, drafts, text, head, truths))
    every_position = plain_simulation(params, drafts, text, head, truths, walked=False)
    assert every_position["tau"] == pytest.approx(54 / 12) != sim["tau"]  # the scoring before: not what runs


@pytest.mark.parametrize("seed", range(10))
def test_simulate_is_the_plain_walked_loop_on_random_requests(seed):
    """Random head acceptance (long runs included) with the text's real drafts: the rule, choosing
    and observing only at the steps it takes, as the plain loop runs it; the per-position count
    differs on some answers."""
    rng, prompts, contexts = random_requests(seed)
    drafts, accepted = text_positions(SUFFIX, prompts, contexts)
    heads = [[rng.choice([0, 1, 2, 6]) for _ in d] for d in drafts]
    params = fit_rule(drafts, accepted, heads, (10.0, 11.0, 12.0, 13.0), draft_ms=1.0, head_nodes=3, lookup_ms=0.1)
    truths = answer_truths(prompts, contexts)
    sim = simulate(params, drafts, accepted, heads, truths=truths)
    assert same(sim, plain_simulation(params, drafts, accepted, heads, truths))


@pytest.mark.parametrize("old", [{"walked": False}, {"merged": False}])
def test_the_simulate_check_tells_the_scoring_before_apart(old):
    """The check can fail: every position counted as a step, or a node both sources drafted
    priced twice, differs from simulate on some requests."""
    differs = 0
    for seed in range(10):
        rng, prompts, contexts = random_requests(seed)
        drafts, accepted = text_positions(SUFFIX, prompts, contexts)
        heads = [[rng.choice([0, 1, 2, 6]) for _ in d] for d in drafts]
        params = fit_rule(drafts, accepted, heads, (10.0, 11.0, 12.0, 13.0), 1.0, 3, 0.1)
        truths = answer_truths(prompts, contexts)
        differs += not same(
            simulate(params, drafts, accepted, heads, truths=truths),
            plain_simulation(params, drafts, accepted, heads, truths, **old),
        )
    assert differs
