"""tree=auto: the acceptance model must predict what the real loop accepts; calibration stores a tree."""

import io
import json
import random
import re
import types
from pathlib import Path

import pytest
import torch
from conftest import PlantedText, fails_for_some_seed, quick_head  # noqa: E402  (the quick overfitting helper)

from specheads.bench.calibrate import (
    BUILTIN_COPY_HEAVY,
    BUILTIN_PROMPTS,
    TEXT_NODES,
    calibrate_tree,
    calibration_texts,
    gate_choice,
    gated_depth,
    hybrid_choice,
    interpolate,
    text_acceptance,
    time_target,
)
from specheads.bench.questions import read_questions
from specheads.bench.replay import accepted_length, best_paths, path_frequencies, rank_vectors
from specheads.bench.session import Session
from specheads.bench.trees import cache_path, overlap, prompt_digest, prompts_record, store_in_cache, use_cached_tree
from specheads.config.infer import InferJobConfig, TreeConfig
from specheads.decode.baselines import PlainDrafter
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import HybridPolicy, hybrid_policy_for, policy_depth, tree_policy_for
from specheads.decode.tree import static_tree
from specheads.heads import load_head, save_head
from specheads.heads.io import draft_precision

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


def test_gate_choice_counts_each_position_at_the_depth_its_gate_allows():
    vectors = [(0, 0, 0), (0, 0, 1), (1,), (0, 5)]
    tops = [(0.9, 0.9, 0.9), (0.9, 0.3, 0.5), (0.2, 0.9, 0.9), (0.6, 0.4, 0.1)]
    paths = [[0], [1], [0, 0], [0, 0, 0]]
    target_s = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}
    draft_s = {1: 0.1, 2: 0.2, 3: 0.3}
    ungated, gated = gate_choice(vectors, tops, paths, target_s, draft_s, gates=(0.0, 0.5))
    # no gate: every step drafts 3 deep (5 tokens verified), accepting 3, 2, 1 and 1 drafts
    assert ungated["tau"] == pytest.approx((4 + 3 + 2 + 2) / 4)
    assert ungated["tokens_per_s"] == pytest.approx(11 / (4 * (1.4 + 0.3)))
    # gate 0.5: depths 3 (0.9, 0.81), 2 (0.9, then 0.27 < 0.5), 1 (0.2 < 0.5), 2 (0.6, then 0.24)
    assert [gated_depth(t, 3, 0.5) for t in tops] == [3, 2, 1, 2]
    assert gated["tau"] == pytest.approx((4 + 3 + 2 + 2) / 4)  # nothing lost: the cut drafts were wrong
    assert gated["tokens_per_s"] == pytest.approx(11 / ((1.4 + 0.3) + 2 * (1.3 + 0.2) + (1.2 + 0.1)))


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
    text = text_acceptance(planted + full, len(planted) + 8, 2, max(TEXT_NODES))
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


@pytest.mark.parametrize("trigger", [1, 2])
def test_the_text_alone_model_predicts_what_the_loop_accepts(trigger, tiny_target, sequences):
    """With a text-alone rule (trigger m, L nodes), a step whose last m tokens recurred accepts
    what the text's L nodes alone accept (text_acceptance with min_ngram=m), any other step
    max(head's path, text's path): the calibration's model, checked against the real loop."""
    head = quick_head(tiny_target, "eagle3", sequences, steps=60)
    paths = [[0], [1]]
    tree = {tuple(p) for p in paths}
    prompt = sequences[2:3, :8]
    ref = tiny_target.model.generate(prompt, max_new_tokens=32, do_sample=False)[0, 8:].tolist()
    planted = prompt[0].tolist() + [t if i % 5 != 2 else (t + 1) % 320 for i, t in enumerate(ref)]
    g, size = 3, 6
    policy = HybridPolicy(None, g, 2, text_alone=size, alone_ngram=trigger)
    res = speculative_generate(
        tiny_target, PlantedText(make_drafter(head, static_tree(paths)), policy, planted), prompt, SamplingConfig(32)
    )
    assert res.output_ids == ref
    full = prompt[0].tolist() + res.output_ids
    vectors = rank_vectors(tiny_target, head, full, 8, depth=1)
    text = text_acceptance(planted + full, len(planted) + 8, 2, max(TEXT_NODES))
    alone = text_acceptance(planted + full, len(planted) + 8, 2, size, min_ngram=trigger)
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


def plain_hybrid_score(vectors, text, alone, head, g, rule, target_s, lookup_s, tops=None):
    """One hybrid setting scored step by step: (tau, tokens per second). With tops (the head's
    top-1 chain at each position) and a gate in the head row, the head's part is the tree cut to
    the depth the gate drafts there, verified and drafted (draft_s by depth) at that size."""
    size, m = rule
    gate = head.get("min_path_prob", 0.0)
    tokens = seconds = 0.0
    for i, v in enumerate(vectors):
        if size and len(alone[m][i]) > 1:  # a text-alone step
            used = min(size, len(alone[m][i]) - 1)
            tokens += 1 + alone[m][i][used]
            seconds += interpolate(target_s, 1 + used) + lookup_s
            continue
        deepest = max((len(p) for p in head["paths"]), default=0)
        depth = gated_depth(tops[i], deepest, gate) if head["paths"] and gate and tops is not None else deepest
        kept = [p for p in head["paths"] if len(p) <= depth]
        drafting = head["draft_s"][depth] if "draft_s" in head and kept else head["draft_ms"] / 1e3
        tree = {tuple(p) for p in kept}
        a_h = max([k for k in range(1, len(v) + 1) if v[:k] in tree], default=0)
        used = min(g, len(text[i]) - 1)
        tokens += 1 + max(a_h, text[i][used])
        looked_up = g > 0 or size > 0
        seconds += interpolate(target_s, 1 + len(kept) + used) + drafting + lookup_s * looked_up
    return tokens / len(vectors), tokens / seconds


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


