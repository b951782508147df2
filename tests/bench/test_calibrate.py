"""tree=auto: the acceptance model must predict what the real loop accepts; calibration stores a tree."""

import dataclasses
import io
import json
import random
import re
import types
from pathlib import Path

import pytest
import torch
from conftest import PlantedText, along_answer, fails_for_some_seed, quick_head, random_requests, tree_accepts  # noqa: E402  (the quick overfitting helper)

from specheads.bench.calibrate import (
    BUILTIN_COPY_HEAVY,
    BUILTIN_PROMPTS,
    TEXT_NODES,
    calibrate_tree,
    calibration_texts,
    gate_choice,
    gated_depth,
    hybrid_choice,
    hybrid_sizes,
    interpolate,
    step_context,
    text_acceptance,
    time_target,
    with_sizes,
)
from specheads.bench.questions import read_questions
from specheads.bench.replay import accepted_length, best_paths, path_frequencies, rank_vectors
from specheads.bench.session import Session
from specheads.bench.trees import cache_path, overlap, prompt_digest, prompts_record, store_in_cache, use_cached_tree
from specheads.config.infer import InferJobConfig, TreeConfig
from specheads.decode.baselines import PlainDrafter
from specheads.decode.drafters import HybridDrafter, make_drafter, make_hybrid_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import DynamicTreeSpec, HybridPolicy, hybrid_policy_for, policy_depth, tree_policy_for
from specheads.decode.suffix import TextDraft
from specheads.decode.tree import static_tree
from specheads.heads import load_head, save_head
from specheads.heads.io import draft_precision
from specheads.target import eos_token_ids

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
SHIPPED_HEAD = ROOT / "heads" / "smollm2-135m-eagle3"


def test_path_frequencies_and_best_paths_are_prefix_closed():
    vectors = [(0, 0, 1), (0, 1), (1, 0), (0, 0, 0), (2,), (0, 9)]
    freq = path_frequencies(vectors, top_k=3)
    assert freq[(0,)] == 4 and freq[(0, 0)] == 2 and (0, 9) not in freq
    for n in range(1, len(freq) + 1):
        paths = {tuple(p) for p in best_paths(freq, n)}
        assert all(p[:-1] in paths or len(p) == 1 for p in paths)
        static_tree([list(p) for p in paths])  # a valid tree


@pytest.mark.parametrize("family", ["medusa", "eagle3", "hydra", "dflash"])
def test_rank_vectors_predict_what_the_loop_accepts(family, tiny_target, sequences):
    """Two implementations agree: teacher-forced ranks vs the real drafting + verification."""
    head = quick_head(tiny_target, family, sequences, steps=60)
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    tree = {tuple(p) for p in paths}
    prompt = sequences[2:3, :8]
    res = speculative_generate(
        tiny_target, make_drafter(head, static_tree(paths)), prompt, SamplingConfig(max_new_tokens=32)
    )
    full = prompt[0].tolist() + res.output_ids
    vectors = rank_vectors(tiny_target, head, full, 8, depth=3)
    offset, checked = 0, 0
    for accepted, depth, emitted in zip(res.accepted_drafts, res.tree_depths, res.accept_lengths):
        if depth == 3:  # trees pruned near max_new_tokens are skipped
            v = vectors[offset]
            predicted = max([m for m in range(1, len(v) + 1) if v[:m] in tree], default=0)
            assert accepted == predicted
            checked += 1
        offset += emitted
    assert checked >= 3 and max(res.accepted_drafts) >= 2


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_the_gate_model_predicts_how_deep_the_gated_loop_drafts_and_what_it_accepts(family, tiny_target, sequences):
    """Teacher-forced top-1 probabilities (rank_vectors' top_probs) against the real gated drafter:
    the depth each step drafts and the drafts it accepts. The gate is set at the median chain
    probability, so that steps stop early and steps go deep."""
    head = quick_head(tiny_target, family, sequences, steps=25)
    paths = [[0], [1], [2], [0, 0], [0, 0, 0]]  # only the top-1 chain has children
    prompt = sequences[3:4, :8]
    cfg = SamplingConfig(max_new_tokens=40)
    plain = speculative_generate(tiny_target, PlainDrafter(), prompt, cfg)
    full = prompt[0].tolist() + plain.output_ids
    tops = []
    vectors = rank_vectors(tiny_target, head, full, 8, depth=3, top_probs=tops)
    chain = sorted(t[0] * t[1] for t in tops if len(t) >= 2)
    gate = chain[len(chain) // 2]
    res = speculative_generate(tiny_target, make_drafter(head, static_tree(paths, min_path_prob=gate)), prompt, cfg)
    assert res.output_ids == plain.output_ids  # the gate changes what is drafted, never the output
    tree = frozenset(tuple(p) for p in paths)
    offset, depths = 0, []
    for accepted, depth, emitted in zip(res.accepted_drafts, res.tree_depths, res.accept_lengths):
        v, top = vectors[offset], tops[offset]
        if cfg.max_new_tokens - offset - 2 >= 3:  # steps near max_new_tokens are cut by the loop, not the gate
            # the chain's probability past depth 1 is the drafted one where the top-1 draft was right
            if v[0] == 0 or top[0] < gate:
                assert depth == gated_depth(top, 3, gate)
                depths.append(depth)
            assert accepted == min(accepted_length(v, tree, 3), depth)
        offset += emitted
    assert 3 in depths and min(depths) < 3 and max(res.accepted_drafts) >= 1


def test_gate_choice_counts_each_step_at_the_depth_its_gate_allows():
    """One answer of 11 positions: the loop steps at positions 0, 4, 7 and 9 (each accepted run
    and its bonus token skip the positions in between, which the scoring must not count)."""
    steps = {0: ((0, 0, 0), (0.9, 0.9, 0.9)), 4: ((0, 0, 1), (0.9, 0.3, 0.5)), 7: ((1,), (0.2, 0.9, 0.9))}
    steps[9] = ((0, 5), (0.6, 0.4, 0.1))
    skipped = ((2,), (0.1, 0.1, 0.1))  # a position no step roots at: were it counted, tau would fall
    vectors, tops = zip(*(steps.get(i, skipped) for i in range(11)))
    paths = [[0], [1], [0, 0], [0, 0, 0]]
    target_s = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}
    draft_s = {1: 0.1, 2: 0.2, 3: 0.3}
    ungated, gated = gate_choice(vectors, tops, paths, target_s, draft_s, gates=(0.0, 0.5), lengths=[11])
    # no gate: every step drafts 3 deep (5 tokens verified), accepting 3, 2, 1 and 1 drafts: 11 tokens
    assert ungated["tau"] == pytest.approx((4 + 3 + 2 + 2) / 4)
    assert ungated["tokens_per_s"] == pytest.approx(11 / (4 * (1.4 + 0.3)))
    # gate 0.5: depths 3 (0.9, 0.81), 2 (0.9, then 0.27 < 0.5), 1 (0.2 < 0.5), 2 (0.6, then 0.24)
    assert [gated_depth(steps[i][1], 3, 0.5) for i in steps] == [3, 2, 1, 2]
    assert gated["tau"] == pytest.approx((4 + 3 + 2 + 2) / 4)  # nothing lost: the cut drafts were wrong
    assert gated["tokens_per_s"] == pytest.approx(11 / ((1.4 + 0.3) + 2 * (1.3 + 0.2) + (1.2 + 0.1)))
    # the same positions as 11 answers of one position each: every position a step of one token
    (alone,) = gate_choice(vectors, tops, paths, target_s, draft_s, gates=(0.0,), lengths=[1] * 11)
    assert alone["tau"] == 1.0 and alone["tokens_per_s"] == pytest.approx(1 / (1.4 + 0.3))


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_the_hybrid_model_predicts_what_the_hybrid_loop_accepts(family, tiny_target, sequences):
    """Two implementations agree: a merged tree accepts max(head's path, text's path), as
    calibration models it from rank vectors and text_acceptance, and as the real loop finds."""
    head = quick_head(tiny_target, family, sequences, steps=60)
    paths = [[0], [1]]
    tree = {tuple(p) for p in paths}
    prompt = sequences[2:3, :8]
    ref = hf_answer = tiny_target.model.generate(prompt, max_new_tokens=32, do_sample=False)[0, 8:].tolist()
    # the text holds the answer once before, with some tokens changed: text nodes get accepted
    planted = prompt[0].tolist() + [t if i % 7 != 3 else (t + 1) % 320 for i, t in enumerate(ref)]
    g = 6
    drafter = PlantedText(make_drafter(head, static_tree(paths)), HybridPolicy(None, g, 2), planted)
    res = speculative_generate(tiny_target, drafter, prompt, SamplingConfig(max_new_tokens=32))
    assert res.output_ids == hf_answer
    full = prompt[0].tolist() + res.output_ids
    vectors = rank_vectors(tiny_target, head, full, 8, depth=1)
    text, _ = text_acceptance(drafter.policy, [planted + full[:8]], [planted + full], max(TEXT_NODES))
    offset, checked, from_text = 0, 0, 0
    for accepted, emitted in zip(res.accepted_drafts, res.accept_lengths):
        if offset + 1 + 2 + 12 < len(res.output_ids):  # trees cut near max_new_tokens are skipped
            v = vectors[offset]
            head_part = max([m for m in range(1, len(v) + 1) if v[:m] in tree], default=0)
            text_part = text[offset][min(g, len(text[offset]) - 1)]
            assert accepted == max(head_part, text_part), offset
            checked += 1
            from_text += text_part > head_part
        offset += emitted
    assert checked >= 3 and from_text >= 1


