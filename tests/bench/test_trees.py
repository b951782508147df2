"""specheads/bench/trees.py: the identity of calibration prompts, the head digest the cache is keyed
by, and the benchmark's warning when a head's tree was calibrated on the questions it measures."""

import io
import json

import pytest
import torch
from conftest import write_questions

from specheads.bench.questions import read_questions
from specheads.bench.runner import run_benchmark
from specheads.bench.session import Session
from specheads.bench.trees import head_digest, overlap, prompt_digest, prompts_record, search_space, warn_overlap
from specheads.config.infer import SEARCH_DEFAULTS, BenchConfig, InferJobConfig, TreeConfig, resolve_search
from specheads.config.train import HeadConfig
from specheads.heads import build_head, save_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prompt_digest_ignores_whitespace_only():
    assert prompt_digest("Why is  the sky\nblue? ") == prompt_digest("Why is the sky blue?")
    assert prompt_digest("Why is the sky blue?") != prompt_digest("Why is the sky blue!")


def test_head_digest_follows_the_weights_not_the_stored_tree(tmp_path, tiny_target):
    torch.manual_seed(0)
    head = build_head(HeadConfig(family="medusa", num_heads=2), tiny_target)
    directory = save_head(head, tmp_path / "head")
    before = head_digest(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "default_tree": [[0], [1]]}))
    assert head_digest(directory) == before
    with torch.no_grad():
        next(head.parameters()).add_(1.0)
    assert head_digest(save_head(head, tmp_path / "changed")) != before


def test_overlap_names_the_measured_questions_a_calibration_used(tmp_path):
    path = write_questions(tmp_path / "q.jsonl", ["one", "two", "three"], later_turns=("again",))
    questions = read_questions(path)
    record = {"prompts": prompts_record("q.jsonl", ["two", "unrelated"])}
    ids = [q["question_id"] for q in questions]
    assert overlap(record, questions) == [ids[1]]
    assert overlap({"prompts": prompts_record("x", ["again"])}, questions) == []  # first turns only
    assert overlap({"prompts": prompts_record("x", ["again"])}, questions, turns="all") == ids
    assert overlap(None, questions) == [] and overlap({"nodes": 4}, questions) == []
    out = io.StringIO()
    assert warn_overlap("spec:shipped", record, questions, "first", out) == [ids[1]]
    assert out.getvalue().count("\n") == 1 and "spec:shipped" in out.getvalue() and "1 of the 3" in out.getvalue()


def test_the_benchmark_warns_when_a_heads_tree_was_calibrated_on_its_questions(tmp_path, tiny_target, capsys):
    texts = ["Tell me about rivers.", "Name a prime.", "Why is the sea salty?"]
    path = write_questions(tmp_path / "q.jsonl", texts)
    torch.manual_seed(0)
    head = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    settings = InferJobConfig(
        tree=TreeConfig(kind="chain", depth=2),
        bench=BenchConfig(
            questions=str(path),
            output=str(tmp_path / "out" / "res.jsonl"),
            max_new_tokens=4,
            methods=["plain", "spec"],
            warmup=0,
            plots=False,
        ),
    )
    head.calibration = {"prompts": prompts_record("builtin", ["Something else entirely."])}
    run_benchmark(settings, Session(tiny_target, head, None, {}), out=io.StringIO())
    assert "calibrated on" not in capsys.readouterr().err
    head.calibration = {"prompts": prompts_record("q.jsonl", texts[:2])}
    run_benchmark(settings, Session(tiny_target, head, None, {}), out=io.StringIO())
    assert "warning: spec's tree was calibrated on 2 of the 3 questions" in capsys.readouterr().err


def test_the_search_a_calibration_made_is_read_from_its_record():
    """search_space: a record's `search` as it is; a record from before it (the shipped head's)
    derived from its depth, top_k, max_nodes, tokens, prompt count and dynamic record; resolve_search
    fills only the keys left None."""
    search = {
        "depth": 3,
        "top_k": 2,
        "max_nodes": 16,
        "dynamic": "off",
        "calibration_prompts": 24,
        "calibration_tokens": 96,
    }
    assert search_space({"search": search, "depth": 2, "tokens": 128}) == search
    old = {"prompts": {"count": 16}, "tokens": 128, "depth": 2, "top_k": 3, "max_nodes": 64, "policy": "dynamic"}
    derived = {"depth": 2, "top_k": 3, "max_nodes": 64, "calibration_tokens": 128, "calibration_prompts": 16}
    assert search_space({**old, "dynamic": {"depth": 2}}) == {**derived, "dynamic": "weigh"}
    assert search_space({**old, "policy": "static"}) == {**derived, "dynamic": "off"}  # weighed none
    assert search_space({"nodes": 4}) == {} and search_space(None) == {}
    resolved = resolve_search(TreeConfig(kind="auto", depth=4, dynamic="only"), search)
    assert (resolved.depth, resolved.dynamic) == (4, "only")  # given: kept
    assert (resolved.top_k, resolved.max_nodes, resolved.calibration_prompts, resolved.calibration_tokens) == (
        2,
        16,
        24,
        96,
    )
    assert (
        resolve_search(TreeConfig(kind="auto"), {"depth": 2}).calibration_tokens
        == SEARCH_DEFAULTS["calibration_tokens"]
    )
