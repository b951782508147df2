"""tree=auto's fit of the adaptive hybrid rule (decode/hybrid_rule.py) on the calibration answers.

At every answer position (the positions of replay.rank_vectors: a tree rooted at answer token i)
the loop's own text drafter over the suffix source (decode/suffix.py) is asked what it would draft
(walk_text), with the calibration's earlier answers in its history as a serving process would have
them, and the accepted length of its best g nodes is read off the true continuation. With the
head's accepted length at the same positions (its part of the hybrid tree, under the gate it
drafts with) that gives the rule's priors:

  head_accept  the head's mean accepted drafts per step
  text_ratio   accepted text tokens per expected one (the scores' sum), pooled over the budgets,
               and its table by matched length and budget (ratio_table)
  overlap      least squares of max(A_head, A_text) - max(h, t) on min(h, t) over positions and
               budgets, clipped to [0, 1]: what a merged tree gains over the better of its parts

and, with the timed costs, the rule's parameters. The rule is then run along each answer as the
loop runs it (bench/walk.py): it chooses at a step's position, the step accepts what that choice
accepts there, the rule observes it, and the next step is that many positions on plus one (its
running estimates restarted per answer, as per request): its expected tokens per second (the
answers' tokens over the seconds of the steps taken) is what tree=auto weighs against the fixed
split. The priors are fitted over every position.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..decode.drafters import HybridDrafter, make_hybrid_drafter
from ..decode.hybrid_rule import TEXT_BUDGETS, AdaptiveRule, RuleParams
from ..decode.policy import HybridPolicy
from ..decode.suffix import TextDraft
from ..decode.tree import TreeLayout, merge_chains
from .timing import time_steps
from .walk import answer_lengths, walk, walked_tau

MAX_TEXT = max(TEXT_BUDGETS)
T = TypeVar("T")


def accepted_text(draft: TextDraft, truth: Sequence[int], budget: int) -> int:
    """Tokens a tree of the draft's first `budget` nodes accepts along `truth` (greedy)."""
    kept = set(draft.paths[:budget])
    k = 0
    while k < len(truth) and tuple(truth[: k + 1]) in kept:
        k += 1
    return k


def verified_nodes(head_nodes: float, head_path: Sequence[int], chains: Sequence[Sequence[int]]) -> float:
    """Nodes a hybrid step verifies (root included): the head's tree of head_nodes nodes with the
    text's chains hung below it by the loop's own tree.merge_chains (as HybridDrafter drafts it),
    a node both drafted counted once. Of the head's tree calibration knows the tokens along the
    true continuation only, its accepted drafts (head_path): the text shares those; the head's
    other nodes carry tokens calibration never sees, so it counts them shared with nothing."""
    known = [0, *head_path]  # the root's token is never compared: chains start below it
    merged, _, _ = merge_chains(known, TreeLayout(tuple(range(-1, len(head_path)))), chains)
    return 1 + head_nodes + len(merged) - len(known)