@pytest.mark.parametrize("source", ["ngram", "suffix"])
@pytest.mark.parametrize("trigger", [1, 2])
def test_the_text_alone_model_predicts_what_the_loop_accepts(trigger, source, tiny_target, sequences):
    """With a text-alone rule (trigger m, L nodes), a step whose last m tokens recurred accepts
    what the text's L nodes alone accept (text_acceptance's for trigger m), any other step
    max(head's path, text's path): the calibration's model, checked against the real loop, over
    either text source."""
    head = quick_head(tiny_target, "eagle3", sequences, steps=60)
    paths = [[0], [1]]
    tree = {tuple(p) for p in paths}
    prompt = sequences[2:3, :8]
    ref = tiny_target.model.generate(prompt, max_new_tokens=32, do_sample=False)[0, 8:].tolist()
    planted = prompt[0].tolist() + [t if i % 5 != 2 else (t + 1) % 320 for i, t in enumerate(ref)]
    g, size = 3, 6
    policy = HybridPolicy(None, g, 2, text_alone=size, alone_ngram=trigger, source=source, suffix_match=4)
    res = speculative_generate(
        tiny_target, PlantedText(make_drafter(head, static_tree(paths)), policy, planted), prompt, SamplingConfig(32)
    )
    assert res.output_ids == ref
    full = prompt[0].tolist() + res.output_ids
    vectors = rank_vectors(tiny_target, head, full, 8, depth=1)
    request = ([planted + full[:8]], [planted + full])  # the text PlantedText drafts from
    text, _ = text_acceptance(policy, *request, max(TEXT_NODES))
    alone = text_acceptance(policy, *request, size, [trigger])[1][trigger]
    offset, checked = 0, {True: 0, False: 0}
    for accepted, emitted in zip(res.accepted_drafts, res.accept_lengths):
        if offset + 1 + 2 + 12 < len(res.output_ids):
            fired = len(alone[offset]) > 1
            if fired:
                predicted = alone[offset][-1]
            else:
                v = vectors[offset]
                head_part = max([m for m in range(1, len(v) + 1) if v[:m] in tree], default=0)
                predicted = max(head_part, text[offset][min(g, len(text[offset]) - 1)])
            assert accepted == predicted, offset
            checked[fired] += 1
        offset += emitted
    assert checked[True] >= 2 and checked[False] >= 1, checked


def plain_hybrid_score(
    vectors,
    text,
    alone,
    head,
    g,
    rule,
    target_s,
    lookup_s,
    tops=None,
    lengths=None,
    walked=True,
    alone_extra_s=0.0,
    *,
    drafts,
    truths,
    merged=True,
):
    """One hybrid setting scored step by step as the loop steps along the answers (`lengths`
    positions each; None: one answer): (tau, tokens per second). At a step the text-alone rule
    fires or the merged tree is verified; the step emits what it accepts and the target's token,
    nothing past its answer's end, and the next step is rooted at the last token it emitted.
    With tops (the head's top-1 chain at each position) and a gate in the head row, the head's
    part is the tree cut to the depth the gate drafts there, verified and drafted (draft_s by
    depth) at that size. walked=False: every position a step (the scoring before);
    alone_extra_s: seconds a text-alone step pays besides its verification and lookup. A merged
    step verifies the root, the head's nodes and those of the text's first g nodes (drafts' token
    paths) that are not on the head's accepted path (truths' first a_h tokens); merged=False:
    the two priced apart, the pricing before."""
    size, m = rule
    gate = head.get("min_path_prob", 0.0)

    def step(i):  # (drafts accepted, seconds) of a step rooted at position i
        if size and len(alone[m][i]) > 1:  # a text-alone step
            used = min(size, len(alone[m][i]) - 1)
            return alone[m][i][used], interpolate(target_s, 1 + used) + lookup_s + alone_extra_s
        deepest = max((len(p) for p in head["paths"]), default=0)
        depth = gated_depth(tops[i], deepest, gate) if head["paths"] and gate and tops is not None else deepest
        kept = [p for p in head["paths"] if len(p) <= depth]
        drafting = head["draft_s"][depth] if "draft_s" in head and kept else head["draft_ms"] / 1e3
        tree = {tuple(p) for p in kept}
        a_h = max([k for k in range(1, len(vectors[i]) + 1) if vectors[i][:k] in tree], default=0)
        used = min(g, len(text[i]) - 1)
        looked_up = g > 0 or size > 0
        on_head = {tuple(truths[i][:k]) for k in range(1, a_h + 1)}
        text_nodes = set(drafts[i].paths[:used]) - on_head if merged else drafts[i].paths[:used]
        nodes = 1 + len(kept) + len(text_nodes)
        return max(a_h, text[i][used]), interpolate(target_s, nodes) + drafting + lookup_s * looked_up

    tokens = seconds = steps = 0
    start = 0
    for n in lengths if lengths is not None else [len(vectors)]:
        i = 0
        while i < n:
            accepted, cost = step(start + i)
            steps += 1
            tokens += min(1 + accepted, n - i) if walked else 1 + accepted
            seconds += cost
            i += 1 + accepted if walked else 1
        start += n
    return tokens / steps, tokens / seconds


def random_acceptance(rng, n, nodes):
    """n positions of text acceptance (entry g = accepted with g nodes, non-decreasing, <= g)."""
    rows = []
    for _ in range(n):
        entry, best = [0], 0
        for k in range(1, rng.choice([0, 0, nodes, rng.randint(1, nodes)]) + 1):
            best = max(best, min(k, rng.choice([best, best, k])))
            entry.append(best)
        rows.append(tuple(entry))
    return rows


def random_lengths(rng, n):
    """n positions cut into answers of random lengths (some of 0 or 1 position)."""
    cuts = sorted(rng.sample(range(n + 1), rng.randint(0, 4)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n])]


def random_text_draft(rng, nodes):
    """A text draft of up to `nodes` token paths over the tokens 1-3, each path's prefixes before it."""
    paths = []
    for _ in range(rng.randint(0, nodes)):
        path = (*rng.choice([(), *paths]), rng.choice([1, 2, 3]))
        if path not in paths:
            paths.append(path)
    return TextDraft(tuple(paths), (0.5,) * len(paths))


def check_hybrid_choice(score, seed, gated=False):
    rng = random.Random(seed)
    n = 40
    lengths = random_lengths(rng, n)
    drafts = [random_text_draft(rng, max(TEXT_NODES)) for _ in range(n)]
    truths = [[rng.choice([1, 2, 3]) for _ in range(6)] for _ in range(n)]
    vectors = [tuple(rng.choice([0, 0, 1, 2]) for _ in range(rng.randint(1, 3))) for _ in range(n)]
    tops = [tuple(rng.choice([0.2, 0.5, 0.9]) for _ in range(3)) for _ in range(n)]
    text = random_acceptance(rng, n, max(TEXT_NODES))
    alone = {1: random_acceptance(rng, n, 16)}
    alone[2] = [a if rng.random() < 0.6 else (0,) for a in alone[1]]  # a longer trigger fires less often
    target_s = {k: 0.02 + 0.0004 * k * k for k in range(1, 40)}
    rows = [
        {"nodes": 2, "paths": [[0], [1]], "draft_ms": 1.5},
        {"nodes": 3, "paths": [[0], [0, 0], [1]], "draft_ms": 3.0},
    ]
    if gated:  # each head tree under its own gate, its drafting timed by depth
        rows[0].update(min_path_prob=0.3, draft_s={1: 1.5e-3})
        rows.append({"nodes": 5, "paths": [[0], [0, 0], [1], [0, 0, 0], [0, 1]], "draft_ms": 4.0})
        rows[2].update(min_path_prob=0.4, draft_s={1: 1e-3, 2: 2.5e-3, 3: 4e-3})
        rows[1].update(min_path_prob=0.15, draft_s={1: 1e-3, 2: 3e-3})
    scored = hybrid_choice(
        vectors,
        text,
        rows,
        target_s,
        1e-4,
        alone,
        [4, 8, 16],
        tops if gated else None,
        lengths=lengths,
        drafts=drafts,
        truths=truths,
    )
    by_head = {r["nodes"]: r for r in [{"nodes": 0, "paths": [], "draft_ms": 0.0}, *rows]}
    rules = {(r["head_nodes"], r["ngram_nodes"], r["text_alone"], r["text_alone_ngram"]) for r in scored}
    assert (0, 4, 4, 1) not in rules and (2, 4, 4, 1) in rules and (2, 0, 0, 0) in rules  # no head: nothing to skip
    for r in scored:
        head = by_head[r["head_nodes"]]
        assert r["min_path_prob"] == (head.get("min_path_prob", 0.0) if head["nodes"] else 0.0)
        rule = (r["text_alone"], r["text_alone_ngram"])
        tau, speed = score(
            vectors,
            text,
            alone,
            head,
            r["ngram_nodes"],
            rule,
            target_s,
            1e-4,
            tops=tops,
            lengths=lengths,
            drafts=drafts,
            truths=truths,
        )
        assert r["tau"] == pytest.approx(tau) and r["tokens_per_s"] == pytest.approx(speed), r


