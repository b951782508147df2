"""tree=auto: the acceptance model must predict what the real loop accepts; calibration stores a tree."""

import io
import json
import types

import pytest
import torch
from conftest import quick_head  # noqa: E402  (the quick overfitting helper)

from specheads.bench.calibrate import (
    TEXT_NODES,
    best_paths,
    calibrate_tree,
    path_frequencies,
    rank_vectors,
    text_acceptance,
    time_target,
)
from specheads.bench.questions import read_questions
from specheads.bench.session import Session
from specheads.bench.trees import overlap, prompt_digest, use_cached_tree
from specheads.config.infer import InferJobConfig, TreeConfig
from specheads.decode.drafters import HybridDrafter, make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import HybridPolicy, hybrid_policy_for, tree_policy_for
from specheads.decode.tree import static_tree
from specheads.heads import load_head, save_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_path_frequencies_and_best_paths_are_prefix_closed():
    vectors = [(0, 0, 1), (0, 1), (1, 0), (0, 0, 0), (2,), (0, 9)]
    freq = path_frequencies(vectors, top_k=3)
    assert freq[(0,)] == 4 and freq[(0, 0)] == 2 and (0, 9) not in freq
    for n in range(1, len(freq) + 1):
        paths = {tuple(p) for p in best_paths(freq, n)}
        assert all(p[:-1] in paths or len(p) == 1 for p in paths)
        static_tree([list(p) for p in paths])  # a valid tree


@pytest.mark.parametrize("family", ["medusa", "eagle3", "hydra"])
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


class PlantedText(HybridDrafter):
    """A hybrid drafter whose text starts with `planted`: the text's n-grams are found there."""

    def __init__(self, inner, policy, planted):
        super().__init__(inner, policy)
        self.planted = planted

    def start(self, prompt_ids, states, root):
        super().start(prompt_ids, states, root)
        self.text = self.planted + self.text


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


def calibrate(head, head_dir, target, **tree):
    settings = InferJobConfig(
        head_path=str(head_dir),
        tree=TreeConfig(
            kind="auto", depth=3, top_k=3, calibration_prompts=2, calibration_tokens=16, max_nodes=8, **tree
        ),
    )
    out = io.StringIO()
    chosen = calibrate_tree(settings, Session(target, head, head_dir, {}), out=out)
    assert chosen.kind == "static" and 1 <= len(chosen.paths) <= 8 and "<- chosen" in out.getvalue()
    return chosen, out.getvalue()


def files(directory):
    return {p.name: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("family", ["eagle", "hydra"])
def test_calibrate_tree_stores_a_tree_in_the_head_when_asked(family, tmp_path, tiny_target, sequences):
    head = quick_head(tiny_target, family, sequences, steps=30)
    head_dir = save_head(head, tmp_path / "head", dtype=torch.bfloat16)
    weights = (head_dir / "model.safetensors").read_bytes()
    chosen, out = calibrate(head, head_dir, tiny_target, save="head")
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
    policy = hybrid_policy_for(reloaded, TreeConfig(kind="default"))
    assert policy.ngram_nodes == chosen.ngram_nodes
    assert (policy.head.paths if policy.head else ()) == tuple(tuple(p) for p in sorted(chosen.hybrid_paths, key=len))


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
