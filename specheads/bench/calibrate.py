"""tree=auto: choose the tree with the most expected tokens per second on this machine.

1. Acceptance. The target writes its own greedy answers to calibration prompts. At every answer
   position, the head drafts along the true continuation (teacher-forced, exactly as a tree
   drafts along its correct path) and we record the rank of each true token at depths 1..D: a
   rank vector. Under greedy verification a tree accepts the longest prefix of that vector that
   is one of its paths, so E[accepted] = sum over tree paths of freq(path), where freq(path) is
   the share of positions whose rank vector starts with it. For n nodes the best tree is
   therefore the n most frequent paths (a child is never more frequent than its parent).
2. Cost. Target forwards of every query-token count priced (the trees' and the hybrid's) are timed
   in one run after a context of the mean length the loop's steps verify after (step_context),
   made non-decreasing in the count by a least-squares fit, and the head's drafting of each
   candidate tree (and of its cuts at each depth) is timed with the real drafter; each at the
   mean over repeats, what the loop pays (bench/timing.py).
3. Pick n maximising tokens per second, each tree under the depth gate (StaticTree.min_path_prob)
   that serves it best: at every position the head's top-1 probabilities along the answer
   (teacher-forced, as the ranks) say how deep the gated tree drafts there, and a step there
   accepts at most that deep and costs that depth's drafting and nodes, so that steps where the
   head is unsure stop early and cost less. Every setting is scored by walking the answers as
   the loop does (bench/walk.py: a step accepting a drafts is followed by the step a + 1
   positions on): tau = the answers' tokens / the steps taken, tokens/s = those tokens / the
   steps' summed seconds. (E[accepted] above, over every position, ranks the trees of n nodes;
   it overstates tau wherever accepted runs are long, counting a run once per token of it.)
4. The hybrid tree (the head's tree + continuations of the text's repeats, decode.drafters.
   HybridDrafter): the loop's own text drafter, built from the tree settings' text source as the
   loop builds it, is stepped along the answers (hybrid_fit.walk_text), and at the same positions
   its nodes are listed best first, so for g text nodes its accepted length A_t(g) is known; a
   merged tree accepts the longer of the two paths, max(A_h(n), A_t(g)). A text-alone rule (m, L)
   makes the steps whose last m tokens recurred verify L text nodes alone, without the head's
   drafting. The setting (n, g, rule), n = 0 meaning no head nodes, with the most expected tokens
   per second (its verify cost at each step's merged size, the head's drafting, the lookup) is
   stored in the calibration record as "hybrid", with the text source it was scored with, which
   is the one it drafts with (policy.hybrid_policy_for).

5. Dynamic trees (bench/dynamic_trees.py; tree.dynamic=weigh, the default): at the same
   positions the head drafts its full EAGLE-2 tree, from which the acceptance, size and drafting
   levels of every smaller and floored dynamic tree follow; the best one is chosen over the
   static tree when it is expected to be faster (record "policy": "dynamic"; tree.dynamic=only:
   always), while the static tree is still stored as the head's default_tree, which the engine
   exporters read.

The tree goes to this machine's cache (bench/trees.py), not into the head directory, unless
tree.save=head asks for that; its record names the prompts it was measured on.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import torch
from tqdm import tqdm

from ..atomic import write_json
from ..config.infer import SEARCH_DEFAULTS, InferJobConfig, TreeConfig, resolve_search
from ..decode.baselines import hf_generate
from ..decode.drafters import make_drafter
from ..decode.kv import new_cache, verify_tree
from ..decode.policy import (
    DynamicTreeSpec,
    HybridPolicy,
    TreePolicy,
    alone_trigger,
    describe_policy,
    describe_source,
    describe_text_alone,
    dynamic_from,
    text_policy,
    text_settings,
    tree_config_from,
)
from ..decode.suffix import TextDraft
from ..decode.tree import TreeLayout, pruned_tree, static_tree
from ..errors import SpecHeadsError
from ..heads import read_head_config
from ..heads.io import CONFIG_NAME, draft_precision
from ..provenance import portable_path
from ..target import eos_token_ids, synchronize
from .dynamic_trees import MAX_DEPTH, NODES, TOP_K, dynamic_choice, grow_along, rule_candidate
from .hybrid_fit import (
    accepted_text,
    calibrate_rule,
    score_rule,
    text_drafts,
    text_positions,
    time_lookup,
    verified_nodes,
    walk_text,
)
from .inputs import encode_prompt, sampling_config
from .questions import read_questions
from .record import weights_sha256
from .replay import accepted_length, best_paths, path_frequencies, rank_vectors
from .timing import isotonic, time_steps
from .trees import (
    cache_path,
    existing_calibration,
    machine_description,
    prompts_record,
    remove_cached_tree,
    search_space,
    store_in_cache,
    utc_now,
)
from .walk import answer_lengths, walk, walked_tau

BUILTIN_PROMPTS = [
    # half chat, half copy-heavy (BUILTIN_COPY_HEAVY): the copy-heavy ones give the text the answer
    # works on (a passage to summarise, translate, answer from or extract from; code or prose to
    # edit), answers that reuse their prompt, where the text's own repeats are worth drafting (the
    # hybrid tree). The first 16 are those calibrations recorded before the other 8 were added (their
    # digests are in those records): new prompts go at the end.
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when it is a poor choice.",
    "From the text below, list each person and the city they live in.\nText: Priya lives in Toronto and works "
    "as a nurse. Her brother Ravi moved to Chicago in 2019. Their friend Elena still lives in Madrid, close to "
    "her parents.",
    "What is 17 times 23? Show your steps.",
    "Give me three tips for a job interview.",
    'Fix the grammar in this paragraph and return the corrected paragraph: "Yesterday me and my friend goes to '
    'the market. We buyed apples, bread and some cheeses, then we walks home because the bus were late."',
    "Write a Python function that checks whether a string is a palindrome.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Here is a Python function:\n\ndef total(items):\n    result = 0\n    for item in items:\n"
    "        result = result + item.price\n    return result\n\nAdd a parameter `tax` (default 0) that is "
    "applied to the total, and return the whole updated function.",
    "Summarise the causes of the French Revolution in a paragraph.",
    "Plan a three-day trip to Kyoto.",
    'Summarise this email in two sentences: "Hi team, the quarterly review moves from Thursday to Friday at '
    "10am because the finance report is not ready. Please send your slides to Maria by Wednesday evening. "
    'Lunch will be provided after the meeting."',
    "What are the pros and cons of remote work?",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Turn this list into a Markdown table with the columns Name and Age: Tom 34, Lisa 29, Ahmed 41, Mei 25.",
    "Rewrite the following sentence three times, each time in a more formal tone: \"We can't make it to the "
    'meeting, sorry, something came up."',
    "Using only the passage below, answer: when did the bridge reopen, and why was it closed?\nPassage: The Alder "
    "Street bridge closed on 3 March after inspectors found rust in two of its steel cables. Crews replaced both "
    "cables over six weeks, and the bridge reopened to cars on 14 April and to cyclists a week later.",
    "Explain how the gears on a bicycle make it easier to ride up a hill.",
    "Rename the variable `n` to `count` everywhere in this JavaScript function and return the whole function:\n\n"
    "function countVowels(text) {\n  let n = 0;\n  for (const ch of text.toLowerCase()) {\n"
    "    if ('aeiou'.includes(ch)) {\n      n += 1;\n    }\n  }\n  return n;\n}",
    'Translate this note into German: "The library will be closed on Monday for cleaning. Books due that day can '
    'be returned on Tuesday without a fine."',
    "Compare living in a big city with living in the countryside.",
    "Extract every date and the event on it from this schedule, one per line as DATE: EVENT.\nSchedule: The garden "
    "club meets on 2 May to plant seedlings. On 16 May there is a talk on composting. The plant sale is on 30 May, "
    "and the summer picnic follows on 13 June.",
    'Summarise this product review in one sentence: "I bought this kettle two months ago. It boils water quickly '
    "and the handle stays cool, but the lid is hard to open with one hand and the power cord is shorter than I "
    'expected. Overall it is good value for the price."',
    "Suggest five names for a small bakery and explain each in one line.",
]
# the prompts above that give the text their answer works on (the rest are chat)
BUILTIN_COPY_HEAVY = frozenset({2, 5, 8, 11, 13, 14, 15, 16, 18, 19, 21, 22})
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64, 80, 96, 128)
TEXT_NODES = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16)  # text-continuation budgets a hybrid tree may take


def settle_forward(target, token: int, cache) -> None:
    """An untimed 1-token forward, dropped from the cache again. Each timed forward follows one, as
    a decoding step follows a step of its own size: right after a large forward (the top of the
    ladder) the next one runs slower, which made every small tree cost what a plain step did."""
    target.model(input_ids=torch.tensor([[int(token)]], device=target.device), cache=cache, use_cache=True)
    cache.crop(-1)


@torch.no_grad()
def time_target(target, context: Sequence[int], sizes: Sequence[int], repeats: int = 5) -> dict[int, float]:
    """Seconds per verification forward of n query tokens after `context`.

    The mean the loop pays (timing.time_steps: every size timed once a round, so that a slow spell
    of the machine falls on all sizes alike; timed one size after another, it would inflate the
    few sizes timed during it, making large trees look cheap beside small ones), made
    non-decreasing in n, more query tokens never costing less, by the least-squares monotone fit
    (timing.isotonic; a running maximum carried one size's noise up to every larger size). Each
    forward follows a 1-token one (settle_forward), as a decoding step follows a step.
    """
    model, device = target.model, target.device
    cache = new_cache(model)
    model(torch.tensor([list(context)], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    prefix = len(context)
    # n query tokens, each attending to the ones before: built once, timed every round
    queries = {n: ([context[i % len(context)] for i in range(n)], TreeLayout(tuple(range(-1, n - 1)))) for n in sizes}
    out = time_steps(
        {n: functools.partial(verify_tree, target, *query, prefix, cache) for n, query in queries.items()},
        repeats,
        before=lambda n: settle_forward(target, context[-1], cache),
        after=lambda n: cache.crop(-n),
        sync=lambda: synchronize(device),
    )
    ordered = sorted(out)
    return dict(zip(ordered, isotonic([out[n] for n in ordered])))


def step_context(prompts: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]]) -> list[int]:
    """The context verification forwards are timed after: the longest calibration context cut to
    the mean length the loop verifies after, over every answer position of every answer (the
    prompt and the answer tokens before the step's root: a step's cost grows with its context, and
    the loop steps at every length, not at the longest)."""
    longest = list(max(contexts, key=len))
    lengths = answer_lengths(prompts, contexts)
    if not sum(lengths):
        return longest
    # answer position i (root: answer token i) verifies after len(prompt) + i tokens
    mean = sum(n * len(ids) + n * (n - 1) / 2 for ids, n in zip(prompts, lengths)) / sum(lengths)
    return longest[: max(round(mean), 1)]


@torch.no_grad()
def time_repeated(target, cache, root: int, step: Callable[[], object], before=None, repeats: int = 5) -> float:
    """Seconds `step` takes, each time right after a target forward on `cache` (settle_forward), as
    a draft in decoding always follows a verification: drafting back to back with warm caches
    measured 0.5-1 ms a step less on a CPU than the same trees cost in the loop, most for the trees
    with most levels. `before` runs ahead of each forward, untimed. The mean the loop pays
    (timing.time_steps)."""

    def prepare(_) -> None:
        if before is not None:
            before()
        settle_forward(target, root, cache)

    return time_steps({0: step}, repeats, before=prepare, sync=lambda: synchronize(target.device))[0]


def time_draft(target, head, policy: TreePolicy, prompt: Sequence[int], repeats: int = 5, accepted: int = 3) -> float:
    """Seconds the real drafter spends on one step of this tree policy (catch-up of `accepted`
    tokens included), timed as in decoding (time_repeated)."""
    drafter = make_drafter(head, policy)
    ids = torch.tensor([list(prompt)], device=target.device)
    cache = new_cache(target.model)
    if hasattr(drafter, "bind_target_cache"):  # a drafter that runs the target's own layers (early exit)
        drafter.bind_target_cache(cache)
    with target.capture(drafter.layer_ids, final=drafter.reads_final) as store:
        out = target.model(input_ids=ids, cache=cache, use_cache=True)
    root = int(out.logits[0, -1].argmax())
    drafter.start(ids, dict(store), root)
    drafter.draft(root, len(prompt), 1 << 30)
    return time_repeated(
        target,
        cache,
        root,
        lambda: drafter.draft(root, len(prompt), 1 << 30),
        lambda: drafter.rewind(accepted),
        repeats,
    )


GATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)  # min_path_prob values tree=auto weighs


def gated_depth(top: Sequence[float], max_depth: int, min_path_prob: float) -> int:
    """How deep a gated tree drafts at a position whose top-1 chain has these probabilities: level
    d + 1 is drafted while the chain's probability through depth d is at least min_path_prob."""
    depth, p = 1, 1.0
    while depth < max_depth:
        p *= top[depth - 1] if depth - 1 < len(top) else 0.0
        if p < min_path_prob:
            break
        depth += 1
    return depth


def gate_choice(
    vectors: Sequence[Sequence[int]],
    top_probs: Sequence[Sequence[float]],
    paths: list[list[int]],
    target_s: dict[int, float],
    draft_s: dict[int, float],
    gates: Sequence[float] = GATES,
    *,
    lengths: Sequence[int],
) -> list[dict]:
    """Expected tokens/s of the tree `paths` under each depth gate (StaticTree.min_path_prob).

    At each position the gate sets the depth drafted (gated_depth, from the head's top-1 chain);
    a step there accepts the tree's accepted length cut to that depth and costs the verification
    of the tree's nodes down to it plus its drafting (draft_s: seconds by depth drafted). The
    answers (lengths: positions per answer, walk.answer_lengths) are walked as the loop steps
    through them (walk.walk): tau is their tokens per step, tokens/s their tokens per second of
    the steps taken."""
    tree = static_tree(paths)
    full = frozenset(tree.paths)
    max_depth = tree.layout.max_depth
    verify = {d: interpolate(target_s, pruned_tree(tree, d).size) for d in range(1, max_depth + 1)}
    ungated = [accepted_length(vector, full, max_depth) for vector in vectors]
    tokens = sum(lengths)
    rows = []
    for gate in gates:
        depths = [gated_depth(top, max_depth, gate) for top in top_probs] if gate else [max_depth] * len(vectors)
        steps = walk(lengths, [min(a, d) for a, d in zip(ungated, depths)])
        seconds = sum(verify[depths[i]] + draft_s[depths[i]] for i in steps)
        rows.append(
            {
                "min_path_prob": gate,
                "tau": walked_tau(lengths, len(steps)),
                "tokens_per_s": tokens / seconds if seconds else 0.0,
            }
        )
    return rows


def text_acceptance(
    policy: HybridPolicy, prompts, contexts, max_nodes: int, triggers: Sequence[int] = ()
) -> tuple[list[tuple[int, ...]], dict[int, list[tuple[int, ...]]]]:
    """At each answer position (those of rank_vectors), the accepted length of the loop's own text
    drafter (hybrid_fit.walk_text, drafting from `policy`'s source) with g = 0..max_nodes nodes
    (entry g), cut where it runs out of nodes: an entry of length 1 means the text drafted nothing
    there; and for each trigger m, the same of the nodes it drafts alone where the text's last m
    tokens (or more) recurred (HybridDrafter.text_draft with min_match=m)."""

    def accepted(draft, truth) -> tuple[int, ...]:
        return tuple(accepted_text(draft, truth, g) for g in range(min(len(draft.paths), max_nodes) + 1))

    def read(drafter, truth) -> dict[int, tuple[int, ...]]:
        return {m: accepted(drafter.text_draft(max_nodes, max_nodes, m), truth) for m in {1, *triggers}}

    reads, _ = walk_text(policy, prompts, contexts, read)
    flat = [r for answer in reads for r in answer]
    return [r[1] for r in flat], {m: [r[m] for r in flat] for m in triggers}


def interpolate(times: dict[int, float], n: int) -> float:
    """Seconds of a forward of n query tokens from the measured sizes (linear between two)."""
    sizes = sorted(times)
    if n in times:
        return times[n]
    lo = max((k for k in sizes if k < n), default=sizes[0])
    hi = min((k for k in sizes if k > n), default=sizes[-1])
    if hi == lo:
        return times[lo]
    return times[lo] + (times[hi] - times[lo]) * (n - lo) / (hi - lo)


def head_steps(
    vectors: Sequence[tuple[int, ...]], top_probs: Sequence[Sequence[float]] | None, row: dict
) -> tuple[list[int], list[int], list[float]]:
    """At each position, what the head's part of a hybrid tree (a hybrid_choice head row) does:
    the drafts it accepts, the nodes it adds to the verified tree and its drafting seconds, under
    the row's depth gate (min_path_prob, read from top_probs as gate_choice does; none: every
    level drafted)."""
    n = len(vectors)
    if not row["nodes"]:
        return [0] * n, [0] * n, [0.0] * n
    tree = static_tree([list(p) for p in row["paths"]])
    full, max_depth = frozenset(tree.paths), tree.layout.max_depth
    gate = float(row.get("min_path_prob") or 0.0)
    draft_s = row.get("draft_s") or {max_depth: row["draft_ms"] / 1e3}
    if gate and top_probs is not None:
        depths = [gated_depth(top, max_depth, gate) for top in top_probs]
    else:
        depths = [max_depth] * n
    nodes = {d: pruned_tree(tree, d).size - 1 for d in set(depths)}
    accepted = [min(accepted_length(v, full, max_depth), d) for v, d in zip(vectors, depths)]
    return accepted, [nodes[d] for d in depths], [draft_s[d] for d in depths]


def hybrid_choice(
    vectors: Sequence[tuple[int, ...]],
    text: Sequence[tuple[int, ...]],
    head_rows: Sequence[dict],
    target_s: dict[int, float],
    lookup_s: float,
    alone: dict[int, Sequence[tuple[int, ...]]] | None = None,
    alone_sizes: Sequence[int] = TEXT_NODES[1:],
    top_probs: Sequence[Sequence[float]] | None = None,
    text_nodes: Sequence[int] = TEXT_NODES,
    *,
    lengths: Sequence[int],
    drafts: Sequence[TextDraft],
    truths: Sequence[Sequence[int]],
) -> list[dict]:
    """Every hybrid setting scored: expected tau, tokens per second. head_rows: the head-only rows
    (nodes, paths, draft_ms; optionally min_path_prob, the depth gate the head's part is drafted
    with, and draft_s, its drafting seconds by the depth drafted); vectors, text, top_probs (the
    head's top-1 chain, as for gate_choice) and each alone[m] hold the same positions, those of
    answers of `lengths` positions each (walk.answer_lengths).

    A setting is (head nodes n, text nodes g) and a text-alone rule: none, or (m, L): where the
    text's last m tokens (or more) occurred before (alone[m] = text_acceptance's for trigger m
    drafted something), the step verifies the text's L nodes alone, with no head drafting; every
    other step verifies the merged tree, which accepts max(A_head(n), A_text(g)) and is priced at
    the size the loop verifies (hybrid_fit.verified_nodes: drafts, the text's draft at each
    position, its first g nodes merged; truths, the true continuation there). Under a gate the
    head's part is drafted as gate_choice counts it: at each position as deep as gated_depth says,
    accepting at most that deep, verifying and drafting that many levels' nodes. Each setting
    walks the answers as the loop steps through them (walk.walk: a step accepting a drafts is
    followed by the step a + 1 positions on), so tau is the answers' tokens per step taken; the
    head's catch-up after a skipped step (one forward over a few more positions) is not priced.
    text_nodes: the text budgets g scored.
    """
    alone = alone or {}
    tokens = sum(lengths)
    verify = {}

    def cost(nodes: int) -> float:
        if nodes not in verify:
            verify[nodes] = interpolate(target_s, nodes)
        return verify[nodes]

    # the text-alone steps of each rule (m, L): where they fire, what they accept and cost there
    fired = {m: [i for i, a in enumerate(rows) if len(a) > 1] for m, rows in alone.items()}
    alone_steps = {}
    for m, rows in alone.items():
        for size in alone_sizes:
            used = [min(size, len(rows[i]) - 1) for i in fired[m]]
            alone_steps[m, size] = (
                [rows[i][u] for i, u in zip(fired[m], used)],
                [cost(1 + u) + lookup_s for u in used],
            )

    def score(accepted: list[int], costs: list[float]) -> tuple[float, float]:
        steps = walk(lengths, accepted)
        seconds = sum(map(costs.__getitem__, steps))
        return walked_tau(lengths, len(steps)), tokens / seconds if seconds else 0.0

    out = []
    heads = [{"nodes": 0, "paths": [], "draft_ms": 0.0}, *head_rows]
    for h in heads:
        head_acc, head_nodes, head_s = head_steps(vectors, top_probs, h)
        gate = float(h.get("min_path_prob") or 0.0) if h["nodes"] else 0.0
        for g in text_nodes:
            if h["nodes"] == 0 and g == 0:
                continue
            step_acc, step_cost = [], []
            for a_h, nodes, drafting, a_t, draft, truth in zip(head_acc, head_nodes, head_s, text, drafts, truths):
                used = min(g, len(a_t) - 1)
                step_acc.append(max(a_h, a_t[used]))
                merged = verified_nodes(nodes, truth[:a_h], draft.chains(used))
                step_cost.append(cost(merged) + drafting + (lookup_s if g else 0.0))
            rules = [(0, 0, *score(step_acc, step_cost))]
            if h["nodes"]:  # without a head there is nothing to skip
                # under a rule the text is looked up at every step, to see whether it fires
                rest_cost = step_cost if g else [c + lookup_s for c in step_cost]
                for m, where in fired.items():
                    for size in alone_sizes:
                        accepted, costs = step_acc.copy(), rest_cost.copy()
                        for i, a, c in zip(where, *alone_steps[m, size]):
                            accepted[i], costs[i] = a, c
                        rules.append((size, m, *score(accepted, costs)))
            for size, m, tau, speed in rules:
                out.append(
                    {
                        "head_nodes": h["nodes"],
                        "ngram_nodes": g,
                        "paths": h["paths"],
                        "min_path_prob": gate,
                        "text_alone": size,
                        "text_alone_ngram": m,
                        "tau": tau,
                        "tokens_per_s": speed,
                    }
                )
    return out


def with_sizes(target, context: Sequence[int], target_s: dict[int, float], sizes) -> dict[int, float]:
    """target_s where it has every size of `sizes`; else all of its sizes and those timed anew in
    one time_target run, so that every size is timed under the same machine state and fitted
    monotone together (two runs merged put one run's slow spell beside the other's quiet one)."""
    if set(sizes) <= set(target_s):
        return target_s
    return time_target(target, context, sorted(set(target_s) | set(sizes)))


def score_hybrid_setting(
    prompts, contexts, vectors, top_probs, hybrid: dict, gate: float, target_s, lookup_s, draft_by_depth, tree
) -> dict | None:
    """One hybrid setting (a calibration record's "hybrid": the head's paths under `gate`, its text
    nodes, text source (policy.text_policy, as hybrid_policy_for drafts it; `tree`: the settings
    it lacks) and text-alone rule) scored by hybrid_choice on these positions and costs (target_s
    covering its sizes; lookup_s: its text drafter's seconds), as calibrate_hybrid scores the new
    ones; None when it drafts nothing."""
    paths = [list(p) for p in hybrid.get("paths") or []]
    source = text_policy(tree, hybrid)
    g, size = int(hybrid.get("ngram_nodes") or 0), int(hybrid.get("text_alone") or 0)
    trigger = alone_trigger(source, hybrid.get("text_alone_ngram"))
    if not paths and not g:
        return None
    nodes = max(max(TEXT_NODES), g, size)  # as calibrate_hybrid lists them
    text, alone = text_acceptance(source, prompts, contexts, nodes, [trigger] if size else [])
    drafts, truths = text_drafts(source, prompts, contexts, nodes)
    head = []
    if paths:
        draft_s = draft_by_depth(paths)
        head = [{"nodes": len(paths), "paths": paths, "min_path_prob": gate, "draft_s": draft_s}]
        head[0]["draft_ms"] = 1e3 * draft_s[max(draft_s)]
    rows = hybrid_choice(
        vectors,
        text,
        head,
        target_s,
        lookup_s,
        alone,
        [size] if size else [],
        top_probs,
        (g,),
        lengths=answer_lengths(prompts, contexts),
        drafts=drafts,
        truths=truths,
    )
    rule = (size, trigger) if size and paths else (0, 0)
    found = [r for r in rows if r["head_nodes"] == len(paths) and (r["text_alone"], r["text_alone_ngram"]) == rule]
    return found[0] if found else None


def hybrid_sizes(head_nodes: int) -> set[int]:
    """The verification sizes calibrate_hybrid prices where the head's largest tree has head_nodes
    nodes: up to that tree with every text node and the root."""
    longest = head_nodes + max(TEXT_NODES) + 1
    return {n for n in SIZES if n <= longest} | {longest}


def calibrate_hybrid(
    target, settings: InferJobConfig, prompts, contexts, vectors, top_probs, rows, target_s, out, lookup_s=None
) -> dict:
    """Step 4 of the module's recipe: the best split of a hybrid tree between head and text, and
    the text-alone rule (tree.text_alone and tree.text_alone_ngram when given, else every rule).
    Each of the head's trees (rows) is scored under the depth gate chosen with it (min_path_prob,
    its drafting by depth in draft_s): the gate it is drafted with, stored in the record."""
    t = settings.tree
    source = text_policy(t)  # the text drafter as the loop builds it from these settings
    top = max(TEXT_NODES)
    triggers = [t.text_alone_ngram] if t.text_alone_ngram is not None else range(1, source.trigger_max + 1)
    sizes = list(TEXT_NODES[1:]) if t.text_alone is None else [t.text_alone] if t.text_alone else []
    # the merged tree's text part is the trigger-1 rule's text too: listed once, long enough for both
    text, alone = text_acceptance(source, prompts, contexts, max(top, *sizes), triggers if sizes else [])
    drafts, truths = text_drafts(source, prompts, contexts, max(top, *sizes))  # what each merged step merges
    target_s = with_sizes(
        target, step_context(prompts, contexts), target_s, hybrid_sizes(max(r["nodes"] for r in rows))
    )
    lookup_s = time_lookup(source, prompts, contexts, top) if lookup_s is None else lookup_s
    lengths = answer_lengths(prompts, contexts)
    scored = hybrid_choice(
        vectors, text, rows, target_s, lookup_s, alone, sizes, top_probs, lengths=lengths, drafts=drafts, truths=truths
    )
    best = max(scored, key=lambda r: r["tokens_per_s"])
    plain = 1 / target_s[1]
    head_best = max(r["tokens_per_s"] for r in rows)
    rule = describe_text_alone(best["text_alone"], best["text_alone_ngram"], source.trigger_max)
    rule = rule or "; no text-alone steps"
    gate = f" (gate p >= {best['min_path_prob']:g})" if best["min_path_prob"] else ""
    out.write(
        f"hybrid: {best['head_nodes']} head nodes{gate} + up to {best['ngram_nodes']} text nodes "
        f"({describe_source(source)}){rule}: tau {best['tau']:.2f}, expected speedup "
        f"{best['tokens_per_s'] / plain:.2f}x (the head's tree alone {head_best / plain:.2f}x)\n"
    )
    return {
        "paths": best["paths"],
        "min_path_prob": best["min_path_prob"],  # the depth gate of the head's part: tree=default drafts with it
        "ngram_nodes": best["ngram_nodes"],
        **text_settings(t),  # the text source it was scored with: hybrid_policy_for drafts the split with it
        "text_alone": best["text_alone"],
        "text_alone_ngram": best["text_alone_ngram"] or source.alone_ngram,
        "tau": round(best["tau"], 4),
        "expected_speedup": round(best["tokens_per_s"] / plain, 4),
    }


def head_accepted(vectors, top_probs, paths, gate: float) -> list[int]:
    """The head's accepted drafts at every position with the tree `paths` under its depth gate."""
    tree = frozenset(tuple(p) for p in paths)
    depth = max(len(p) for p in tree)
    return [min(accepted_length(v, tree, depth), gated_depth(top, depth, gate)) for v, top in zip(vectors, top_probs)]


def score_old_rule(
    record: dict, prompts, contexts, text, vectors, top_probs, target_s, draft_by_depth, dynamic=None
) -> dict:
    """A calibration record's adaptive rule scored on these positions and costs (hybrid_fit.score_rule):
    its head tree under its gate drafted and verified at the costs measured now (a dynamic tree:
    `dynamic`, its rule_candidate grown here)."""
    paths = [list(p) for p in record.get("paths") or []]
    verify_ms = [1e3 * interpolate(target_s, n) for n in range(1, max(target_s) + 1)]
    if dynamic is not None:
        return score_rule(record, prompts, contexts, text, dynamic["accepted"], verify_ms, dynamic["draft_ms"])
    if not paths:
        return score_rule(record, prompts, contexts, text, None, verify_ms, 0.0)
    gate = float(record.get("min_path_prob") or 0.0)
    draft_s = draft_by_depth(paths)
    accepted = head_accepted(vectors, top_probs, paths, gate)
    return score_rule(record, prompts, contexts, text, accepted, verify_ms, 1e3 * draft_s[max(draft_s)])


def calibrate_adaptive_rule(
    settings: InferJobConfig, prompts, contexts, vectors, top_probs, rows, target_s, fixed, text, out, dynamic=None
) -> tuple[dict | None, dict]:
    """Step 6: the adaptive hybrid rule (decode/hybrid_rule.py) over the suffix source, fitted on
    the same answers (bench/hybrid_fit.py; text: its text_positions and lookup seconds, from the
    text drafter the fixed split was scored with) for each of the head's trees (under its gate),
    the calibrated dynamic tree (`dynamic`: its rule_candidate, drafted as spec drafts it) and no
    head, the fastest kept. Returns its record (the hybrid record's "rule") when it is expected
    faster than the fixed split, else None (one line says so), and its expected tau and tokens/s."""
    heads = [(row, head_accepted(vectors, top_probs, row["paths"], row["min_path_prob"])) for row in rows]
    if dynamic is not None:
        heads.append((dynamic, dynamic["accepted"]))
    verify_ms = [1e3 * interpolate(target_s, n) for n in range(1, max(target_s) + 1)]
    tree, params, sim = calibrate_rule(prompts, contexts, text, heads, verify_ms)
    plain = 1 / target_s[1]
    speedup = sim["tokens_per_s"] / plain
    total = sum(sim["choices"].values()) or 1
    shares = ", ".join(f"{k} {n / total:.0%}" for k, n in sorted(sim["choices"].items()))
    keep = speedup > fixed["expected_speedup"]
    if tree is None:
        head = "no head"
    elif "dynamic" in tree:
        head = f"the {describe_policy(tree['dynamic'])} or none"
    else:
        head = f"{tree['nodes']} head nodes or none"
    out.write(
        f"hybrid, adaptive per step ({head}, suffix source): tau {sim['tau']:.2f}, expected speedup "
        f"{speedup:.2f}x against the fixed split's {fixed['expected_speedup']:.2f}x (steps: {shares})"
        f"{'' if keep else ': the fixed split is kept'}\n"
    )
    score = {"tau": sim["tau"], "tokens_per_s": sim["tokens_per_s"]}
    if not keep:
        return None, score
    if tree is not None and "dynamic" in tree:  # policy.rule_tree drafts it as the dynamic tree
        drafted = {"dynamic": dataclasses.asdict(tree["dynamic"])}
    else:
        drafted = {"paths": tree["paths"] if tree else [], "min_path_prob": tree["min_path_prob"] if tree else 0.0}
    record = {
        **params.to_record(),
        **drafted,
        "tau": round(sim["tau"], 4),
        "expected_speedup": round(speedup, 4),
        "choices": sim["choices"],
    }
    return record, score


def calibrate_dynamic(
    target, head, prompts, contexts, depth, top_k, gates, target_s, prompt, out, search=True, existing=None, also=None
) -> tuple[dict | None, dict | None, Callable[[DynamicTreeSpec], dict | None]]:
    """The floored dynamic tree (bench/dynamic_trees.py) with the most expected tokens per second
    on the calibration answers (depth and top_k at most those given), with its drafting time (None
    when no answer has two tokens, or search is False: tree.dynamic=off); `existing` (a
    calibration record's dynamic tree: depth, top_k, total_tokens, min_path_prob) scored on the
    same growths (None without it); and candidate(spec): a dynamic tree as a head tree of the
    adaptive hybrid rule (dynamic_trees.rule_candidate), None where it was not grown here
    (`also`, a stored rule's dynamic tree, is grown too)."""
    depth = min(depth, MAX_DEPTH)
    searched = ([k for k in TOP_K if k <= top_k] or [top_k]) if search else []
    wanted = [tree for tree in (existing, also) if tree]
    widths = sorted(set(searched) | {int(tree["top_k"]) for tree in wanted})
    grown_depth = max([depth if search else 0, *(int(tree["depth"]) for tree in wanted)])
    growths: dict[int, list] = {k: [] for k in widths}
    draft_s: dict[int, dict[int, float]] = {}

    def candidate(spec: DynamicTreeSpec) -> dict | None:
        grown = spec.top_k in draft_s and spec.depth <= grown_depth
        return rule_candidate(growths[spec.top_k], spec, draft_s[spec.top_k]) if grown else None

    if not widths:
        return None, None, candidate
    answered = [(ids, full) for ids, full in zip(prompts, contexts) if len(full) - len(ids) >= 2]
    for ids, full in tqdm(answered, desc="calibration: dynamic trees", unit="prompt", file=sys.stderr):
        for k, grown in grow_along(target, head, full, len(ids), widths, grown_depth).items():
            growths[k] += grown
    if not any(growths.values()):
        return None, None, candidate
    for k in widths:  # a step drafting d levels of a k-wide tree
        draft_s[k] = {d: time_draft(target, head, DynamicTreeSpec(d, k, 1), prompt) for d in range(1, grown_depth + 1)}
    lengths = answer_lengths([ids for ids, _ in answered], [full for _, full in answered])
    most = max(max(NODES), int(existing["total_tokens"]) if existing else 0)
    verify_s = [interpolate(target_s, max(m, 1)) for m in range(most + 2)]
    before = None
    if existing:
        k, d = int(existing["top_k"]), int(existing["depth"])
        spec = ([int(existing["total_tokens"])], [float(existing.get("min_path_prob") or 0.0)])
        scored = dynamic_choice({k: growths[k]}, verify_s, draft_s, d, *spec, lengths=lengths)
        before = [r for r in scored if r["depth"] == d][0]
        before = {**before, "draft_ms": 1e3 * draft_s[k][d]}
    if not search:
        return None, before, candidate
    rows = dynamic_choice({k: growths[k] for k in searched}, verify_s, draft_s, depth, NODES, gates, lengths=lengths)
    plain = 1 / target_s[1]
    out.write("dynamic trees, the best of each depth (draft ms: all levels drafted):\n")
    out.write(f"{'depth':>5} {'top_k':>5} {'nodes':>5} {'floor':>5} {'tau':>6} {'draft ms':>8} {'tok/s':>7}\n")
    for d in range(1, depth + 1):
        r = max((r for r in rows if r["depth"] == d), key=lambda r: r["tokens_per_s"])
        out.write(
            f"{d:>5} {r['top_k']:>5} {r['nodes']:>5} {r['min_path_prob']:>5g} {r['tau']:>6.2f} "
            f"{1e3 * draft_s[r['top_k']][d]:>8.1f} {r['tokens_per_s']:>7.1f}  ({r['tokens_per_s'] / plain:.2f}x)\n"
        )
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {**best, "draft_ms": 1e3 * draft_s[best["top_k"]][best["depth"]]}, before, candidate


def calibration_texts(settings: InferJobConfig) -> tuple[str, list[str]]:
    """(where they come from, the prompt texts) of the calibration: tree.calibration_questions'
    first turns, taken from each category in turn (a few prompts still cover every category),
    else the built-in prompts."""
    t = resolve_search(settings.tree)
    if t.calibration_questions:
        by_category: dict[str, list[str]] = {}
        for q in read_questions(t.calibration_questions):
            by_category.setdefault(q["category"], []).append(q["prompt"])
        rounds = itertools.zip_longest(*by_category.values())
        texts = [x for one_each in rounds for x in one_each if x is not None]
        return portable_path(t.calibration_questions), texts[: t.calibration_prompts]
    return "builtin", BUILTIN_PROMPTS[: t.calibration_prompts]


def calibration_prompts(settings: InferJobConfig, tokenizer) -> tuple[str, list[str], list[list[int]]]:
    """(where they come from, their texts, their token ids) of the calibration prompts
    (calibration_texts), each encoded as the session encodes a prompt."""
    source, texts = calibration_texts(settings)
    return source, texts, [encode_prompt(tokenizer, x, settings.system, settings.chat) for x in texts]


def store_default_tree(head, head_dir: Path, paths: list[list[int]], calibration: dict | None = None) -> bool:
    """Save the tree as the head directory's default tree, with its calibration record (only our
    own, writable head format). tree.save=head asks for it: the head directory is then rewritten."""
    try:
        config = read_head_config(head_dir)
    except SpecHeadsError:
        return False  # an engine-format directory: not ours to rewrite
    if not os.access(head_dir, os.W_OK) or Path(head_dir).resolve().is_relative_to(
        Path.home() / ".cache" / "huggingface"
    ):
        return False
    head.default_tree = paths
    extra = {"calibration": calibration} if calibration else {}
    # config.json only: the weights stay as stored (their dtype, a family's extra files)
    write_json(Path(head_dir) / CONFIG_NAME, {**config, "default_tree": paths, **extra})
    return True


def keep_calibration(t: TreeConfig, head, before: tuple[str, list, dict], out: TextIO) -> TreeConfig:
    """This run drafts with the calibration before (nothing stored)."""
    _, paths, record = before
    head.default_tree, head.calibration = paths, record
    out.flush()
    return tree_config_from(t, paths, record)


@dataclasses.dataclass(frozen=True)
class Before:
    """The calibration before (bench.trees.existing_calibration), as this run would draft it: an
    explicit gate or text-alone rule wins over its own. Empty when there is none to weigh
    (tree.replace=always)."""

    name: str = ""  # where it comes from, as the lines printed name it
    paths: list | None = None  # its static tree (default_tree)
    record: dict = dataclasses.field(default_factory=dict)
    gate: float = 0.0  # its static tree's depth gate
    dynamic: dict | None = None  # its dynamic tree, where tree=default drafts it
    hybrid: dict | None = None  # its hybrid split

    @property
    def rule(self) -> dict:
        return (self.hybrid or {}).get("rule") or {}

    def depths(self) -> list[int]:
        """The depths of its trees' paths: the static tree, the split's head part, the rule's tree."""
        paths = [*(self.paths or []), *((self.hybrid or {}).get("paths") or []), *(self.rule.get("paths") or [])]
        return [len(p) for p in paths]


@dataclasses.dataclass
class Answers:
    """The target's greedy answers to the calibration prompts and the head's acceptance along them."""

    source: str  # where the prompts come from (prompts_record)
    texts: list[str]
    prompts: list[list[int]]
    contexts: list[list[int]]  # prompt + answer
    ranks: list  # rank vectors as deep as `reach` (the trees before are scored on them)
    vectors: list  # rank vectors cut to the searched depth (the new trees)
    top_probs: list  # the head's top-1 probabilities along the answers (the depth gate)


@dataclasses.dataclass
class Costs:
    """What the steps cost here: target forwards by query size, and the head's drafting of a tree
    (timed once per tree, with the real drafter, on the longest answer's first half)."""

    target: object
    head: object
    target_s: dict[int, float]
    context: list[int]  # the mean context the loop's steps verify after
    prompt: list[int]  # where a draft step is timed
    hybrid_sizes: set[int]  # the hybrid's verification sizes, new and before (with_sizes)
    drafting: dict[tuple, float] = dataclasses.field(default_factory=dict)  # tree paths -> seconds

    def draft_time(self, paths) -> float:
        key = tuple(tuple(p) for p in paths)
        if key not in self.drafting:
            self.drafting[key] = time_draft(self.target, self.head, static_tree([list(p) for p in key]), self.prompt)
        return self.drafting[key]

    def draft_by_depth(self, paths) -> dict[int, float]:
        """Drafting cut at each depth: what a depth gate saves where it stops early."""
        tree = static_tree([list(p) for p in paths])
        return {d: self.draft_time(pruned_tree(tree, d).paths) for d in range(1, tree.layout.max_depth + 1)}


def calibrate_tree(settings: InferJobConfig, session, out: TextIO = sys.stdout) -> TreeConfig:
    """Measure, choose, (store), and return the chosen tree as a TreeConfig: static, or dynamic
    when a floored dynamic tree is expected to be faster (its `paths` are still the best static
    tree, the one stored as the head's default_tree).

    The search (SEARCH_DEFAULTS' keys) is the one the head's existing calibration made
    (bench.trees.existing_calibration, search_space) wherever the settings leave a key None. A
    re-calibration never makes things worse (tree.replace=if_faster): the calibration before is
    scored on the positions and costs just measured, as the new choices are (its static tree
    under its gate, its dynamic tree, its hybrid split), and the new one replaces only the parts
    it is expected to be faster in (the tree tree=default drafts; the hybrid split); measured on
    fewer positions than the calibration before, it changes nothing."""
    target, head = session.target, session.head
    kernels = getattr(session, "layouts", None) is not None
    head_dir = Path(session.head_dir) if session.head_dir is not None else None
    existing = existing_calibration(head, head_dir, target, kernels)
    settings = searched_settings(settings, existing, out)
    t = settings.tree
    before = calibration_before(existing, t)
    depth, reach = searched_depths(head, t.depth, before)
    answers = measure_acceptance(settings, target, head, depth, reach)
    needed = int(before.record.get("positions") or 0)
    if len(answers.vectors) < needed:
        report_too_few_positions(len(answers.vectors), needed, before.name, t, out)
        return keep_calibration(t, head, existing, out)
    freq = path_frequencies(answers.vectors, t.top_k)
    candidates = [n for n in SIZES if n <= min(t.max_nodes, len(freq))] or [1]
    old_tree = before_tree(before, reach)
    costs = time_costs(target, head, answers, candidates, old_tree, before)
    gates = GATES if t.min_path_prob is None else (t.min_path_prob,)
    rows = score_static_trees(answers, freq, candidates, costs, gates)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    old_static = score_before_static(answers, before, old_tree, costs)
    plain = 1 / costs.target_s[1]
    report_static_trees(rows, best, plain, costs.target_s, len(answers.vectors), len(answers.prompts), target, out)
    old_rule_dynamic = before.rule.get("dynamic")
    dynamic, old_dyn, dynamic_candidate = choose_dynamic(
        target, head, answers, depth, t, gates, costs, before, old_rule_dynamic, out
    )
    use_dynamic = dynamic is not None and (t.dynamic == "only" or dynamic["tokens_per_s"] > best["tokens_per_s"])
    report_dynamic(dynamic, plain, use_dynamic, out)
    hybrid_s, new_text, lookup_s, text, hybrid, rule, rule_score = choose_hybrid(
        target, settings, answers, rows, costs, before, dynamic, dynamic_candidate, out
    )
    record = new_record(t, head, head_dir, target, kernels, answers, depth, best, plain, hybrid, dynamic, use_dynamic)
    paths = best["paths"]
    if existing is not None and t.replace != "always":  # each part weighed against the one before
        scored = (answers, costs, hybrid_s, new_text, lookup_s, text, reach, dynamic_candidate)
        new_split = new_split_score(t, scored, hybrid)
        parts = {
            "tree": (dynamic if use_dynamic else best, old_dyn if before.dynamic is not None else old_static),
            # the hybrid as it drafts: its adaptive rule where it has one, else its fixed split
            "hybrid": (rule_score if rule is not None else new_split, score_before_split(before, t, scored)),
        }
        kept = parts_kept(parts)
        report_weighed(before.name, kept, parts, plain, len(answers.vectors), out)
        if len(kept) == len(parts):
            return keep_calibration(t, head, existing, out)
        paths = keep_parts(record, kept, parts, before, old_static, plain, paths)
    elif existing is not None:
        out.write(f"tree=auto: the new calibration replaces {existing[0]} (tree.replace=always)\n")
    head.calibration = record
    store_calibration(t, head, head_dir, target, kernels, paths, record, out)
    out.flush()
    return tree_config_from(t, paths, record)


def searched_settings(settings: InferJobConfig, existing: tuple | None, out: TextIO) -> InferJobConfig:
    """The settings with tree=auto's search resolved: a key left None searches as the calibration
    before did (search_space), else its SEARCH_DEFAULTS value; one line names the keys taken."""
    recorded = search_space(existing[2]) if existing is not None else {}
    taken = {k: v for k, v in recorded.items() if getattr(settings.tree, k) is None}
    if taken:
        out.write(
            f"tree=auto searches as {existing[0]} did: "
            + ", ".join(f"tree.{k}={v}" for k, v in taken.items())
            + " (give a key to search otherwise)\n"
        )
    return dataclasses.replace(settings, tree=resolve_search(settings.tree, recorded))


def calibration_before(existing: tuple | None, t: TreeConfig) -> Before:
    """The calibration before as this run would draft it (an explicit gate or text-alone rule
    wins); empty when there is none, or tree.replace=always replaces it unweighed."""
    if existing is None or t.replace == "always":
        return Before(gate=t.min_path_prob if t.min_path_prob is not None else 0.0)
    name, old_paths, old = existing
    old_gate = t.min_path_prob if t.min_path_prob is not None else float(old.get("min_path_prob") or 0.0)
    old_dynamic = old.get("dynamic") if old.get("policy") == "dynamic" else None
    if old_dynamic is not None and t.min_path_prob is not None:
        old_dynamic = {**old_dynamic, "min_path_prob": t.min_path_prob}
    old_hybrid = dict(old.get("hybrid") or {}) or None
    if old_hybrid is not None:
        old_hybrid["min_path_prob"] = (
            t.min_path_prob if t.min_path_prob is not None else old_hybrid.get("min_path_prob")
        )
        old_hybrid.update({k: getattr(t, k) for k in ("text_alone", "text_alone_ngram") if getattr(t, k) is not None})
    return Before(name, old_paths, old, old_gate, old_dynamic, old_hybrid)


def searched_depths(head, searched: int, before: Before) -> tuple[int, int]:
    """(depth, reach): the deepest new tree (the searched depth, at most what the head drafts), and
    how deep the ranks are measured: as deep as the trees before reach too (up to what the head
    drafts), since they are scored as deep as they draft, the new trees on ranks cut to `depth`."""
    limit = head.max_draft_depth(head.spec)
    depth = min(searched, limit) if limit is not None else searched
    return depth, max([depth, *(d for d in before.depths() if limit is None or d <= limit)])


def measure_acceptance(settings: InferJobConfig, target, head, depth: int, reach: int) -> Answers:
    """The target's greedy answers to the calibration prompts, and the head's rank vectors and
    top-1 probabilities along them (teacher-forced, `reach` deep)."""
    t = settings.tree
    source, texts, prompts = calibration_prompts(settings, target.tokenizer)
    if not prompts:
        raise SpecHeadsError("tree=auto needs at least one calibration prompt")
    cfg = sampling_config(settings, t.calibration_tokens, eos_token_ids(target))
    cfg.temperature = 0.0
    ranks, contexts, top_probs = [], [], []
    for ids in tqdm(prompts, desc="calibration: acceptance", unit="prompt", file=sys.stderr):
        answer = hf_generate(target, torch.tensor([ids], device=target.device), cfg)["output_ids"]
        contexts.append(ids + answer)
        ranks += rank_vectors(target, head, ids + answer, len(ids), reach, top_probs)
    if not ranks:
        raise SpecHeadsError("tree=auto: the calibration answers were empty")
    vectors = [v[:depth] for v in ranks] if reach > depth else ranks
    return Answers(source, texts, prompts, contexts, ranks, vectors, top_probs)


def report_too_few_positions(n_pos: int, needed: int, name: str, t: TreeConfig, out: TextIO) -> None:
    out.write(
        f"tree=auto: too few positions to decide: {n_pos} measured here, {name} was measured on {needed}; "
        f"raise tree.calibration_prompts (now {t.calibration_prompts}) or tree.calibration_tokens (now "
        f"{t.calibration_tokens}) to measure at least {needed} (tree.replace=always replaces it regardless); "
        "nothing changed, this run drafts with it\n"
    )


def before_tree(before: Before, reach: int):
    """The static tree before, where its ranks were measured (no deeper than `reach`), else None."""
    old_paths = before.paths
    return static_tree([list(p) for p in old_paths]) if old_paths and max(map(len, old_paths)) <= reach else None


def time_costs(target, head, answers: Answers, candidates, old_tree, before: Before) -> Costs:
    """Every verification size priced, new and before (the trees', their depth cuts', the hybrid's),
    timed in one run (with_sizes), and the drafting timer."""
    old_sizes = {pruned_tree(old_tree, d).size for d in range(1, old_tree.layout.max_depth + 1)} if old_tree else set()
    if before.dynamic is not None:
        old_sizes.add(int(before.dynamic["total_tokens"]) + 1)
    need = hybrid_sizes(max(candidates)) | before_hybrid_sizes(before.hybrid)
    context = step_context(answers.prompts, answers.contexts)
    target_s = time_target(target, context, sorted({1, *(n + 1 for n in candidates), *old_sizes, *need}))
    longest = max(answers.contexts, key=len)
    return Costs(target, head, target_s, context, longest[: max(len(longest) // 2, 1)], need)


def before_hybrid_sizes(old_hybrid: dict | None) -> set[int]:
    """The verification sizes of the hybrid split before: its merged tree and its text alone."""
    if old_hybrid is None:
        return set()
    g, alone = int(old_hybrid.get("ngram_nodes") or 0), int(old_hybrid.get("text_alone") or 0)
    return {1 + len(old_hybrid.get("paths") or []) + g, 1 + alone}


def score_static_trees(answers: Answers, freq, candidates, costs: Costs, gates) -> list[dict]:
    """Each candidate size's best static tree (the n most frequent paths) under the depth gate that
    serves it best."""
    rows = []
    lengths = answer_lengths(answers.prompts, answers.contexts)
    for n in tqdm(candidates, desc="calibration: draft cost", unit="tree", file=sys.stderr):
        paths = best_paths(freq, n)
        tree = static_tree(paths)
        draft_s = costs.draft_by_depth(paths)
        scored = gate_choice(answers.vectors, answers.top_probs, paths, costs.target_s, draft_s, gates, lengths=lengths)
        gated = max(scored, key=lambda r: r["tokens_per_s"])
        rows.append(
            {
                "nodes": n,
                "depth": tree.layout.max_depth,
                "tau": gated["tau"],
                "target_ms": 1e3 * costs.target_s[n + 1],
                "draft_ms": 1e3 * draft_s[tree.layout.max_depth],
                "min_path_prob": gated["min_path_prob"],
                "tokens_per_s": gated["tokens_per_s"],
                "paths": paths,
                "draft_s": draft_s,  # seconds by depth drafted: what the gate saves (the hybrid's head part too)
            }
        )
    return rows


def score_before_static(answers: Answers, before: Before, old_tree, costs: Costs) -> dict | None:
    """The static tree before under its gate, on the same positions and costs (None: not scorable)."""
    if old_tree is None:
        return None
    draft_s = costs.draft_by_depth(before.paths)
    lengths = answer_lengths(answers.prompts, answers.contexts)
    return gate_choice(
        answers.ranks, answers.top_probs, before.paths, costs.target_s, draft_s, (before.gate,), lengths=lengths
    )[0]


def report_static_trees(rows, best, plain: float, target_s, n_pos: int, n_prompts: int, target, out: TextIO) -> None:
    out.write(
        f"tree calibration on {target.device} ({n_pos} positions, {n_prompts} prompts); "
        f"plain decoding ~{plain:.1f} tokens/s\n"
    )
    # target/draft ms: the whole tree's; gate: the depth gate (min_path_prob) chosen with it, which
    # tau and tok/s count in (the steps it stops early draft and verify less)
    out.write(f"{'nodes':>5} {'depth':>5} {'gate':>5} {'tau':>6} {'target ms':>9} {'draft ms':>8} {'tok/s':>7}\n")
    for r in rows:
        mark = "  <- chosen" if r is best else ""
        out.write(
            f"{r['nodes']:>5} {r['depth']:>5} {r['min_path_prob']:>5g} {r['tau']:>6.2f} {r['target_ms']:>9.1f} "
            f"{r['draft_ms']:>8.1f} {r['tokens_per_s']:>7.1f}{mark}\n"
        )
    gate = f", a level drafted while a path into it has p >= {best['min_path_prob']:g}" if best["min_path_prob"] else ""
    out.write(f"expected speedup {best['tokens_per_s'] / plain:.2f}x; tree paths: {json.dumps(best['paths'])}{gate}\n")
    if best["tokens_per_s"] < plain:
        # the smallest tree already costs more than its acceptance buys: say which term limits it
        one = rows[0]
        out.write(
            f"no tree beats plain decoding here: verifying even {one['nodes'] + 1} tokens costs "
            f"{one['target_ms'] / (1e3 * target_s[1]):.2f}x a plain step, and the head's "
            f"acceptance (tau {best['tau']:.2f}) does not pay for it; train the head longer\n"
        )


def choose_dynamic(target, head, answers: Answers, depth, t: TreeConfig, gates, costs, before, old_rule_dynamic, out):
    """calibrate_dynamic where a dynamic tree is searched or one before is scored, else nothing."""
    if t.dynamic == "off" and before.dynamic is None and not old_rule_dynamic:
        return None, None, None
    return calibrate_dynamic(
        target,
        head,
        answers.prompts,
        answers.contexts,
        depth,
        t.top_k,
        gates,
        costs.target_s,
        costs.prompt,
        out,
        t.dynamic != "off",
        before.dynamic,
        old_rule_dynamic,
    )


def report_dynamic(dynamic: dict | None, plain: float, chosen: bool, out: TextIO) -> None:
    if dynamic is None:
        return
    floor = f", nodes kept while their path has p >= {dynamic['min_path_prob']:g}" if dynamic["min_path_prob"] else ""
    out.write(
        f"dynamic tree: depth {dynamic['depth']}, top_k {dynamic['top_k']}, {dynamic['nodes']} nodes{floor}: "
        f"tau {dynamic['tau']:.2f}, draft {dynamic['draft_ms']:.1f} ms, expected speedup "
        f"{dynamic['tokens_per_s'] / plain:.2f}x{'  <- chosen: tree=default drafts it' if chosen else ''}\n"
    )


def choose_hybrid(target, settings, answers: Answers, rows, costs: Costs, before, dynamic, dynamic_candidate, out):
    """The hybrid split and, over the suffix source, the adaptive rule: (verification costs,
    the new text drafter, its lookup seconds, its positions (None: not the suffix source), the
    split's record (with its rule), the rule, the rule's score)."""
    t = settings.tree
    a = answers
    # the hybrid splits, new and before, on the same verification costs (timed above) and lookup time
    hybrid_s = with_sizes(target, costs.context, costs.target_s, costs.hybrid_sizes)
    new_text = text_policy(t)  # the text drafter the new split is scored, and drafts, with
    lookup_s = time_lookup(new_text, a.prompts, a.contexts, max(TEXT_NODES))
    hybrid = calibrate_hybrid(
        target, settings, a.prompts, a.contexts, a.vectors, a.top_probs, rows, hybrid_s, out, lookup_s
    )
    # the adaptive rule drafts over the suffix source only: with another, the fixed split runs
    text = (*text_positions(new_text, a.prompts, a.contexts), lookup_s) if new_text.source == "suffix" else None
    # the calibrated dynamic tree is one of the rule's head trees: hybrid may draft what spec drafts
    dyn_head = dynamic_candidate(dynamic_from(dynamic | {"total_tokens": dynamic["nodes"]})) if dynamic else None
    rule, rule_score = (
        calibrate_adaptive_rule(
            settings, a.prompts, a.contexts, a.vectors, a.top_probs, rows, hybrid_s, hybrid, text, out, dyn_head
        )
        if text is not None
        else (None, None)
    )
    if rule is not None:
        hybrid["rule"] = rule
    return hybrid_s, new_text, lookup_s, text, hybrid, rule, rule_score


def new_record(t, head, head_dir, target, kernels, answers: Answers, depth, best, plain, hybrid, dynamic, use_dynamic):
    """The new calibration's record: what was searched and measured, the static tree chosen, the
    hybrid split and the dynamic tree, and which of the two trees tree=default drafts."""
    record = {
        "calibrated_at": utc_now(),  # a cached tree older than the head's own calibration is not used
        "weights_sha256": weights_sha256(head_dir) if head_dir else None,  # the weights it was made for
        "prompts": prompts_record(answers.source, answers.texts),
        "tokens": t.calibration_tokens,
        "search": {k: getattr(t, k) for k in SEARCH_DEFAULTS},  # what a later tree=auto searches again
        "positions": len(answers.vectors),
        "depth": depth,
        "top_k": t.top_k,
        "max_nodes": t.max_nodes,
        "machine": machine_description(target.device, kernels),
        "head_dtype": draft_precision(head),
        "nodes": best["nodes"],
        "tau": round(best["tau"], 4),
        "expected_speedup": round(best["tokens_per_s"] / plain, 4),
        "min_path_prob": best["min_path_prob"],  # the tree's depth gate: tree=default drafts with it
        "hybrid": hybrid,
    }
    if dynamic is not None:
        record["dynamic"] = {
            **{k: dynamic[k] for k in ("depth", "top_k", "min_path_prob")},
            "total_tokens": dynamic["nodes"],
            "tau": round(dynamic["tau"], 4),
            "expected_speedup": round(dynamic["tokens_per_s"] / plain, 4),
        }
    # what tree=default drafts: the static tree (default_tree, also what engines export) or this dynamic one
    record["policy"] = "dynamic" if use_dynamic else "static"
    return record


def new_split_score(t: TreeConfig, scored: tuple, hybrid: dict) -> dict | None:
    """The new fixed split scored as the split before is (score_hybrid_setting)."""
    answers, costs, hybrid_s, _, lookup_s, _, _, _ = scored
    a = answers
    return score_hybrid_setting(
        a.prompts,
        a.contexts,
        a.ranks,
        a.top_probs,
        hybrid,
        hybrid["min_path_prob"],
        hybrid_s,
        lookup_s,
        costs.draft_by_depth,
        t,
    )


def score_before_split(before: Before, t: TreeConfig, scored: tuple) -> dict | None:
    """The hybrid before as it drafts, on the same positions and costs: its adaptive rule where it
    has one (and it is scorable here), else its fixed split; None where neither can be scored.
    Each with the text source it drafts with."""
    answers, costs, hybrid_s, new_text, lookup_s, text, reach, dynamic_candidate = scored
    a, old_hybrid = answers, before.hybrid
    old_text = text_policy(t, old_hybrid)
    old_lookup = lookup_s if old_text == new_text else time_lookup(old_text, a.prompts, a.contexts, max(TEXT_NODES))
    old_rule = (old_hybrid or {}).get("rule") if old_text.source == "suffix" else None
    old_rule_dynamic, old_rule_paths = before.rule.get("dynamic"), before.rule.get("paths") or []
    # a stored rule's dynamic tree as grown here (None: not grown, e.g. deeper than the head drafts)
    old_rule_head = dynamic_candidate(dynamic_from(old_rule_dynamic)) if old_rule and old_rule_dynamic else None
    scorable = old_rule_head is not None if old_rule_dynamic else all(d <= reach for d in map(len, old_rule_paths))
    if old_rule and scorable:
        positions = text if old_text == new_text else (*text_positions(old_text, a.prompts, a.contexts), old_lookup)
        return score_old_rule(
            old_rule,
            a.prompts,
            a.contexts,
            positions,
            a.ranks,
            a.top_probs,
            hybrid_s,
            costs.draft_by_depth,
            old_rule_head,
        )
    if old_hybrid is not None and all(d <= reach for d in map(len, old_hybrid.get("paths") or [])):
        return score_hybrid_setting(
            a.prompts,
            a.contexts,
            a.ranks,
            a.top_probs,
            old_hybrid,
            float(old_hybrid.get("min_path_prob") or 0.0),
            hybrid_s,
            old_lookup,
            costs.draft_by_depth,
            t,
        )
    return None


def parts_kept(parts: dict) -> list[str]:
    """The parts (tree, hybrid) the calibration before is expected as fast or faster in."""
    return [
        part
        for part, (new, was) in parts.items()
        if was is not None and (new is None or was["tokens_per_s"] >= new["tokens_per_s"])
    ]


def report_weighed(name: str, kept: list[str], parts: dict, plain: float, n_pos: int, out: TextIO) -> None:
    """One line: the calibration before kept whole, or replaced but for the parts kept."""
    told = compared_speeds(parts, plain)
    if len(kept) == len(parts):
        out.write(
            f"tree=auto: {name} is kept, expected as fast or faster on these {n_pos} positions "
            f"(before against new: {told}); nothing stored (tree.replace=always stores the new one)\n"
        )
        return
    out.write(
        f"tree=auto: the new calibration replaces {name}"
        + (f" except its {' and '.join(kept)}" if kept else "")
        + f", expected faster where it replaces it (before against new: {told})\n"
    )


def compared_speeds(parts: dict, plain: float) -> str:
    """Each part's expected speedup, before against new, in words."""
    speed = {part: [f"{r['tokens_per_s'] / plain:.2f}x" if r else "none" for r in pair] for part, pair in parts.items()}
    return "; ".join(f"{part} {speed[part][1]} against {speed[part][0]}" for part in parts)


def keep_parts(record: dict, kept: list[str], parts: dict, before: Before, old_static, plain: float, paths):
    """The new record with the parts kept from the calibration before put back (and noted under
    "kept"); returns the static tree stored: the one before where the tree is kept."""
    old_paths, old, old_dynamic = before.paths, before.record, before.dynamic
    if "tree" in kept:
        was = parts["tree"][1]
        paths = old_paths
        record.pop("dynamic", None)
        record.update(
            nodes=len(old_paths),
            tau=round(old_static["tau"], 4) if old_static else old.get("tau"),
            expected_speedup=round(old_static["tokens_per_s"] / plain, 4)
            if old_static
            else old.get("expected_speedup"),
            min_path_prob=before.gate,
            policy=old.get("policy", "static"),
        )
        if old_dynamic is not None:
            record["dynamic"] = {
                **{k: old_dynamic[k] for k in ("depth", "top_k", "total_tokens", "min_path_prob")},
                "tau": round(was["tau"], 4),
                "expected_speedup": round(was["tokens_per_s"] / plain, 4),
            }
    if "hybrid" in kept:
        was = parts["hybrid"][1]
        record["hybrid"] = {
            **before.hybrid,
            "tau": round(was["tau"], 4),
            "expected_speedup": round(was["tokens_per_s"] / plain, 4),
        }
    if kept:
        record["kept"] = kept  # the parts kept from the calibration before (expected faster here)
    return paths


def store_calibration(t: TreeConfig, head, head_dir, target, kernels: bool, paths, record: dict, out: TextIO) -> None:
    """Keep the calibration where tree.save says: the head directory (tree.save=head; this
    machine's cached tree for the head then goes), this machine's cache (tree.save=cache), or
    nowhere (none: this run only)."""
    if t.save == "head" and head_dir is not None:
        if store_default_tree(head, head_dir, paths, record):
            out.write(f"stored as the default tree of {head_dir} (tree.save=head)\n")
            # this machine's cached tree for the head would still win at tree=default: it goes
            cached = cache_path(head_dir, target, kernels, record["head_dtype"])
            if remove_cached_tree(cached):
                out.write(
                    f"removed this machine's earlier tree for it ({cached}): tree=default drafts the stored one\n"
                )
        else:
            out.write(f"{head_dir} is not writable here: pass the tree as tree=static 'tree.paths=...'\n")
    elif t.save == "cache" and head_dir is not None and (head_dir / CONFIG_NAME).is_file():
        # the head directory keeps its own tree: this one fits this machine only
        path = store_in_cache(cache_path(head_dir, target, kernels, record["head_dtype"]), paths, record)
        out.write(f"stored for this machine in {path}: tree=default uses it for this head here\n")