@pytest.mark.parametrize("seed", range(5))
def test_hybrid_choice_scores_every_setting_as_a_plain_step_by_step_count(seed):
    check_hybrid_choice(plain_hybrid_score, seed)


@pytest.mark.parametrize("seed", range(5))
def test_hybrid_choice_scores_a_gated_head_part_as_a_plain_step_by_step_count(seed):
    """The head's part of a hybrid tree under the depth gate it is drafted with: each step
    accepts, verifies and drafts only as deep as the gate lets it (as gate_choice counts the
    head's tree alone)."""
    check_hybrid_choice(plain_hybrid_score, seed, gated=True)


def test_the_gated_hybrid_check_fails_when_the_head_part_is_scored_ungated():
    def ungated(*args, tops=None, **kwargs):
        return plain_hybrid_score(*args, tops=None, **kwargs)

    assert fails_for_some_seed(lambda score, seed: check_hybrid_choice(score, seed, gated=True), ungated, range(5))


def test_the_hybrid_choice_check_fails_when_alone_steps_still_pay_the_head():
    def head_always(*args, **kwargs):
        return plain_hybrid_score(*args, **kwargs, alone_extra_s=args[3]["draft_ms"] / 1e3)

    with pytest.raises(AssertionError):
        check_hybrid_choice(head_always, 0)


def test_the_hybrid_choice_check_fails_when_shared_nodes_are_priced_twice():
    """The pricing before, the head's and the text's nodes counted apart where the two drafted the
    same token path, is caught."""

    def unmerged(*args, **kwargs):
        return plain_hybrid_score(*args, **kwargs, merged=False)

    assert fails_for_some_seed(check_hybrid_choice, unmerged, range(5))


def test_the_hybrid_choice_check_fails_when_every_position_is_a_step():
    """The check can fail: the scoring before, every position counted as a step (a long accepted
    run counted once per token of it), is caught."""

    def every_position(*args, **kwargs):
        return plain_hybrid_score(*args, **kwargs, walked=False)

    assert fails_for_some_seed(check_hybrid_choice, every_position, range(5))


def loop_steps(policy, prompts, contexts):
    """The hybrid drafter of `policy` over a head that drafts nothing (so that text-alone steps
    happen), driven as the loop drives it, the requests in turn, each step rejecting the draft:
    (text nodes drafted, drafts the tree accepts along the answer) at every answer position."""
    drafter = HybridDrafter(PlainDrafter(), policy)
    steps = []
    for ids, full in zip(prompts, contexts):
        drafter.start(torch.tensor([ids]), {}, full[len(ids)])
        for t in range(len(ids) - 1, len(full) - 2):
            tokens, layout = drafter.draft(full[t + 1], t + 2, max(TEXT_NODES))
            steps.append((len(tokens) - 1, tree_accepts(tokens, layout, full[t + 2 :])))
            drafter.advance({}, [full[t + 1]], full[t + 2])
    return steps


def check_text_acceptance(simulate, seed):
    """What calibration scores a text policy with (simulate: text_acceptance) is, step by step, what
    the loop's drafter of that policy drafts and accepts: the merged tree's g text nodes, or where
    the text-alone rule fires, its L nodes alone."""
    rng, prompts, contexts = random_requests(seed)
    g, size, m = rng.choice([0, 1, 2, 4, 8]), rng.choice([0, 2, 6]), rng.randint(1, 3)
    source = rng.choice(["ngram", "suffix"])
    policy = HybridPolicy(None, g, 3, size, m, source=source, suffix_match=4, suffix_history=rng.choice([0, 50]))
    text, alone = simulate(policy, prompts, contexts, max(TEXT_NODES), [m])
    steps = loop_steps(policy, prompts, contexts)
    assert len(steps) == len(text)
    for i, step in enumerate(steps):
        fired = size > 0 and len(alone[m][i]) > 1
        entry, budget = (alone[m][i], size) if fired else (text[i], g)
        used = min(budget, len(entry) - 1)
        assert step == (used, entry[used]), (seed, i, policy)


@pytest.mark.parametrize("seed", range(30))
def test_calibration_scores_a_text_policy_as_its_drafter_drafts(seed):
    check_text_acceptance(text_acceptance, seed)


@pytest.mark.parametrize(
    "wrong",
    [
        {"source": "ngram"},  # the n-gram simulation calibration ran before, whatever the loop drafted from
        {"source": "suffix"},
        {"suffix_history": 0},  # the earlier answers left out of the suffix index
    ],
    ids=["always-ngram", "always-suffix", "no-history"],
)
def test_the_text_acceptance_check_fails_on_another_text_source(wrong):
    def variant(policy, *args):
        return text_acceptance(dataclasses.replace(policy, **wrong), *args)

    assert fails_for_some_seed(check_text_acceptance, variant, range(30))


def test_calibration_scores_the_source_the_loop_drafts_from():
    """The issue's example: after 1 2 3 9 1 2 3 9 1 2 3 7 1 2 3 prompt lookup's n-gram source
    proposes 7 (the most recent match), the suffix index 9 (the most frequent); calibration scores
    each policy with what its own drafter proposes (the answer goes on with 9)."""
    prompt = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2]
    full = prompt + [3, 9, 1, 2]
    for source, first in (("ngram", 7), ("suffix", 9)):
        policy = HybridPolicy(None, 1, 3, 0, source=source)
        drafter = make_hybrid_drafter(None, policy)
        drafter.start(torch.tensor([prompt]), {}, 3)
        assert drafter.draft(3, len(prompt) + 1, 16)[0] == [3, first]
        text, _ = text_acceptance(policy, [prompt], [full], 16)
        assert text[0][1] == int(first == 9)


def fixed_costs(monkeypatch, verify_s=lambda n: 0.01 + 1e-5 * n, draft_s=1e-6):
    """Calibration's timings replaced by fixed ones (a target forward of n tokens: verify_s(n); a
    draft step: draft_s per level; the text's lookup: 0.1 ms), so that what it chooses follows from
    acceptance alone."""
    import specheads.bench.calibrate as calibrate_module

    def time_target(target, context, sizes, repeats=5):
        return {n: verify_s(n) for n in sizes}

    def time_draft(target, head, policy, prompt, repeats=5, accepted=3):
        return draft_s * policy_depth(policy)

    monkeypatch.setattr(calibrate_module, "time_target", time_target)
    monkeypatch.setattr(calibrate_module, "time_draft", time_draft)
    monkeypatch.setattr(calibrate_module, "time_lookup", lambda *args, **kwargs: 1e-4)


def calibrate(head, head_dir, target, **tree):
    settings = InferJobConfig(
        head_path=str(head_dir),
        tree=TreeConfig(
            kind="auto", depth=3, top_k=3, calibration_prompts=2, calibration_tokens=16, max_nodes=8, **tree
        ),
    )
    out = io.StringIO()
    chosen = calibrate_tree(settings, Session(target, head, head_dir, {}), out=out)
    assert chosen.kind in ("static", "dynamic") and 1 <= len(chosen.paths) <= 8 and "<- chosen" in out.getvalue()
    assert (chosen.kind == "dynamic") == (head.calibration["policy"] == "dynamic") == ("drafts it" in out.getvalue())
    return chosen, out.getvalue()


def test_calibration_prompts_come_from_every_category_in_turn(tmp_path):
    rows = [("writing", "w1"), ("writing", "w2"), ("writing", "w3"), ("math", "m1"), ("code", "c1"), ("math", "m2")]
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in enumerate(rows))
    )

    def texts(n):
        tree = TreeConfig(calibration_questions=str(questions), calibration_prompts=n)
        return calibration_texts(InferJobConfig(tree=tree))[1]

    assert texts(3) == ["w1", "m1", "c1"] and texts(9) == ["w1", "m1", "c1", "w2", "m2", "w3"]


def passage(prompt: str) -> str:
    """The text a prompt gives its answer to work on: the longest quoted span, the text after its
    first line or after its first ': ' ("" for none)."""
    spans = re.findall(r'"([^"]+)"', prompt) + re.findall(r"'([^']+)'", prompt)
    spans += [prompt.partition("\n")[2], prompt.partition(": ")[2]]
    return max(spans, key=len)