def answer_truths(prompts: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Per answer, per position (walk_text's order): the true continuation after the step's root."""
    return [[list(full[t + 2 :]) for t in range(len(ids) - 1, len(full) - 2)] for ids, full in zip(prompts, contexts)]


def text_drafts(
    policy: HybridPolicy, prompts: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]], max_nodes: int
) -> tuple[list[TextDraft], list[list[int]]]:
    """At every answer position (walk_text's, flat in rank_vectors' order): the text drafter's best
    max_nodes nodes (a hybrid step with g text nodes merges the first g) and the true continuation."""
    reads, _ = walk_text(
        policy, prompts, contexts, lambda drafter, truth: (drafter.text_draft(max_nodes, max_nodes), truth)
    )
    flat = [r for answer in reads for r in answer]
    return [d for d, _ in flat], [t for _, t in flat]


def walk_text(
    policy: HybridPolicy,
    prompts: Sequence[Sequence[int]],
    contexts: Sequence[Sequence[int]],
    read: Callable[[HybridDrafter, list[int]], T],
) -> tuple[list[list[T]], HybridDrafter]:
    """The loop's own text drafter (make_hybrid_drafter(None, policy)) stepped along each greedy
    answer, one answer after another as a serving process takes requests (so its history holds the
    answers before): at every answer position (rank_vectors' order: the tree rooted at answer token
    i) read(drafter, the true continuation). Returns the reads, per answer, and the drafter as the
    last answer left it. Scoring what this drafter proposes, rather than a copy of its source, is
    what keeps a calibrated setting the one that runs."""
    drafter = make_hybrid_drafter(None, policy)
    reads: list[list[T]] = []
    for ids, full in zip(prompts, contexts):
        full = list(full)
        mine: list[T] = []
        reads.append(mine)
        if len(full) <= len(ids):
            continue  # no answer: no request to replay
        drafter.start(torch.tensor([list(ids)]), {}, full[len(ids)])
        for t in range(len(ids) - 1, len(full) - 2):  # the tree rooted at token t + 1
            mine.append(read(drafter, full[t + 2 :]))
            drafter.advance({}, [full[t + 1]], full[t + 2])  # nothing drafted accepted: the next root
    return reads, drafter


def text_positions(
    policy: HybridPolicy, prompts: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]]
) -> tuple[list[list[TextDraft]], list[list[tuple[int, ...]]]]:
    """Per answer, per position: the suffix source's draft (walk_text) and its accepted length for
    g = 0..MAX_TEXT nodes."""

    def read(drafter: HybridDrafter, truth: list[int]) -> tuple[TextDraft, tuple[int, ...]]:
        draft = drafter.text_draft(MAX_TEXT, MAX_TEXT)
        return draft, tuple(accepted_text(draft, truth, g) for g in range(MAX_TEXT + 1))

    reads, _ = walk_text(policy, prompts, contexts, read)
    return [[d for d, _ in answer] for answer in reads], [[a for _, a in answer] for answer in reads]


def time_lookup(
    policy: HybridPolicy,
    prompts: Sequence[Sequence[int]],
    contexts: Sequence[Sequence[int]],
    nodes: int,
    repeats: int = 5,
) -> float:
    """Seconds the loop's text drafter spends proposing `nodes` nodes, where the calibration answers
    leave it (walk_text: its text and history as long as calibration makes them)."""
    _, drafter = walk_text(policy, prompts, contexts, lambda drafter, truth: None)
    return time_steps({0: lambda: drafter.text_draft(nodes, nodes)}, repeats)[0]


def fit_rule(
    drafts: Sequence[Sequence[TextDraft]],
    text_accepted: Sequence[Sequence[tuple[int, ...]]],
    head_accepted: Sequence[Sequence[int]],
    verify_ms: Sequence[float],
    draft_ms: float,
    head_nodes: float,
    lookup_ms: float,
    truths: Sequence[Sequence[Sequence[int]]] | None = None,
) -> RuleParams:
    """The rule's parameters from the positions (per answer, per position) and the costs; with the
    true continuations (answer_truths') also the nodes the text shares with the head's tree
    (verified_nodes: those on its accepted path), else none are counted shared."""
    flat_heads = [a for answer in head_accepted for a in answer]
    h = sum(flat_heads) / len(flat_heads) if flat_heads else 0.0
    positions = [
        (draft, acc, a_head)
        for answer in zip(drafts, text_accepted, head_accepted)
        for draft, acc, a_head in zip(*answer)
    ]
    flat_truths = [t for answer in truths for t in answer] if truths is not None else [None] * len(positions)
    budgets = [sorted({min(b, len(d.paths)) for b in TEXT_BUDGETS} - {0}) for d, _, _ in positions]
    expected = sum(d.expected(g) for (d, _, _), gs in zip(positions, budgets) for g in gs)
    observed = sum(acc[g] for (_, acc, _), gs in zip(positions, budgets) for g in gs)
    ratio = observed / expected if expected else 1.0
    ratios = ratio_table(positions, budgets, ratio, max((d.match for d, _, _ in positions), default=1))
    params = RuleParams((1.0,), 0.0, 0.0, h, ratio, text_ratios=ratios)  # costs below
    pairs, shares = [], []  # (x, y) of the overlap's and the shared nodes' least squares
    for (draft, acc, a_head), gs, truth in zip(positions, budgets, flat_truths):
        for g in gs:
            t = params.text_expected(draft, g)
            pairs.append((min(h, t), max(a_head, acc[g]) - max(h, t)))
            if truth is not None:
                alone = 1 + head_nodes + g
                shares.append((min(h, t), alone - verified_nodes(head_nodes, truth[:a_head], draft.chains(g))))
    overlap, shared = through_origin(pairs), through_origin(shares)
    return dataclasses.replace(
        params,
        verify_ms=tuple(float(v) for v in verify_ms),
        draft_ms=float(draft_ms),
        head_nodes=float(head_nodes),
        overlap=overlap,
        shared=shared,
        lookup_ms=float(lookup_ms),
    )


def through_origin(pairs: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y on x through the origin, kept within [0, 1] (0 without data)."""
    sxx = sum(x * x for x, _ in pairs)
    return min(max(sum(x * y for x, y in pairs) / sxx, 0.0), 1.0) if sxx else 0.0


MIN_EXPECTED = 20.0  # expected tokens a cell of the ratio table needs to stand on its own


def ratio_table(positions, budgets, pooled: float, longest: int) -> tuple[tuple[float, ...], ...]:
    """Accepted over expected text tokens by matched length (rows 1..longest) and text budget
    (TEXT_BUDGETS' columns: a budget counts the positions whose nodes it was cut to). A cell with
    under MIN_EXPECTED expected tokens is shrunk toward its budget's pooled ratio, by as much."""
    cells: dict[tuple[int, int], list[float]] = {}
    for (draft, acc, _), gs in zip(positions, budgets):
        for g in gs:
            col = next(j for j, b in enumerate(TEXT_BUDGETS) if b >= g)
            for key in ((draft.match, col), (0, col)):  # row 0: the budget's pool
                cell = cells.setdefault(key, [0.0, 0.0])
                cell[0] += acc[g]
                cell[1] += draft.expected(g)
    table = []
    for m in range(1, max(longest, 1) + 1):
        row = []
        for col in range(len(TEXT_BUDGETS)):
            obs, exp = cells.get((m, col), (0.0, 0.0))
            pool_obs, pool_exp = cells.get((0, col), (0.0, 0.0))
            prior = pool_obs / pool_exp if pool_exp else pooled
            shrink = max(MIN_EXPECTED - exp, 0.0)
            row.append((obs + shrink * prior) / (exp + shrink) if exp + shrink else prior)
        table.append(tuple(row))
    return tuple(table)


def simulate(
    params: RuleParams,
    drafts: Sequence[Sequence[TextDraft]],
    text_accepted: Sequence[Sequence[tuple[int, ...]]],
    head_accepted: Sequence[Sequence[int]],
    has_head: bool = True,
    *,
    truths: Sequence[Sequence[Sequence[int]]],
) -> dict:
    """The rule run along the answers (per answer, per position) as the loop runs it: at each step
    it chooses from the text's draft there and observes what its choice accepted, and the next
    step is at the position after the accepted tokens' bonus (walk.walk). A step is priced at the
    size of the tree it verifies (verified_nodes; truths: answer_truths'). Its tau (the answers'
    tokens per step), tokens per second, and how often it made each kind of choice."""
    rule = AdaptiveRule(params, has_head)
    lengths = [len(d) for d in drafts]
    flat = [position for answer in zip(drafts, text_accepted, head_accepted, truths) for position in zip(*answer)]
    starts = set(itertools.accumulate(lengths[:-1], initial=0))
    cost_ms = 0.0
    kinds: dict[str, int] = {}

    def step(i: int) -> int:
        nonlocal cost_ms
        if i in starts:  # a new request: the rule's estimates start afresh
            rule.start()
        draft, acc, a_head, truth = flat[i]
        choice = rule.choose(draft)
        g = choice.text_nodes
        a_text = acc[g]
        got = max(a_head, a_text) if choice.head else a_text
        head = (params.head_nodes, truth[:a_head]) if choice.head else (0, [])
        nodes = verified_nodes(*head, draft.chains(g))
        cost_ms += params.verify(nodes) + (params.draft_ms if choice.head else 0) + (params.lookup_ms if g else 0)
        kind = ("head+text" if g else "head") if choice.head else ("text" if g else "plain")
        kinds[kind] = kinds.get(kind, 0) + 1
        rule.observe(choice, params.text_expected(draft, g), a_head, a_text)
        return got

    steps = walk(lengths, step)
    return {
        "tau": walked_tau(lengths, len(steps)),
        "tokens_per_s": 1e3 * sum(lengths) / cost_ms if cost_ms else 0.0,
        "choices": kinds,
    }


def per_answer(flat: Sequence, contexts: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]]) -> list[list]:
    """A flat per-position list (rank_vectors' order) cut into one list per answer."""
    out, start = [], 0
    for n in answer_lengths(prompts, contexts):
        out.append(list(flat[start : start + n]))
        start += n
    return out


def calibrate_rule(
    prompts: Sequence[Sequence[int]],
    contexts: Sequence[Sequence[int]],
    text: tuple[list, list, float],
    heads: Sequence[tuple[dict, Sequence[int]]],
    verify_ms: Sequence[float],
) -> tuple[dict | None, RuleParams, dict]:
    """The adaptive rule fitted on the calibration answers for each candidate head tree and for
    none, and the one with the most simulated tokens per second: (its head tree or None, its
    parameters, its simulation).

    text: text_positions' (drafts, accepted) and time_lookup's seconds; heads: (tree, accepted
    drafts at every position in rank_vectors' order) per candidate, the tree as {"nodes",
    "draft_ms"} under its gate; verify_ms[n - 1]: a forward of n query tokens."""
    drafts, text_acc, lookup_s = text
    none = [[0] * len(d) for d in drafts]
    truths = answer_truths(prompts, contexts)
    params = fit_rule(drafts, text_acc, none, verify_ms, 0.0, 0, 1e3 * lookup_s, truths)
    best = (None, params, simulate(params, drafts, text_acc, none, has_head=False, truths=truths))
    for tree, accepted in heads:
        per = per_answer(accepted, contexts, prompts)
        params = fit_rule(drafts, text_acc, per, verify_ms, tree["draft_ms"], tree["nodes"], 1e3 * lookup_s, truths)
        sim = simulate(params, drafts, text_acc, per, truths=truths)
        if sim["tokens_per_s"] > best[2]["tokens_per_s"]:
            best = (tree, params, sim)
    return best


def score_rule(
    record: dict,
    prompts: Sequence[Sequence[int]],
    contexts: Sequence[Sequence[int]],
    text: tuple[list, list, float],
    accepted: Sequence[int] | None,
    verify_ms: Sequence[float],
    draft_ms: float,
) -> dict:
    """A stored rule (a calibration record's hybrid.rule) run over these positions at these costs:
    its priors as stored, its head tree's accepted drafts (`accepted`, None: no head) and drafting,
    the verification and lookup as measured now."""
    drafts, text_acc, lookup_s = text
    params = dataclasses.replace(
        RuleParams.from_record(record), verify_ms=tuple(verify_ms), draft_ms=draft_ms, lookup_ms=1e3 * lookup_s
    )
    heads = per_answer(accepted, contexts, prompts) if accepted is not None else [[0] * len(d) for d in drafts]
    truths = answer_truths(prompts, contexts)
    return simulate(params, drafts, text_acc, heads, has_head=accepted is not None, truths=truths)
