"""A separate draft model in infer.py: the settings it needs, the demo without a head, and the
benchmark's `draft` and `assisted` methods beside the baselines, with the fields every method has."""

import io
import json

import pytest
from conftest import write_questions

from specheads.bench.demo import run_demo
from specheads.bench.runner import run_benchmark
from specheads.bench.session import Session
from specheads.config.infer import (
    DEFAULT_METHODS,
    BenchConfig,
    DraftModelConfig,
    InferJobConfig,
    TreeConfig,
    validate,
)
from specheads.config.model import ModelConfig
from specheads.decode.draft_model import load_draft_model, make_draft_model
from specheads.errors import SpecHeadsError

pytestmark = pytest.mark.usefixtures("one_thread")
ROW_FIELDS = {"question_id", "category", "method", "output_ids", "new_tokens", "target_forwards", "wall_s", "tau"}


@pytest.fixture(scope="module")
def draft_dir(tiny_target, tmp_path_factory):
    return make_draft_model(tiny_target, 3, tmp_path_factory.mktemp("draft") / "tiny-3l")


def settings_for(draft_dir, tmp_path, **bench):
    questions = write_questions(
        tmp_path / "q.jsonl", ["Tell me about cats.", "Count to five."], ("writing", "math"), later_turns=()
    )
    return InferJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        draft=DraftModelConfig(model=str(draft_dir)),
        tree=TreeConfig(kind="chain", depth=3),
        bench=BenchConfig(questions=str(questions), output=str(tmp_path / "out.jsonl"), **bench),
    )


def test_the_draft_methods_run_by_default_with_a_draft_model(draft_dir, tmp_path):
    s = validate(settings_for(draft_dir, tmp_path))
    assert s.bench.methods == ["baseline", "plain", "prompt_lookup", "lookup", "draft", "assisted"]  # no head
    s = settings_for(draft_dir, tmp_path)
    s.head_path = str(tmp_path)
    assert validate(s).bench.methods == [*DEFAULT_METHODS, "draft", "assisted"]
    s = settings_for(draft_dir, tmp_path, methods=["baseline", "draft"])
    assert validate(s).bench.methods == ["baseline", "draft"]  # a list given is kept
    s = settings_for(draft_dir, tmp_path)
    s.bench = BenchConfig()
    s.prompt = "hi"
    assert validate(s).draft.model  # the demo without a head drafts with the draft model


@pytest.mark.parametrize(
    "change, message",
    [
        ({"draft": None, "methods": ["baseline", "assisted"]}, r"bench.methods \['assisted'\] draft with a separate"),
        ({"tree": "auto"}, "tree=auto calibrates a head's tree"),
        ({"dtype": "int8"}, "draft.dtype must be one of"),
        ({"schedule": "sometimes"}, "draft.assistant_schedule must be one of"),
        ({"draft": "/no/such/draft"}, "draft.model /no/such/draft does not exist"),
    ],
)
def test_draft_settings_are_checked(change, message, draft_dir, tmp_path):
    s = settings_for(draft_dir, tmp_path, methods=change.get("methods", list(DEFAULT_METHODS)))
    if "draft" in change:
        s.draft.model = change["draft"]
    s.tree.kind = change.get("tree", s.tree.kind)
    s.draft.dtype = change.get("dtype", s.draft.dtype)
    s.draft.assistant_schedule = change.get("schedule", s.draft.assistant_schedule)
    with pytest.raises(SpecHeadsError, match=message):
        validate(s)


def test_the_benchmark_runs_draft_and_assisted_beside_the_baselines(draft_dir, tmp_path, tiny_target):
    methods = ["baseline", "plain", "draft", "assisted"]
    s = validate(settings_for(draft_dir, tmp_path, methods=methods, max_new_tokens=10, warmup=0, plots=False))
    s.bench.bandwidth_mib = 0
    draft = load_draft_model(s.draft, tiny_target)
    out = io.StringIO()
    report = run_benchmark(s, Session(tiny_target, None, None, {}, draft=draft), out=out)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == set(s.bench.methods) and len(rows) == 2 * len(s.bench.methods)
    for r in rows:
        assert ROW_FIELDS <= set(r) and r["new_tokens"] == len(r["output_ids"]) <= 10
    for r in rows:
        if r["method"] == "draft":  # our loop: the cost split and the per-step counts
            assert {"draft_s", "verify_s", "prefill_s", "accept_lengths", "tree_sizes"} <= set(r)
            assert set(r["tree_depths"]) <= {0, 1, 2, 3}
    for m in ("draft", "assisted"):
        assert report["identical_to_baseline"][m] == {"equal": 2, "total": 2, "divergences": []}
        assert report["methods"][m]["all"]["tau"] >= 1.0 and "speedup_vs_baseline" in report["methods"][m]["all"]
    assert sum(sum(r["accepted_drafts"]) for r in rows if r["method"] == "draft") > 0
    info = report["draft_model"]
    assert info["model"] == str(draft_dir) and info["layers"] == 3 and info["made_from"]["target_layers"] == 6
    assert info["assisted"] == {"num_assistant_tokens": 3, "schedule": "constant", "universal": False}
    assert report["draft"]["tree"].startswith("static tree (3 nodes, depth 3") and report["draft"]["costs"]
    text = out.getvalue()
    assert "draft model: " in text and "the first 3 of 6 layers of tiny-random" in text
    assert "draft (static tree" in text and "spec step: draft" in text
    assert "assisted: 2/2 outputs identical to baseline" in text


def test_the_demo_drafts_with_the_draft_model_without_a_head(draft_dir, tmp_path, tiny_target):
    s = settings_for(draft_dir, tmp_path)
    s.bench = BenchConfig()
    s.prompt, s.max_new_tokens, s.mark = "Tell me about cats.", 12, "brackets"
    s = validate(s)
    out = io.StringIO()
    stats = run_demo(s, Session(tiny_target, None, None, {}, draft=load_draft_model(s.draft, tiny_target)), out=out)
    assert stats["new_tokens"] == 12 and stats["identical_to_baseline"]
    assert f"[draft model {draft_dir}, static tree (3 nodes, depth 3)]" in out.getvalue().splitlines()[-1]