def test_the_builtin_prompts_are_half_chat_half_copy_heavy_after_the_recorded_sixteen():
    """24 built-in prompts, 12 chat and 12 copy-heavy, each copy-heavy one with its passage; the
    first 16 are those the shipped calibration recorded (its digests still name them), and none is
    a question of a benchmark set here."""
    shipped = json.loads((SHIPPED_HEAD / "config.json").read_text())["calibration"]["prompts"]
    assert shipped["source"] == "builtin" and shipped["count"] == 16
    assert [prompt_digest(p) for p in BUILTIN_PROMPTS[:16]] == shipped["sha256"]
    assert len(BUILTIN_PROMPTS) == 24 and len(BUILTIN_COPY_HEAVY) == 12 and BUILTIN_COPY_HEAVY <= set(range(24))
    for i, prompt in enumerate(BUILTIN_PROMPTS):
        if i in BUILTIN_COPY_HEAVY:
            assert len(passage(prompt)) >= 20, prompt
        else:
            assert passage(prompt) == "", prompt
    record = {"prompts": prompts_record("builtin", BUILTIN_PROMPTS)}
    sets = [
        ROOT / "specheads" / "data" / "dev_questions.jsonl",
        *sorted((ROOT.parent / "shared/data/eval").glob("*.jsonl")),
    ]
    for path in sets:
        assert overlap(record, read_questions(path), turns="all") == [], path


def files(directory):
    return {p.name: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("family", ["eagle", "hydra"])
def test_calibrate_tree_stores_a_tree_in_the_head_when_asked(family, tmp_path, tiny_target, sequences):
    head = quick_head(tiny_target, family, sequences, steps=30)
    head_dir = save_head(head, tmp_path / "head", dtype=torch.bfloat16)
    weights = (head_dir / "model.safetensors").read_bytes()
    chosen, out = calibrate(head, head_dir, tiny_target, save="head", dynamic="off")  # dynamic: the test below
    assert "stored as the default tree" in out
    config = json.loads((head_dir / "config.json").read_text())
    assert config["default_tree"] == chosen.paths
    assert config["calibration"]["prompts"]["source"] == "builtin" and config["calibration"]["prompts"]["count"] == 2
    assert (head_dir / "model.safetensors").read_bytes() == weights  # only config.json is rewritten (bf16 kept)
    reloaded = load_head(head_dir, tiny_target)
    assert tree_policy_for(reloaded, TreeConfig(kind="default")).size == len(chosen.paths) + 1
    # the hybrid split is chosen with it and stored where the calibration is
    hybrid = config["calibration"]["hybrid"]
    assert "hybrid:" in out and hybrid["ngram_nodes"] == chosen.ngram_nodes in TEXT_NODES
    assert hybrid["paths"] == chosen.hybrid_paths and hybrid["tau"] >= 1
    assert hybrid["text_alone"] == chosen.text_alone in (0, *TEXT_NODES)  # the text-alone rule too
    assert hybrid["text_alone_ngram"] == chosen.text_alone_ngram in (1, 2, 3)
    policy = hybrid_policy_for(reloaded, TreeConfig(kind="default"))
    assert (policy.text_alone, policy.alone_ngram) == (hybrid["text_alone"], hybrid["text_alone_ngram"])
    assert policy.ngram_nodes == chosen.ngram_nodes
    # the adaptive rule, where calibration expected it faster than the fixed split, drafts the head's
    # tree it was fitted with; else the split's own head part
    assert "hybrid, adaptive per step" in out and (policy.rule is not None) == ("rule" in hybrid)
    head_paths = hybrid["rule"]["paths"] if "rule" in hybrid else chosen.hybrid_paths
    assert (policy.head.paths if policy.head else ()) == tuple(tuple(p) for p in sorted(head_paths, key=len))
    fixed = hybrid_policy_for(reloaded, TreeConfig(kind="default", hybrid_rule="fixed"))
    assert fixed.rule is None and fixed.head == (static_tree(chosen.hybrid_paths) if chosen.hybrid_paths else None)


def test_the_hybrid_split_is_scored_stored_and_drafted_under_one_gate(tmp_path, monkeypatch, tiny_target, sequences):
    """calibrate_hybrid scores each head tree under the gate chosen with it (here tree.min_path_prob)
    with the head's top-1 chains, and records that gate with the split; tree=auto's run and later
    tree=default runs draft the split's head part under it."""
    import specheads.bench.calibrate as calibrate_module

    real, seen = calibrate_module.hybrid_choice, []

    def spy(vectors, text, rows, *args, **kwargs):
        scored = real(vectors, text, rows, *args, **kwargs)
        seen.append((len(vectors), rows, args[4] if len(args) > 4 else kwargs.get("top_probs"), scored))
        return scored

    monkeypatch.setattr(calibrate_module, "hybrid_choice", spy)
    # text that never repeats, cheap drafts and verification: the split gives the head nodes
    real_text = calibrate_module.text_acceptance

    def never_repeats(*args, **kwargs):
        text, alone = real_text(*args, **kwargs)
        return [(0,)] * len(text), {m: [(0,)] * len(rows) for m, rows in alone.items()}

    monkeypatch.setattr(calibrate_module, "text_acceptance", never_repeats)
    fixed_costs(monkeypatch)
    head = quick_head(tiny_target, "eagle3", sequences, steps=30)
    head_dir = save_head(head, tmp_path / "head")
    chosen, out = calibrate(head, head_dir, tiny_target, save="head", dynamic="off", min_path_prob=0.2)
    ((positions, rows, tops, scored),) = seen
    assert tops is not None and len(tops) == positions and {r["min_path_prob"] for r in rows} == {0.2}
    hybrid = json.loads((head_dir / "config.json").read_text())["calibration"]["hybrid"]
    best = max(scored, key=lambda r: r["tokens_per_s"])
    assert hybrid["paths"] and hybrid["min_path_prob"] == best["min_path_prob"] == 0.2 and "(gate p >= 0.2)" in out
    assert chosen.hybrid_min_path_prob == 0.2
    assert hybrid_policy_for(head, chosen).head.min_path_prob == 0.2  # the tree=auto run
    default = hybrid_policy_for(load_head(head_dir, tiny_target), TreeConfig(kind="default"))
    assert default.head.min_path_prob == 0.2 and default.head.paths == static_tree(hybrid["paths"]).paths


# text-source settings unlike the tree settings' defaults, so that a read-back that ignores a stored
# one drafts with another source than the one scored
STORED = {
    "ngram": {"text_source": "ngram", "ngram_max": 2, "suffix_match": 4, "suffix_history": 100},
    "suffix": {"text_source": "suffix", "ngram_max": 2, "suffix_match": 4, "suffix_history": 100},
}
SCORED = {}  # case -> what scored_calibration found (calibrated once per session)


def scored_calibration(case, tmp_path_factory, monkeypatch, tiny_target, sequences):
    """tree=auto tree.save=head with STORED[case]'s text source: (its head directory, the text
    policies its walks stepped the loop's text drafter with, the hybrid row it chose, the tree
    settings and head of that run)."""
    if case not in SCORED:
        import specheads.bench.calibrate as calibrate_module
        import specheads.bench.hybrid_fit as hybrid_fit

        walked, scored = [], []
        real_make, real_choice = getattr(hybrid_fit, "make_hybrid_drafter", None), calibrate_module.hybrid_choice

        def make(head, policy):
            walked.append(policy)
            return real_make(head, policy)

        def choice(*args, **kwargs):
            scored.append(real_choice(*args, **kwargs))
            return scored[-1]

        monkeypatch.setattr(hybrid_fit, "make_hybrid_drafter", make, raising=False)
        monkeypatch.setattr(calibrate_module, "hybrid_choice", choice)
        fixed_costs(monkeypatch)
        head = quick_head(tiny_target, "eagle3", sequences, steps=30)
        head_dir = save_head(head, tmp_path_factory.mktemp(case) / "head")
        chosen, _ = calibrate(head, head_dir, tiny_target, save="head", dynamic="off", **STORED[case])
        ((rows,),) = [scored]  # one split search, nothing before to weigh
        SCORED[case] = (head_dir, walked, max(rows, key=lambda r: r["tokens_per_s"]), chosen, head)
    return SCORED[case]


def text_source_of(policy: HybridPolicy) -> tuple:
    return policy.source, policy.ngram_max, policy.suffix_match, policy.suffix_history


def check_drafted_as_scored(policy: HybridPolicy, walked, best) -> None:
    """A hybrid policy read back from a calibration is the one it scored: the text drafter of every
    walk calibration stepped along its answers, and the split it chose (head tree and gate, text
    nodes, text-alone rule)."""
    assert walked and {text_source_of(p) for p in walked} == {text_source_of(policy)}
    assert (policy.ngram_nodes, policy.text_alone) == (best["ngram_nodes"], best["text_alone"])
    if best["text_alone"]:
        assert policy.alone_ngram == best["text_alone_ngram"]
    head = (policy.head.paths, policy.head.min_path_prob) if policy.head is not None else None
    scored = static_tree(best["paths"], best["min_path_prob"]) if best["paths"] else None
    assert head == ((scored.paths, scored.min_path_prob) if scored is not None else None)


@pytest.mark.parametrize("case", STORED)
def test_a_calibrated_split_drafts_with_the_text_source_and_split_it_was_scored_with(
    case, tmp_path_factory, monkeypatch, tiny_target, sequences
):
    """The hybrid split tree=auto stores is drafted as it was scored, by the tree=auto run and by a
    later tree=default run: the text source, n-gram length, suffix match and history it was scored
    with (not the tree settings' defaults), its text nodes, text-alone rule and head tree under its
    gate; the adaptive rule, kept only over the suffix source, drafts over that same source."""
    head_dir, walked, best, chosen, head = scored_calibration(
        case, tmp_path_factory, monkeypatch, tiny_target, sequences
    )
    given = tuple(STORED[case][k] for k in ("text_source", "ngram_max", "suffix_match", "suffix_history"))
    reloaded = load_head(head_dir, tiny_target)
    runs = {
        "tree=default": hybrid_policy_for(reloaded, TreeConfig(kind="default", hybrid_rule="fixed")),
        "tree=auto": hybrid_policy_for(head, dataclasses.replace(chosen, hybrid_rule="fixed")),
    }
    for run, policy in runs.items():
        assert text_source_of(policy) == given, run
        check_drafted_as_scored(policy, walked, best)
    adaptive = hybrid_policy_for(reloaded, TreeConfig(kind="default"))
    assert text_source_of(adaptive) == given
    assert (adaptive.rule is not None) == ("rule" in reloaded.calibration["hybrid"])
    assert case == "suffix" or adaptive.rule is None


@pytest.mark.parametrize("key", ["text_source", "ngram_max", "suffix_match", "suffix_history"])
def test_the_read_back_check_fails_when_a_stored_text_setting_is_ignored(
    key, tmp_path_factory, monkeypatch, tiny_target, sequences
):
    """The check can fail: a read-back that drops one stored text setting (so the tree settings'
    default drafts) is caught."""
    head_dir, walked, best, _, _ = scored_calibration("ngram", tmp_path_factory, monkeypatch, tiny_target, sequences)
    head = load_head(head_dir, tiny_target)
    del head.calibration["hybrid"][key]
    with pytest.raises(AssertionError):
        check_drafted_as_scored(hybrid_policy_for(head, TreeConfig(kind="default", hybrid_rule="fixed")), walked, best)


def with_calibration(head_dir, paths, record):
    """The head directory as tree=auto tree.save=head would leave it: config.json with this tree and record."""
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, "default_tree": paths, "calibration": record}))
    return head_dir


