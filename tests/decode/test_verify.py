"""Acceptance rules. The statistical tests run the rules against a synthetic target whose
next-token distribution is a fixed random function of the context, so they are fast and exact."""

import functools
import random
import zlib
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specheads.decode.tree import FROM_HEAD, FROM_TEXT, TreeLayout, merge_chains, static_tree
from specheads.decode.verify import greedy_accept, one_hot_nodes, speculative_accept, typical_accept
from specheads.sampling import sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6  # synthetic vocabulary


@functools.cache
def synthetic_logits(context: tuple) -> torch.Tensor:
    """A peaked-but-not-degenerate random distribution, a fixed function of the context."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(context).encode()))
    return torch.randn(V, generator=g) * 1.5


TREE = static_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]).layout


@functools.cache
def probs(context: tuple, temperature: float, top_p: float) -> torch.Tensor:
    return sampling_probs(synthetic_logits(context), temperature, top_p)


@functools.cache
def draft_q(context: tuple) -> tuple:
    """The draft's distribution: a *different* synthetic function of the context."""
    return tuple(torch.softmax(synthetic_logits(("draft",) + context), -1).tolist())


def tree_for(context: tuple, sampled: bool, rng: random.Random):
    """Drafts are the draft's top ranks (deterministic), or sampled from it without replacement."""
    tokens, qrows = [context[-1]], [None]
    for i in range(1, TREE.size):
        parent = TREE.parents[i]
        q = list(draft_q(context + tuple(tokens[n] for n in TREE.path_to(parent)[1:])))
        siblings = [s for s in TREE.children[parent] if s < i]
        for s in siblings:
            q[tokens[s]] = 0.0
        if sampled:
            total = sum(q)
            q = [x / total for x in q]
            tokens.append(rng.choices(range(V), weights=q)[0])
            qrows.append(q)
        else:
            tokens.append(max(range(V), key=lambda t: q[t]))
    if not sampled:
        return tokens, None
    qrows[0] = [0.0] * V
    return tokens, torch.tensor(qrows)


@functools.cache
def fixed_tree(context: tuple):
    return tree_for(context, False, None)


def target_probs_for(context, tokens, temperature, top_p):
    return torch.stack(
        [probs(context + tuple(tokens[n] for n in TREE.path_to(i)[1:]), temperature, top_p) for i in range(TREE.size)]
    )


def sample_two_tokens(temperature, top_p, sampled_drafts, gen, rng):
    """Speculative sampling until two tokens follow the root token 0; returns them."""
    context, out = (0,), []
    while len(out) < 2:
        tokens, q = tree_for(context, True, rng) if sampled_drafts else fixed_tree(context)
        p = target_probs_for(context, tokens, temperature, top_p)
        acc = speculative_accept(tokens, TREE, p, q, gen)
        new = [tokens[i] for i in acc.path[1:]] + [acc.bonus]
        out += new
        context = context + tuple(new)
    return tuple(out[:2])


def exact_two_token_distribution(temperature, top_p):
    p1 = probs((0,), temperature, top_p)
    return {(a, b): float(p1[a]) * float(probs((0, a), temperature, top_p)[b]) for a in range(V) for b in range(V)}