def check_hybrid_choice(score, seed, gated=False):
    rng = random.Random(seed)
    n = 40
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
    scored = hybrid_choice(vectors, text, rows, target_s, 1e-4, alone, [4, 8, 16], tops if gated else None)
    by_head = {r["nodes"]: r for r in [{"nodes": 0, "paths": [], "draft_ms": 0.0}, *rows]}
    rules = {(r["head_nodes"], r["ngram_nodes"], r["text_alone"], r["text_alone_ngram"]) for r in scored}
    assert (0, 4, 4, 1) not in rules and (2, 4, 4, 1) in rules and (2, 0, 0, 0) in rules  # no head: nothing to skip
    for r in scored:
        head = by_head[r["head_nodes"]]
        assert r["min_path_prob"] == (head.get("min_path_prob", 0.0) if head["nodes"] else 0.0)
        rule = (r["text_alone"], r["text_alone_ngram"])
        tau, speed = score(vectors, text, alone, head, r["ngram_nodes"], rule, target_s, 1e-4, tops=tops)
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
    def ungated(*args, tops=None):
        return plain_hybrid_score(*args, tops=None)

    assert fails_for_some_seed(lambda score, seed: check_hybrid_choice(score, seed, gated=True), ungated, range(5))


def test_the_hybrid_choice_check_fails_when_alone_steps_still_pay_the_head():
    def head_always(vectors, text, alone, head, g, rule, target_s, lookup_s, tops=None):
        tau, speed = plain_hybrid_score(vectors, text, alone, head, g, rule, target_s, lookup_s)
        fired = sum(len(a) > 1 for a in alone[rule[1]]) if rule[0] else 0
        seconds = tau * len(vectors) / speed + fired * head["draft_ms"] / 1e3
        return tau, tau * len(vectors) / seconds

    with pytest.raises(AssertionError):
        check_hybrid_choice(head_always, 0)


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
    monkeypatch.setattr(calibrate_module, "time_lookup", lambda context, ngram_max, nodes, repeats=5: 1e-4)


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
    monkeypatch.setattr(calibrate_module, "text_acceptance", lambda *a, **k: [(0,)] * len(real_text(*a, **k)))
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
    (line,) = lines_with(out, "is kept")
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
    assert config["calibration"]["hybrid"]["paths"] == first.hybrid_paths and not lines_with(out, "is kept")
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
# first, then the repeats. The raw minima are not monotone in n (2 and 8 measure faster than the
# counts below them, as a disturbed machine can make them), and the warm-ups are the extremes.
SCRIPTED = {4: [0.001, 0.625, 0.75], 1: [9.0, 0.5, 0.25], 8: [9.0, 0.375, 0.5], 2: [0.001, 0.125, 0.1875]}


def plain_time_target(scripted: dict[int, list[float]]) -> dict[int, float]:
    """What time_target must report, written plainly: the warm-up dropped, the minimum of the
    repeats, then for each n the largest minimum at or below it (more tokens never cost less)."""
    minima = {n: min(runs[1:]) for n, runs in scripted.items()}
    return {n: max(m for k, m in minima.items() if k <= n) for n in minima}


def scripted_time_target(monkeypatch, target) -> dict[int, float]:
    """time_target on the real target forwards, with a clock that advances by SCRIPTED per forward."""
    import specheads.bench.calibrate as calibrate

    clock, calls = [0.0], {n: iter(runs) for n, runs in SCRIPTED.items()}
    real_verify = calibrate.verify_tree

    def verify(target, tokens, layout, prefix, cache):
        out = real_verify(target, tokens, layout, prefix, cache)
        clock[0] += next(calls[len(tokens)])
        return out

    monkeypatch.setattr(calibrate, "verify_tree", verify)
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    times = time_target(target, list(range(1, 30)), list(SCRIPTED), repeats=2)
    assert all(next(left, None) is None for left in calls.values())  # every scripted forward ran
    return times


def test_time_target_keeps_the_minimum_repeat_and_never_lets_more_tokens_cost_less(monkeypatch, tiny_target):
    expected = plain_time_target(SCRIPTED)
    assert expected == {1: 0.25, 2: 0.25, 4: 0.625, 8: 0.625}  # the script does exercise the forcing
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
    "name, broken",
    [
        ("max", lambda measured, running: measured),  # no forcing: raw minima reported as they are
        ("min", lambda times: times[-1]),  # the last repeat, not the least disturbed one
    ],
    ids=["unforced", "last-repeat"],
)
def test_the_time_target_check_fails_on_a_broken_timer(monkeypatch, tiny_target, name, broken):
    """The check can fail: time_target with one of its two reductions broken is caught."""
    import specheads.bench.calibrate as calibrate

    monkeypatch.setattr(calibrate, name, broken, raising=False)  # shadows the builtin in that module only
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