def test_a_recalibration_searches_what_the_existing_calibration_searched_unless_told(
    tmp_path, monkeypatch, tiny_target, sequences
):
    """tree=auto with its search keys left None searches what the head's calibration recorded
    (its `search`), and records that search again; a key given explicitly is searched instead."""
    fixed_costs(monkeypatch)
    head_dir = save_head(quick_head(tiny_target, "eagle3", sequences, steps=30), tmp_path / "head")
    search = {
        "depth": 2,
        "top_k": 2,
        "max_nodes": 4,
        "dynamic": "off",
        "calibration_prompts": 3,
        "calibration_tokens": 12,
    }
    with_calibration(head_dir, [[0]], {"search": search, "nodes": 1, "positions": 1, "policy": "static"})

    def recalibrate(**given):
        head = load_head(head_dir, tiny_target)
        settings = InferJobConfig(head_path=str(head_dir), tree=TreeConfig(kind="auto", save="none", **given))
        out = io.StringIO()
        calibrate_tree(settings, Session(tiny_target, head, head_dir, {}), out=out)
        return head.calibration, out.getvalue()

    record, out = recalibrate()
    assert record["search"] == search and "tree=auto searches as the calibration in" in out
    assert (record["prompts"]["count"], record["tokens"], record["depth"], record["top_k"]) == (3, 12, 2, 2)
    assert record["nodes"] <= 4 and "dynamic" not in record and "dynamic trees" not in out
    record, out = recalibrate(calibration_tokens=8, calibration_prompts=2, dynamic="weigh")
    assert record["search"] == {**search, "calibration_tokens": 8, "calibration_prompts": 2, "dynamic": "weigh"}
    assert record["tokens"] == 8 and record["prompts"]["count"] == 2 and "dynamic" in record


def test_calibrating_an_existing_head_leaves_it_as_shipped_and_caches_the_tree(
    tmp_path, monkeypatch, tiny_target, sequences
):
    """tree=auto (save=cache, the default): the head directory stays byte for byte; the tree goes to
    this machine's cache, keyed by the head's digest, and tree=default finds it there."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    questions = tmp_path / "questions.jsonl"
    texts = ["Tell me about rivers.", "Name a prime.", "Why  is\nthe sea salty?"]
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    head_dir = save_head(quick_head(tiny_target, "eagle", sequences, steps=30), tmp_path / "head")
    shipped = files(head_dir)
    chosen, out = calibrate(
        load_head(head_dir, tiny_target), head_dir, tiny_target, calibration_questions=str(questions)
    )
    assert files(head_dir) == shipped and "stored for this machine" in out
    cached = list((tmp_path / "cache" / "trees").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["default_tree"] == chosen.paths
    fresh = load_head(head_dir, tiny_target)
    assert fresh.default_tree is None and use_cached_tree(
        fresh, head_dir, tiny_target, kernels=False, out=io.StringIO()
    )
    assert fresh.default_tree == chosen.paths
    # the record names the prompts: a benchmark on the same questions overlaps on the first two
    assert fresh.calibration["prompts"] == {
        "source": "questions.jsonl",
        "count": 2,
        "sha256": [prompt_digest(t) for t in texts[:2]],
    }
    assert overlap(fresh.calibration, read_questions(questions)) == [0, 1]
    # another machine setting (the measured kernels) or another head's weights: nothing cached
    assert not use_cached_tree(load_head(head_dir, tiny_target), head_dir, tiny_target, kernels=True)
    other = save_head(quick_head(tiny_target, "eagle", sequences, steps=1), tmp_path / "other")
    assert not use_cached_tree(load_head(other, tiny_target), other, tiny_target, kernels=False)
    # save=none: this run only
    _, out = calibrate(load_head(other, tiny_target), other, tiny_target, save="none")
    assert "stored" not in out and len(list((tmp_path / "cache" / "trees").glob("*.json"))) == 1


def test_a_tree_saved_to_the_head_wins_over_this_machines_older_cached_tree(
    tmp_path, monkeypatch, tiny_target, sequences
):
    """tree=auto tree.save=head removes this machine's cached tree for the head, and tree=default
    skips a cached tree older than the head's own calibration (calibrated_at; none: older), so the
    head's new tree is the one drafted; a cached tree calibrated after it still wins."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    head_dir = save_head(quick_head(tiny_target, "eagle3", sequences, steps=30), tmp_path / "head")
    head = load_head(head_dir, tiny_target)
    cached = cache_path(head_dir, tiny_target, False, draft_precision(head))
    # a tree cached for this machine before (an earlier tree=auto, with no calibrated_at), one that
    # never accepts: the new tree replaces it (fixed costs: expected faster whatever the machine does)
    fixed_costs(monkeypatch)
    store_in_cache(cached, [[150]], {"nodes": 1, "positions": 1})
    chosen, out = calibrate(head, head_dir, tiny_target, save="head", dynamic="off")
    assert not cached.exists() and "removed this machine's earlier tree" in out
    stored = json.loads((head_dir / "config.json").read_text())["calibration"]
    assert stored["calibrated_at"].endswith("+00:00")
    fresh = load_head(head_dir, tiny_target)
    assert not use_cached_tree(fresh, head_dir, tiny_target, kernels=False, out=io.StringIO())
    assert tree_policy_for(fresh, TreeConfig(kind="default")).paths == static_tree(chosen.paths).paths
    # the older tree cached again (another copy of specheads, an older one): still not used
    store_in_cache(cached, [[150]], {"nodes": 1, "calibrated_at": "2020-01-01T00:00:00+00:00"})
    line = io.StringIO()
    assert not use_cached_tree(fresh, head_dir, tiny_target, kernels=False, out=line)
    assert fresh.default_tree == chosen.paths and line.getvalue().count("\n") == 1 and "newer" in line.getvalue()
    # one calibrated on this machine after the head's: that one is drafted
    store_in_cache(cached, [[150]], {"nodes": 1, "calibrated_at": "2999-01-01T00:00:00+00:00"})
    assert use_cached_tree(fresh, head_dir, tiny_target, kernels=False, out=io.StringIO())
    assert fresh.default_tree == [[150]]


def recalibrate(head_dir, target, **tree):
    """tree=auto on the head directory as infer.py runs it (the head loaded from it): (the settings
    it returns, its output, the head)."""
    head = load_head(head_dir, target)
    given = {"kind": "auto", "depth": 3, "top_k": 3, "calibration_prompts": 2, "calibration_tokens": 16}
    settings = InferJobConfig(head_path=str(head_dir), tree=TreeConfig(**(given | tree)))
    out = io.StringIO()
    chosen = calibrate_tree(settings, Session(target, head, head_dir, {}), out=out)
    return chosen, out.getvalue(), head