def chi_square_p(counts: Counter, expected: dict, n: int) -> float:
    obs, exp, small_o, small_e = [], [], 0, 0.0
    for key, prob in expected.items():
        if prob == 0:
            assert counts[key] == 0, f"{key} has probability 0 but was drawn"
            continue
        if prob * n < 5:  # merge sparse cells
            small_o += counts[key]
            small_e += prob * n
        else:
            obs.append(counts[key])
            exp.append(prob * n)
    if small_e > 0:
        obs.append(small_o)
        exp.append(small_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize(
    "temperature, top_p, sampled_drafts",
    [
        (1.0, 1.0, False),
        (0.7, 0.8, False),
        (0.7, 0.8, True),
    ],
)
def test_speculative_sampling_matches_target_distribution(temperature, top_p, sampled_drafts):
    n = 10_000
    gen = torch.Generator().manual_seed(1234)
    rng = random.Random(99)
    counts = Counter()
    for _ in range(n):
        counts[sample_two_tokens(temperature, top_p, sampled_drafts, gen, rng)] += 1
    expected = exact_two_token_distribution(temperature, top_p)
    assert chi_square_p(counts, expected, n) > 0.01


def test_a_biased_rule_fails_the_same_check():
    """The check has power: always accepting the first child is visibly wrong."""
    n = 5_000
    gen = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(n):
        tokens, _ = fixed_tree((0,))
        p = target_probs_for((0,), tokens, 1.0, 1.0)
        bad = tokens[1] if torch.rand((), generator=gen) < 0.5 else int(torch.multinomial(p[0], 1, generator=gen))
        counts[(bad,)] += 1
    p1 = sampling_probs(synthetic_logits((0,)), 1.0, 1.0)
    assert chi_square_p(counts, {(a,): float(p1[a]) for a in range(V)}, n) < 0.01


def cumprod_greedy(tokens, layout, logits):
    """The Medusa/EAGLE formulation: per retrieve row, cumprod of matches; best row wins."""
    best = logits.argmax(-1)
    rows = layout.retrieve
    candidates = torch.tensor(tokens + [-1])[rows]  # -1 pads map to a dummy token
    matches = (candidates[:, 1:] == best[rows[:, :-1].clamp(min=0)]) & (rows[:, 1:] >= 0)
    lengths = torch.cumprod(matches.long(), dim=1).sum(1)
    row = int(lengths.argmax())
    n = int(lengths[row])
    path = rows[row, : n + 1].tolist()
    return path, int(best[path[-1]])


@pytest.mark.parametrize("seed", range(20))
def test_greedy_walk_agrees_with_retrieve_cumprod(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 25)
    layout = TreeLayout(tuple([-1] + [rng.randrange(i) for i in range(1, n)]))
    logits = torch.randn(n, 5, generator=torch.Generator().manual_seed(seed))
    best = logits.argmax(-1).tolist()
    tokens = [0]
    for i in range(1, n):
        # siblings are distinct; often the parent's argmax so that paths get accepted
        used = {tokens[s] for s in layout.children[layout.parents[i]] if s < i}
        choices = [t for t in range(5) if t not in used] or [0]
        want = best[layout.parents[i]]
        tokens.append(want if want in choices and rng.random() < 0.7 else rng.choice(choices))
    acc = greedy_accept(tokens, layout, logits)
    path, bonus = cumprod_greedy(tokens, layout, logits)
    assert len(acc.path) == len(path) and acc.bonus == bonus
    # the accepted tokens are the target's argmax chain
    for parent, child in zip(acc.path, acc.path[1:]):
        assert tokens[child] == best[parent]
    assert all(tokens[c] != best[acc.path[-1]] for c in layout.children[acc.path[-1]])


def test_typical_acceptance_is_lenient():
    tree = static_tree([[0], [0, 0]])
    logits = torch.full((3, 4), -10.0)
    logits[0, 1] = 5.0  # confident: token 1 after the root
    logits[1, 2] = 0.0
    logits[1, 3] = 0.1  # unsure between 2 and 3 after node 1
    # drafting 2 at depth 2 is accepted although it is not the argmax (3): lossy leniency
    acc = typical_accept(
        [0, 1, 2],
        tree.layout,
        logits,
        temperature=0.7,
        epsilon=0.3,
        alpha=0.5,
        generator=torch.Generator().manual_seed(0),
    )
    assert acc.path == (0, 1, 2)
    acc = typical_accept([0, 3, 2], tree.layout, logits, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert acc.path == (0,)


def first_token_p_value(rule, n: int = 5_000) -> float:
    """Chi-square p-value of the first token after the root, drawn through `rule` on the draft's
    top-ranked tree, against the target's own distribution of it."""
    gen = torch.Generator().manual_seed(0)
    tokens, _ = fixed_tree((0,))
    p = target_probs_for((0,), tokens, 1.0, 1.0)
    counts = Counter()
    for _ in range(n):
        acc = rule(tokens, p, gen)
        counts[(tokens[acc.path[1]] if len(acc.path) > 1 else acc.bonus,)] += 1
    p1 = probs((0,), 1.0, 1.0)
    return chi_square_p(counts, {(a,): float(p1[a]) for a in range(V)}, n)


def typical_rule(tokens, p, gen):
    return typical_accept(tokens, TREE, torch.log(p), temperature=1.0, generator=gen)


def test_typical_acceptance_does_not_sample_the_target_distribution():
    """Lossy, measured: its first token is not distributed as the target's."""
    assert first_token_p_value(typical_rule) < 0.01


def test_the_lossy_check_fails_on_a_lossless_rule():
    """The check can fail: speculative sampling in place of typical acceptance passes as lossless."""
    assert first_token_p_value(lambda tokens, p, gen: speculative_accept(tokens, TREE, p, None, gen)) > 0.01


def check_default_acceptance_is_lossless(monkeypatch) -> None:
    """What a user gets without asking: infer.py's default acceptance, mapped to the decoding loop's
    SamplingConfig, dispatches to greedy or speculative sampling at every temperature, never to
    typical acceptance (which a sentinel stands in for here)."""
    from specheads.bench.inputs import sampling_config
    from specheads.config.infer import InferJobConfig
    from specheads.decode import generate

    def sentinel(*args, **kwargs):
        raise AssertionError("typical acceptance ran without being asked for")

    monkeypatch.setattr(generate, "typical_accept", sentinel)
    tokens, _ = fixed_tree((0,))
    logits = torch.log(target_probs_for((0,), tokens, 1.0, 1.0))
    for temperature in (0.0, 0.7, 1.0):
        settings = InferJobConfig(head_path="h", prompt="p", temperature=temperature)
        cfg = sampling_config(settings, 8, [])
        generate.accept(tokens, TREE, logits, cfg, torch.Generator().manual_seed(0))
    # the sentinel does stand in for it: asking for typical acceptance reaches it
    with pytest.raises(AssertionError, match="without being asked"):
        generate.accept(tokens, TREE, logits, generate.SamplingConfig(temperature=0.7, acceptance="typical"), None)


def test_typical_acceptance_runs_only_when_asked_for(monkeypatch):
    check_default_acceptance_is_lossless(monkeypatch)


def test_the_opt_in_check_fails_when_the_default_picks_typical(monkeypatch):
    """The check can fail: a SamplingConfig whose auto rule picks typical acceptance is caught."""
    from specheads.decode.generate import SamplingConfig

    real_rule = SamplingConfig.rule
    monkeypatch.setattr(SamplingConfig, "rule", lambda self: "typical" if self.temperature > 0 else real_rule(self))
    with pytest.raises(AssertionError, match="without being asked"):
        check_default_acceptance_is_lossless(monkeypatch)


HEAD_TREE = static_tree([[0], [1], [0, 0]]).layout


def hybrid_tree(context: tuple, rng: random.Random, rule: str):
    """A hybrid tree: the head's children sampled without replacement from the draft, then the
    text's continuations (a fixed function of the context: here the target's own top ranks, so
    that they are often accepted) merged in by merge_chains. Returns tokens, layout, sources, the
    proposal rows and one_hot: the head's nodes get their draft distribution and the text's are
    one-hot (rule "exact", one_hot_nodes), or, broken rules, with "text_like_head" the text's
    nodes get the draft's distribution at their parent, as if the head had proposed them, and with
    "both_as_text" a node both drafters proposed is one-hot, as if the text had."""
    tokens, qrows = [context[-1]], [[0.0] * V]
    for i in range(1, HEAD_TREE.size):
        parent = HEAD_TREE.parents[i]
        q = list(draft_q(context + tuple(tokens[n] for n in HEAD_TREE.path_to(parent)[1:])))
        for s in HEAD_TREE.children[parent]:
            if s < i:
                q[tokens[s]] = 0.0
        total = sum(q)
        q = [x / total for x in q]
        tokens.append(rng.choices(range(V), weights=q)[0])
        qrows.append(q)
    top = torch.argsort(probs(context, 1.0, 1.0), descending=True).tolist()
    first = top[0]
    chains = [[first, int(probs(context + (first,), 1.0, 1.0).argmax())], [top[2]]]
    merged, layout, sources = merge_chains(tokens, HEAD_TREE, chains)
    one_hot = {
        "exact": one_hot_nodes(sources),
        "text_like_head": None,
        "both_as_text": [bool(s & FROM_TEXT) for s in sources],
    }[rule]
    for i in range(len(tokens), len(merged)):
        q = list(draft_q(context + tuple(merged[n] for n in layout.path_to(layout.parents[i])[1:])))
        for s in layout.children[layout.parents[i]]:
            if s < i:
                q[merged[s]] = 0.0
        total = sum(q)
        qrows.append([x / total for x in q])
    return merged, layout, sources, torch.tensor(qrows), one_hot


def sample_two_tokens_hybrid(gen, rng, rule, through):
    """Like sample_two_tokens, over hybrid trees; counts draws through accepted text / head / both nodes."""
    context, out = (0,), []
    while len(out) < 2:
        tokens, layout, sources, q, one_hot = hybrid_tree(context, rng, rule)
        p = torch.stack(
            [probs(context + tuple(tokens[n] for n in layout.path_to(i)[1:]), 1.0, 1.0) for i in range(layout.size)]
        )
        acc = speculative_accept(tokens, layout, p, q, gen, one_hot=one_hot)
        if not out:
            through["text"] += any(sources[n] == FROM_TEXT for n in acc.path[1:])
            through["head"] += any(sources[n] & FROM_HEAD for n in acc.path[1:])
            through["both"] += any(sources[n] == FROM_HEAD | FROM_TEXT for n in acc.path[1:])
        new = [tokens[i] for i in acc.path[1:]] + [acc.bonus]
        out += new
        context = context + tuple(new)
    return tuple(out[:2])


def hybrid_two_token_p_value(rule: str, n: int = 3_000) -> tuple[float, Counter]:
    gen = torch.Generator().manual_seed(4321)
    rng = random.Random(5)
    counts, through = Counter(), Counter()
    for _ in range(n):
        counts[sample_two_tokens_hybrid(gen, rng, rule, through)] += 1
    return chi_square_p(counts, exact_two_token_distribution(1.0, 1.0), n), through


def test_mixed_head_and_text_siblings_follow_the_target_distribution():
    """Sampled head children beside the text's one-hot continuations: still exact."""
    p_value, through = hybrid_two_token_p_value("exact")
    assert through["text"] > 0 and through["head"] > 0 and through["both"] > 0, through  # every kind accepted
    assert p_value > 0.01


def test_the_mixed_check_fails_when_a_text_node_is_treated_like_a_head_node():
    """The check has power: the text's nodes given the head's proposal (p/q, residual p - q)."""
    p_value, through = hybrid_two_token_p_value("text_like_head")
    assert through["text"] > 0 and p_value < 0.01


def test_the_mixed_check_fails_when_a_node_of_both_drafters_is_treated_as_one_hot():
    """And the other way round: a head draw the text's chain passed through, given as one-hot."""
    p_value, through = hybrid_two_token_p_value("both_as_text")
    assert through["both"] > 0 and p_value < 0.01


def test_one_hot_nodes_are_the_texts_own():
    both = FROM_HEAD | FROM_TEXT
    assert one_hot_nodes((0, FROM_HEAD, FROM_TEXT, both)) == [False, False, True, False]