def lines_with(text, words):
    return [line for line in text.splitlines() if words in line]


def test_a_recalibration_expected_slower_keeps_the_calibration_before(tmp_path, monkeypatch, tiny_target, sequences):
    """The calibration before, scored on the positions and costs just measured, is expected faster
    than (or as fast as) a re-calibration that may not search as large trees: it is kept, one line
    says so with both speedups, nothing is stored, and this run drafts with it."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    fixed_costs(monkeypatch)
    head_dir = save_head(quick_head(tiny_target, "medusa", sequences, steps=60), tmp_path / "head")
    first, _, _ = recalibrate(head_dir, tiny_target, max_nodes=8, dynamic="off", save="head")
    stored = (head_dir / "config.json").read_bytes()
    record = json.loads(stored)["calibration"]
    assert record["nodes"] > 1  # what the second search below cannot reach
    chosen, out, head = recalibrate(head_dir, tiny_target, max_nodes=1, dynamic="off", save="head")
    (line,) = lines_with(out, "is kept, expected")
    assert "tree " in line and "hybrid " in line and line.count("x against") == 2 and "nothing stored" in line
    assert (head_dir / "config.json").read_bytes() == stored and not (tmp_path / "cache").exists()
    assert chosen.paths == first.paths and head.calibration == record and head.default_tree == first.paths
    assert tree_policy_for(head, chosen).paths == tree_policy_for(head, TreeConfig(kind="default")).paths
    assert (chosen.hybrid_paths, chosen.hybrid_min_path_prob) == (first.hybrid_paths, first.hybrid_min_path_prob)


def test_a_recalibration_expected_faster_replaces_the_calibration_before_part_by_part(
    tmp_path, monkeypatch, tiny_target, sequences
):
    """A calibration before whose tree and hybrid split never accept (rank 150) is replaced; one whose
    tree is the best there is but whose split never accepts keeps its tree and takes the new split."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    fixed_costs(monkeypatch)
    head_dir = save_head(quick_head(tiny_target, "medusa", sequences, steps=60), tmp_path / "head")
    first, _, _ = recalibrate(head_dir, tiny_target, max_nodes=8, dynamic="off", save="head")
    best = json.loads((head_dir / "config.json").read_text())["calibration"]
    never = {"paths": [[150]], "min_path_prob": 0.0, "ngram_nodes": 0, "ngram_max": 3, "text_alone": 0}
    with_calibration(head_dir, [[150]], {**best, "nodes": 1, "min_path_prob": 0.0, "hybrid": never})
    chosen, out, _ = recalibrate(head_dir, tiny_target, max_nodes=8, dynamic="off", save="head")
    config = json.loads((head_dir / "config.json").read_text())
    assert config["default_tree"] == chosen.paths == first.paths and "kept" not in config["calibration"]
    assert config["calibration"]["hybrid"]["paths"] == first.hybrid_paths and not lines_with(out, "is kept, expected")
    assert len(lines_with(out, "the new calibration replaces")) == 1
    # the best tree before, with a split that never accepts: only the split is replaced
    with_calibration(head_dir, first.paths, {**best, "calibrated_at": "2020-01-01T00:00:00+00:00", "hybrid": never})
    chosen, out, _ = recalibrate(head_dir, tiny_target, max_nodes=1, dynamic="off", save="head")
    config = json.loads((head_dir / "config.json").read_text())
    assert config["calibration"]["kept"] == ["tree"] and config["default_tree"] == chosen.paths == first.paths
    assert config["calibration"]["nodes"] == best["nodes"] and config["calibration"]["hybrid"]["paths"] != [[150]]
    assert config["calibration"]["calibrated_at"] > "2020" and "except its tree" in out


def test_too_few_positions_to_decide_change_nothing(tmp_path, monkeypatch, tiny_target, sequences):
    """A re-calibration measured on fewer positions than the calibration before says so in one line
    (how many it needs) and changes nothing: this run drafts with the calibration before;
    tree.replace=always replaces it regardless."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    fixed_costs(monkeypatch)
    head_dir = save_head(quick_head(tiny_target, "eagle3", sequences, steps=30), tmp_path / "head")
    record = {"positions": 5000, "nodes": 2, "min_path_prob": 0.1, "policy": "static", "tokens": 16}
    with_calibration(head_dir, [[0], [1]], record)
    stored = (head_dir / "config.json").read_bytes()
    for save in ("head", "cache"):
        chosen, out, head = recalibrate(head_dir, tiny_target, max_nodes=8, save=save)
        (line,) = lines_with(out, "too few positions")
        assert "5000" in line and "tree.calibration_prompts" in line and "nothing changed" in line
        assert "<- chosen" not in out and (head_dir / "config.json").read_bytes() == stored
        assert not (tmp_path / "cache").exists() and head.calibration == record
        assert (chosen.kind, chosen.paths, chosen.min_path_prob) == ("static", [[0], [1]], 0.1)
    chosen, out, _ = recalibrate(head_dir, tiny_target, max_nodes=8, save="head", replace="always")
    assert "too few" not in out and json.loads((head_dir / "config.json").read_text())["calibration"] != record


# Scripted seconds of each timed verification forward, per query-token count: the warm-up call
# first, then the repeats. The raw means are not monotone in n (2 and 8 measure faster than the
# counts below them, as a disturbed machine can make them), and the warm-ups are the extremes.
SCRIPTED = {4: [0.001, 0.625, 0.75], 1: [9.0, 0.5, 0.25], 8: [9.0, 0.375, 0.5], 2: [0.001, 0.125, 0.1875]}


def plain_time_target(scripted: dict[int, list[float]]) -> dict[int, float]:
    """What time_target must report, written plainly: the warm-up dropped, the mean of the repeats
    (what the loop pays), then the least-squares non-decreasing fit over n (more tokens never cost
    less), by brute force."""
    from test_timing import brute_force_isotonic

    means = {n: sum(runs[1:]) / len(runs[1:]) for n, runs in scripted.items()}
    return dict(zip(sorted(means), brute_force_isotonic([means[n] for n in sorted(means)])))


def scripted_time_target(monkeypatch, target) -> dict[int, float]:
    """time_target on the real target forwards, with a clock that advances by SCRIPTED per forward."""
    import specheads.bench.calibrate as calibrate
    import specheads.bench.timing as timing

    clock, calls = [0.0], {n: iter(runs) for n, runs in SCRIPTED.items()}
    real_verify = calibrate.verify_tree

    def verify(target, tokens, layout, prefix, cache):
        out = real_verify(target, tokens, layout, prefix, cache)
        clock[0] += next(calls[len(tokens)])
        return out

    monkeypatch.setattr(calibrate, "verify_tree", verify)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    times = time_target(target, list(range(1, 30)), list(SCRIPTED), repeats=2)
    assert all(next(left, None) is None for left in calls.values())  # every scripted forward ran
    return times


def test_time_target_keeps_the_mean_repeat_and_never_lets_more_tokens_cost_less(monkeypatch, tiny_target):
    expected = plain_time_target(SCRIPTED)
    # the script does exercise the fit: means 0.375, 0.15625, 0.6875, 0.4375 pooled in pairs
    assert expected == pytest.approx({1: 0.265625, 2: 0.265625, 4: 0.5625, 8: 0.5625})
    assert scripted_time_target(monkeypatch, tiny_target) == pytest.approx(expected)


def test_time_target_times_every_size_in_each_round_after_a_small_forward(monkeypatch, tiny_target):
    """A slow spell of the machine falls on all sizes alike: every round (the warm-up, then each
    repeat) times each size once, instead of one size's repeats after another's."""
    import specheads.bench.calibrate as calibrate

    order, real_verify, real_settle = [], calibrate.verify_tree, calibrate.settle_forward

    def verify(target, tokens, layout, prefix, cache):
        order.append(len(tokens))
        return real_verify(target, tokens, layout, prefix, cache)

    def settle(target, token, cache):
        order.append("settle")
        before = cache.get_seq_length()
        real_settle(target, token, cache)
        assert cache.get_seq_length() == before  # the settling token leaves the cache as it was

    monkeypatch.setattr(calibrate, "verify_tree", verify)
    monkeypatch.setattr(calibrate, "settle_forward", settle)
    time_target(tiny_target, list(range(1, 30)), [1, 2, 4], repeats=2)
    # each timed forward follows an untimed 1-token one, as a decoding step follows another step
    assert order == ["settle", 1, "settle", 2, "settle", 4] * 3


@pytest.mark.parametrize(
    "module, name, broken",
    [
        ("calibrate", "isotonic", list),  # no forcing: raw means reported as they are
        # the running maximum before: one size's noise copied onto every larger size
        ("calibrate", "isotonic", lambda xs: [max(xs[: i + 1]) for i in range(len(xs))]),
        ("timing", "fmean", min),  # the least disturbed repeat, which the loop does not get
        ("timing", "fmean", lambda times: times[-1]),  # the last repeat
    ],
    ids=["unforced", "running-max", "min-repeat", "last-repeat"],
)
def test_the_time_target_check_fails_on_a_broken_timer(monkeypatch, tiny_target, module, name, broken):
    """The check can fail: time_target with one of its two reductions broken is caught."""
    import importlib

    # shadows the name in that module only
    monkeypatch.setattr(importlib.import_module(f"specheads.bench.{module}"), name, broken, raising=False)
    assert scripted_time_target(monkeypatch, tiny_target) != pytest.approx(plain_time_target(SCRIPTED))


def test_calibration_chooses_a_dynamic_tree_when_it_is_faster_and_tree_default_drafts_it(
    tmp_path, monkeypatch, tiny_target, sequences
):
    """Static trees priced out (their expected speed set to 0): the floored dynamic tree is chosen,
    stored with the static tree the exporters read, and tree=default decodes it losslessly; with
    tree.dynamic=off the static tree is chosen again, with tree.dynamic=only a dynamic one."""
    import specheads.bench.calibrate as calibrate_module

    real_gate_choice = calibrate_module.gate_choice

    def static_priced_out(*args, **kwargs):
        return [{**r, "tokens_per_s": 0.0} for r in real_gate_choice(*args, **kwargs)]

    monkeypatch.setattr(calibrate_module, "gate_choice", static_priced_out)
    head = quick_head(tiny_target, "eagle3", sequences, steps=30)
    head_dir = save_head(head, tmp_path / "head")
    chosen, out = calibrate(head, head_dir, tiny_target, save="head")
    assert chosen.kind == "dynamic" and "dynamic tree: depth" in out
    config = json.loads((head_dir / "config.json").read_text())
    stored = config["calibration"]["dynamic"]
    assert config["calibration"]["policy"] == "dynamic" and config["default_tree"] == chosen.paths
    assert (stored["depth"], stored["top_k"], stored["total_tokens"], stored["min_path_prob"]) == (
        chosen.depth,
        chosen.top_k,
        chosen.total_tokens,
        chosen.min_path_prob,
    )
    reloaded = load_head(head_dir, tiny_target)
    policy = tree_policy_for(reloaded, TreeConfig(kind="default"))
    assert (policy.depth, policy.top_k, policy.total_tokens, policy.min_path_prob) == (
        chosen.depth,
        chosen.top_k,
        chosen.total_tokens,
        chosen.min_path_prob,
    )
    # an explicit floor still wins over the stored one; an explicit static tree is static
    assert tree_policy_for(reloaded, TreeConfig(kind="default", min_path_prob=0.5)).min_path_prob == 0.5
    assert tree_policy_for(reloaded, TreeConfig(kind="chain", depth=2)).size == 3
    cfg = SamplingConfig(max_new_tokens=24)
    accepted = 0
    for row in range(3):
        prompt = sequences[row : row + 1, :8]
        plain = speculative_generate(tiny_target, PlainDrafter(), prompt, cfg)
        res = speculative_generate(tiny_target, make_drafter(reloaded, policy), prompt, cfg)
        assert res.output_ids == plain.output_ids
        accepted += sum(res.accepted_drafts)
    assert accepted > 0
    monkeypatch.setattr(calibrate_module, "gate_choice", real_gate_choice)
    # (replace=always: what each search chooses, not the calibration stored above where it is faster)
    again = {"save": "none", "replace": "always"}
    chosen, _ = calibrate(load_head(head_dir, tiny_target), head_dir, tiny_target, dynamic="off", **again)
    assert chosen.kind == "static"
    # only: a dynamic tree whatever the static trees are priced at, no wider than tree.top_k
    chosen, out = calibrate(load_head(head_dir, tiny_target), head_dir, tiny_target, dynamic="only", **again)
    assert chosen.kind == "dynamic" and chosen.top_k in (2, 3) and "drafts it" in out


DYNAMIC_RULE = {}  # what dynamic_rule_calibration found (calibrated once per session)


def dynamic_rule_calibration(tmp_path_factory, monkeypatch, tiny_target, sequences):
    """tree=auto tree.dynamic=only tree.save=head, its adaptive rule kept (the fixed split's expected
    speedup set to 0) and fitted with the calibrated dynamic tree as its only head tree: (the head
    directory, the head, and the rule fit's prompts, contexts and head candidates)."""
    if not DYNAMIC_RULE:
        import specheads.bench.calibrate as calibrate_module

        real_fit, real_split, seen = calibrate_module.calibrate_rule, calibrate_module.calibrate_hybrid, []

        def fit(prompts, contexts, text, heads, verify_ms):
            seen.append((prompts, contexts, heads))
            return real_fit(prompts, contexts, text, [h for h in heads if "dynamic" in h[0]], verify_ms)

        monkeypatch.setattr(calibrate_module, "calibrate_rule", fit)
        monkeypatch.setattr(
            calibrate_module, "calibrate_hybrid", lambda *a, **k: {**real_split(*a, **k), "expected_speedup": 0.0}
        )
        # calibrated on the prompts the head was overfitted on, so that it drafts trees worth verifying
        prompts = [row[:8].tolist() for row in sequences[:4]]
        texts = [str(ids) for ids in prompts]
        monkeypatch.setattr(calibrate_module, "calibration_prompts", lambda *a: ("sequences", texts, prompts))
        fixed_costs(monkeypatch)
        head = quick_head(tiny_target, "eagle3", sequences, steps=60)
        head_dir = save_head(head, tmp_path_factory.mktemp("dynamic-rule") / "head")
        calibrate(head, head_dir, tiny_target, save="head", dynamic="only")
        ((prompts, contexts, heads),) = seen
        DYNAMIC_RULE.update(head_dir=head_dir, head=head, prompts=prompts, contexts=contexts, heads=heads)
    return DYNAMIC_RULE


def test_the_adaptive_rule_weighs_the_calibrated_dynamic_tree_by_what_it_accepts(
    tmp_path_factory, monkeypatch, tiny_target, sequences
):
    """tree=auto offers the adaptive rule the calibrated dynamic tree (the one tree=default drafts)
    as a head tree beside the static ones, scored by what its real drafter accepts at every
    calibration position."""
    from test_dynamic_trees import drafted_at_each_position

    found = dynamic_rule_calibration(tmp_path_factory, monkeypatch, tiny_target, sequences)
    head, calibration = found["head"], found["head"].calibration
    spec = tree_policy_for(head, TreeConfig(kind="default"))
    assert calibration["policy"] == "dynamic" and isinstance(spec, DynamicTreeSpec)
    ((candidate, accepted),) = [h for h in found["heads"] if "dynamic" in h[0]]
    assert candidate["dynamic"] == spec and any("paths" in h[0] for h in found["heads"])
    real = [
        a
        for ids, full in zip(found["prompts"], found["contexts"])
        if len(full) - len(ids) >= 2
        for a, _, _ in drafted_at_each_position(tiny_target, head, full, len(ids), spec)
    ]
    assert accepted == real and len(real) == calibration["positions"] and sum(real) > 0


def head_trees(drafter, head_part, target, full: list[int], start: int, depth: int) -> list[tuple]:
    """(tokens, parents) of the head's tree that head_part(drafter) drafts at each answer position
    of `full` (the answer from `start`), the drafter fed one true token at a time as in decoding."""

    def tree(drafter, r):
        tokens, layout = head_part(drafter).draft(full[r], r, depth)
        return list(tokens), layout.parents

    return along_answer(drafter, target, full, start, tree)


def check_hybrid_drafts_the_spec_tree(head, target, prompt) -> None:
    """Under tree=default the hybrid drafter's head part drafts the tree spec drafts: the same
    tokens and layout at every position of the target's greedy answer."""
    cfg = SamplingConfig(max_new_tokens=16)
    full = prompt[0].tolist() + speculative_generate(target, PlainDrafter(), prompt, cfg).output_ids
    spec = make_drafter(head, tree_policy_for(head, TreeConfig(kind="default")))
    hybrid = make_hybrid_drafter(head, hybrid_policy_for(head, TreeConfig(kind="default")))
    assert hybrid.policy.rule is not None and hybrid.inner is not None
    start, depth = prompt.shape[1], 8
    own = head_trees(spec, lambda d: d, target, full, start, depth)
    assert head_trees(hybrid, lambda d: d.inner, target, full, start, depth) == own


def test_hybrid_drafts_the_calibrated_dynamic_tree_that_spec_drafts(
    tmp_path_factory, monkeypatch, tiny_target, sequences
):
    """An adaptive rule fitted with the calibrated dynamic tree as its head tree has the hybrid
    drafter draft that dynamic tree, as spec does under tree=default (read back from the head)."""
    found = dynamic_rule_calibration(tmp_path_factory, monkeypatch, tiny_target, sequences)
    reloaded = load_head(found["head_dir"], tiny_target)
    rule = reloaded.calibration["hybrid"]["rule"]
    assert rule["dynamic"] == {k: reloaded.calibration["dynamic"][k] for k in rule["dynamic"]}
    check_hybrid_drafts_the_spec_tree(reloaded, tiny_target, sequences[2:3, :8])


def test_the_same_tree_check_fails_for_a_static_rule_tree(tmp_path_factory, monkeypatch, tiny_target, sequences):
    """The check can fail: the rule as it was stored before (a static head tree, here the calibrated
    static tree under its gate) drafts another tree than spec's dynamic one."""
    found = dynamic_rule_calibration(tmp_path_factory, monkeypatch, tiny_target, sequences)
    head = load_head(found["head_dir"], tiny_target)
    rule = head.calibration["hybrid"]["rule"]
    del rule["dynamic"]
    rule.update(paths=head.default_tree, min_path_prob=head.calibration["min_path_prob"])
    with pytest.raises(AssertionError):
        check_hybrid_drafts_the_spec_tree(head, tiny_target, sequences[2:3, :8])


def test_verification_is_timed_after_the_mean_context_of_the_loops_steps():
    """step_context: the longest context cut to the mean length the loop verifies after, over every
    answer position (the prompt and the answer tokens before the step's root)."""
    prompts = [[1] * 10, [2] * 4, [3] * 6]
    contexts = [prompts[0] + [5] * 5, prompts[1] + [6] * 21, prompts[2]]  # answers of 5, 21 and 0 tokens
    before = [len(ids) + i for ids, full in zip(prompts, contexts) for i in range(len(full) - len(ids) - 1)]
    assert len(before) == 4 + 20 and sum(before) / len(before) == pytest.approx(316 / 24)
    assert step_context(prompts, contexts) == contexts[1][:13]
    assert step_context([[1, 2]], [[1, 2, 3]]) == [1, 2, 3]  # no position: the longest context


def test_with_sizes_times_every_size_in_one_run(monkeypatch):
    """The sizes target_s lacks are not timed in a second run merged with the first: all of them,
    the ones it had included, are timed together (the same machine state, one monotone fit)."""
    import specheads.bench.calibrate as calibrate_module

    runs = []

    def time_target(target, context, sizes, repeats=5):
        runs.append(sorted(sizes))
        return {n: 0.5 + n for n in sizes}

    monkeypatch.setattr(calibrate_module, "time_target", time_target)
    first = {1: 1.0, 2: 2.0, 4: 4.0}
    assert with_sizes(None, [1, 2], first, {2, 4}) is first and runs == []
    assert with_sizes(None, [1, 2], first, {3, 4, 8}) == {n: 0.5 + n for n in (1, 2, 3, 4, 8)}
    assert runs == [[1, 2, 3, 4, 8]]


def test_expected_tau_is_what_the_loop_measures_on_the_calibration_prompts(monkeypatch, tiny_target, sequences):
    """tree=auto's expected tau against decoding its own calibration prompts through the loop
    (speculative_generate, as the benchmark runs it) with what it chose, to calibration_tokens
    tokens: the static tree (spec; no depth gate, no dynamic tree), the fixed hybrid split and the
    adaptive rule (one drafter for the prompts in turn, as a serving process keeps its text
    history). The prompts ask twice each, so that the second answers copy the first ones from the
    history in long runs. The answers are the same greedy ones and the walk takes the loop's
    steps, so they agree to the record's rounding (4 decimals), EOS and the token limit included
    (a step's drafts reaching past the answer's end are cut there in both); the per-position
    average the scorers took before does not. Verification is timed once, every size together,
    after the mean context of the steps. The loop hands the drafter each answer's last committed
    tokens (finish), so its text history holds the whole answer, as calibration's text walk
    (hybrid_fit.walk_text) counts it; without that the copying answers accept less near their end."""
    import specheads.bench.calibrate as calibrate_module

    fixed_costs(monkeypatch)
    fixed_time, timed = calibrate_module.time_target, []

    def time_target(target, context, sizes, repeats=5):
        timed.append((list(context), sorted(sizes)))
        return fixed_time(target, context, sizes, repeats)

    monkeypatch.setattr(calibrate_module, "time_target", time_target)
    # the adaptive rule kept whatever the fixed split is expected to do, so that both are measured
    real_split, real_choice, scored = calibrate_module.calibrate_hybrid, calibrate_module.hybrid_choice, []
    monkeypatch.setattr(
        calibrate_module, "calibrate_hybrid", lambda *a, **k: {**real_split(*a, **k), "expected_speedup": 0.0}
    )
    monkeypatch.setattr(
        calibrate_module, "hybrid_choice", lambda *a, **k: scored.append((a, k)) or real_choice(*a, **k)
    )
    prompts = [row[:8].tolist() for row in sequences[[0, 1, 0, 1]]]
    texts = [str(ids) for ids in prompts]
    monkeypatch.setattr(calibrate_module, "calibration_prompts", lambda *a: ("sequences", texts, prompts))
    head = quick_head(tiny_target, "eagle3", sequences, steps=25)
    tokens = 32
    tree = TreeConfig(
        kind="auto", depth=3, top_k=3, calibration_prompts=4, calibration_tokens=tokens, max_nodes=8,
        dynamic="off", min_path_prob=0.0, save="none",
    )  # fmt: skip
    chosen = calibrate_tree(InferJobConfig(tree=tree), Session(tiny_target, head, None, {}), out=io.StringIO())
    record = head.calibration
    assert record["policy"] == "static" and record["min_path_prob"] == 0.0
    cfg = SamplingConfig(max_new_tokens=tokens, eos_token_ids=eos_token_ids(tiny_target))

    def measured(drafter, finish=True) -> float:
        if not finish:  # the loop as it was: no finish() after an answer's last step
            drafter.finish = lambda tokens: None
        made = forwards = 0
        for ids in prompts:
            res = speculative_generate(tiny_target, drafter, torch.tensor([ids]), cfg)
            made, forwards = made + res.new_tokens - 1, forwards + res.target_forwards
        return made / forwards

    spec = measured(make_drafter(head, static_tree(chosen.paths)))
    assert spec == pytest.approx(record["tau"], abs=1e-4) and spec > 1.5
    split = hybrid_policy_for(head, dataclasses.replace(chosen, hybrid_rule="fixed"))
    adaptive = hybrid_policy_for(head, chosen)
    assert split.rule is None and adaptive.rule is not None
    hybrid = record["hybrid"]
    assert hybrid["tau"] > spec + 0.5 and (split.text_alone or split.ngram_nodes)  # the text is drafted
    assert measured(make_hybrid_drafter(head, split)) == pytest.approx(hybrid["tau"], abs=1e-4)
    assert measured(make_hybrid_drafter(head, adaptive)) == pytest.approx(hybrid["rule"]["tau"], abs=1e-4)
    # without finish() the history lacks each answer's last run: less than expected
    assert measured(make_hybrid_drafter(head, split), finish=False) < hybrid["tau"] - 1e-3
    # the per-position average the scorers took before is off: these checks tell it apart
    ((args, kwargs),) = scored  # the split's search: every position's acceptance, as scored
    vectors, text, rows, target_s, lookup_s, alone, _, tops = args
    head_row = next((r for r in rows if r["paths"] == hybrid["paths"]), {"nodes": 0, "paths": [], "draft_ms": 0.0})
    split_of = (vectors, text, alone, head_row, hybrid["ngram_nodes"], (hybrid["text_alone"], split.alone_ngram))
    texts_of = {"drafts": kwargs["drafts"], "truths": kwargs["truths"]}
    walked, _ = plain_hybrid_score(*split_of, target_s, lookup_s, tops, kwargs["lengths"], **texts_of)
    every_position, _ = plain_hybrid_score(
        *split_of, target_s, lookup_s, tops, kwargs["lengths"], walked=False, **texts_of
    )
    assert walked == pytest.approx(hybrid["tau"], abs=1e-4) and every_position - walked > 1.0
    paths = frozenset(tuple(p) for p in chosen.paths)
    depth = max(map(len, paths))
    contexts = [ids + hf_answer(tiny_target, ids, cfg) for ids in prompts]
    per_position = [
        1 + accepted_length(v, paths, depth)
        for ids, full in zip(prompts, contexts)
        for v in rank_vectors(tiny_target, head, full, len(ids), depth)
    ]
    assert sum(per_position) / len(per_position) != pytest.approx(spec, abs=1e-2)
    # verification timed once, every size the trees and the hybrid price, after the steps' mean context
    ((context, sizes),) = timed
    assert context == step_context(prompts, contexts)
    assert {r["nodes"] + 1 for r in rows} | hybrid_sizes(max(r["nodes"] for r in rows)) <= set(sizes)


def hf_answer(target, ids, cfg) -> list[int]:
    """The target's greedy answer to `ids`, as calibration takes it (decode.baselines.hf_generate)."""
    from specheads.decode.baselines import hf_generate

    return hf_generate(target, torch.tensor([ids]), dataclasses.replace(cfg))["output_ids"]
