"""Benchmark harness: the summary arithmetic, divergence reports, and one in-process run."""

import io
import json

import pytest
import torch
from conftest import write_questions

from specheads.bench.compared import open_compared_heads, open_precision_variants
from specheads.bench.inputs import encode_turns
from specheads.bench.runner import (
    acceptance_per_depth,
    cost_breakdown,
    first_divergence,
    format_costs,
    format_table,
    output_paths,
    run_benchmark,
    summarize,
)
from specheads.bench.session import Session
from specheads.config.infer import BenchConfig, InferJobConfig, TreeConfig
from specheads.config.train import HeadConfig
from specheads.decode.hybrid_rule import RuleParams
from specheads.decode.policy import describe_policy, method_policy
from specheads.errors import SpecHeadsError
from specheads.heads import build_head, save_head

ROW_FIELDS = {"question_id", "category", "method", "output_ids", "new_tokens", "target_forwards", "wall_s"}
pytestmark = pytest.mark.usefixtures("one_thread")


def numbered_questions(path, n):
    """n two-turn questions (ids 80..) whose first turn names a number (rebuilt by a test below)."""
    return write_questions(
        path,
        [f"Question {i}: tell me, briefly, about {i * 7}." for i in range(n)],
        categories=("writing", "math", "writing", "coding"),
        first_id=80,
        later_turns=("second turn",),
    )


def test_summary_arithmetic():
    rows = [
        # baseline: 10 tokens = prefill token + 9 forwards, in 1 s
        {"method": "baseline", "category": "a", "new_tokens": 10, "target_forwards": 9, "wall_s": 1.0},
        {"method": "prompt_lookup", "category": "a", "new_tokens": 10, "target_forwards": 6, "wall_s": 0.8},
        # spec: 9 decode tokens in 3 forwards (tau 3), in 0.5 s (speedup 2, c = 3/2 - 1)
        {"method": "spec", "category": "a", "new_tokens": 10, "target_forwards": 3, "wall_s": 0.5},
    ]
    for r in rows:  # the baseline loops (3 of its 7 4-grams repeat), the others do not
        r["output_ids"] = [1, 2, 3, 4] * 2 + [1, 2] if r["method"] == "baseline" else list(range(10))
    s = summarize(rows, ["baseline", "prompt_lookup", "spec"])
    assert s["baseline"]["all"]["tau"] == 1.0
    assert s["baseline"]["a"]["repeat_rate"] == pytest.approx(3 / 7) and s["spec"]["all"]["repeat_rate"] == 0
    assert s["prompt_lookup"]["a"]["tau"] == pytest.approx(1.5)
    spec = s["spec"]["all"]
    assert spec["tau"] == pytest.approx(3.0)
    assert spec["tokens_per_s"] == pytest.approx(20.0)
    assert spec["speedup_vs_baseline"] == pytest.approx(2.0)
    assert spec["speedup_vs_prompt_lookup"] == pytest.approx(20.0 / 12.5)
    assert spec["overhead_c"] == pytest.approx(0.5)
    table = format_table(s)  # no plain run here: its column reads "-", not a number or "-x"
    assert "spec" in table and "-x" not in table and " 43%" in table  # the baseline's 3/7


def test_acceptance_per_depth():
    rows = [{"accepted_drafts": [0, 1, 3, 2], "tree_depths": [3, 3, 3, 1]}]
    # depth 1 reached 4 times, accepted 3; depth 2 reached by the 3 that passed depth 1 (of
    # which the last tree was only 1 deep) -> 2, accepted 1 (the 3); depth 3: 1 reached, 1 accepted
    assert acceptance_per_depth(rows) == [0.75, 0.5, 1.0]


def test_cost_breakdown_splits_a_step_into_its_terms():
    rows = [
        {"question_id": 1, "method": "baseline", "new_tokens": 11, "target_forwards": 10, "wall_s": 1.1},
        {
            "question_id": 1,
            "method": "spec",
            "new_tokens": 11,
            "target_forwards": 4,
            "wall_s": 0.7,
            "prefill_s": 0.1,
            "draft_s": 0.2,
            "verify_s": 0.4,
            "tree_sizes": [9, 9, 9, 5],
        },
    ]
    c = cost_breakdown(rows)
    assert c["plain_step_ms"] == pytest.approx(100.0)  # (1.1 s - 0.1 s prefill) / 10 forwards
    assert c["draft_ms"] == pytest.approx(50.0) and c["verify_ms"] == pytest.approx(100.0)
    assert c["tau"] == pytest.approx(2.5) and c["break_even_tau"] == pytest.approx(1.5)
    assert c["mean_tree_nodes"] == pytest.approx(8.0)
    assert c["own_plain_step_ms"] is None and c["break_even_tau_vs_own_plain"] is None
    own = {"question_id": 1, "method": "plain", "target_forwards": 10, "wall_s": 0.85, "prefill_s": 0.05}
    c = cost_breakdown(rows + [own])
    assert c["own_plain_step_ms"] == pytest.approx(80.0) and c["break_even_tau_vs_own_plain"] == pytest.approx(1.875)
    assert "(1.88 vs own loop)" in format_costs(c)
    assert cost_breakdown([r for r in rows if r["method"] == "spec"]) is None
    # a run without the HF baseline: the step is priced against our own loop's plain step
    c = cost_breakdown([rows[1], own])
    assert (
        c["plain_step_ms"] is None and c["break_even_tau"] == pytest.approx(1.875) == c["break_even_tau_vs_own_plain"]
    )
    assert c["verify_over_plain"] == pytest.approx(1.25)
    assert "vs own loop's plain step 80.0 ms" in format_costs(
        c
    ) and "break-even tau 1.88 (vs own loop)" in format_costs(c)


def test_output_paths():
    p = output_paths("/x/mt.jsonl")
    assert str(p["summary"]) == "/x/mt.summary.json" and str(p["tau_png"]) == "/x/mt.tau.png"


def test_first_divergence_reports_the_margin(tiny_target):
    prompt = [1, 2, 3, 4]
    base = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, 4:].tolist()
    other = base[:2] + [(base[2] + 1) % 320] + base[3:]
    d = first_divergence(tiny_target, prompt, base, other)
    assert d["index"] == 2 and d["baseline_token"] == base[2] and d["top2_margin"] > 0
    assert first_divergence(tiny_target, prompt, base, list(base)) is None


@pytest.mark.parametrize("family", ["medusa", "eagle3"])
def test_run_benchmark_in_process(tmp_path, tiny_target, family):
    torch.manual_seed(0)
    head = build_head(HeadConfig(family=family, draft_vocab_size=320, num_heads=3), tiny_target)
    settings = InferJobConfig(
        head_path=str(tmp_path / "head"),
        tree=TreeConfig(kind="dynamic", depth=3, top_k=3, total_tokens=8),
        bench=BenchConfig(
            questions=str(numbered_questions(tmp_path / "q.jsonl", 3)),
            output=str(tmp_path / "out" / "res.jsonl"),
            max_new_tokens=12,
            warmup=1,
        ),
    )
    lines = []

    class Out:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

    report = run_benchmark(settings, Session(tiny_target, head, tmp_path / "head", {}), out=Out())
    rows = [json.loads(line) for line in (tmp_path / "out" / "res.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 6
    assert {r["method"] for r in rows} == {"baseline", "plain", "prompt_lookup", "lookup", "spec", "hybrid"}
    for r in rows:
        assert ROW_FIELDS <= set(r)
        assert r["new_tokens"] == len(r["output_ids"]) <= 12
    spec_rows = [r for r in rows if r["method"] == "spec"]
    assert all("accept_lengths" in r and sum(r["accept_lengths"]) == r["new_tokens"] - 1 for r in spec_rows)
    # greedy: every method gives the target's own output
    assert report["identical_to_baseline"]["spec"] == {"equal": 3, "total": 3, "divergences": []}
    assert report["identical_to_baseline"]["plain"]["equal"] == 3  # our own loop, no drafts
    assert report["identical_to_baseline"]["hybrid"] == {"equal": 3, "total": 3, "divergences": []}
    assert report["identical_to_baseline"]["lookup"] == {"equal": 3, "total": 3, "divergences": []}
    hybrid_rows = [r for r in rows if r["method"] == "hybrid"]
    assert all("accepted_sources" in r and "accepted_sources" not in s for r, s in zip(hybrid_rows, spec_rows))
    plain_rows = [r for r in rows if r["method"] == "plain"]
    assert all(r["target_forwards"] == r["new_tokens"] - 1 and set(r["tree_sizes"]) == {1} for r in plain_rows)
    summary = json.loads((tmp_path / "out" / "res.summary.json").read_text())
    assert set(summary["methods"]) == {"baseline", "plain", "prompt_lookup", "lookup", "spec", "hybrid"}
    assert summary["methods"]["plain"]["all"]["tau"] == 1.0
    assert set(summary["methods"]["spec"]) == {"all", "writing", "math"}
    for key in (
        "tau",
        "tokens_per_s",
        "speedup_vs_baseline",
        "speedup_vs_plain",
        "speedup_vs_prompt_lookup",
        "overhead_c",
    ):
        assert key in summary["methods"]["spec"]["all"]
    assert (tmp_path / "out" / "res.tau.png").stat().st_size > 0
    assert (tmp_path / "out" / "res.acceptance.png").stat().st_size > 0
    text = "".join(lines)
    assert "vs base" in text and "spec: 3/3 outputs identical to baseline" in text
    assert "break-even tau" in text and summary["costs"]["verify_ms"] > 0
    assert summary["costs"]["own_plain_step_ms"] > 0 and "own loop" in text
    # the hybrid method: its tree, its cost line and where its accepted drafts came from
    hybrid = summary["hybrid"]
    assert hybrid["tree"].startswith("hybrid: dynamic tree") and hybrid["costs"]["verify_ms"] > 0
    assert set(hybrid["accepted_sources"]) == {"head", "text", "both", "accepted"}
    assert "hybrid: spec step: draft" in text and "hybrid: accepted drafts" in text
    # prompt lookup through our own loop: the text's repeats alone, no head
    lookup = summary["lookup"]
    assert lookup["head"] is None and lookup["tree"].startswith("hybrid: no head + up to 10 text")
    assert "lookup (hybrid: no head" in text and "compared_heads" not in summary
    # memory bandwidth sampled before each question on CPU: one reading per question, on its rows
    assert summary["memory_bandwidth"]["samples"] == 3 and summary["memory_bandwidth"]["median_gb_s"] > 0
    assert len({r["copy_gb_s"] for r in rows}) <= 3 and all(r["copy_gb_s"] > 0 for r in rows)
    for qid in {r["question_id"] for r in rows}:
        assert len({r["copy_gb_s"] for r in rows if r["question_id"] == qid}) == 1
    assert "memory bandwidth (" in text
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temp files left


def test_all_turns_follow_each_methods_own_answers(tmp_path, tiny_target):
    torch.manual_seed(0)
    head = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    settings = InferJobConfig(
        tree=TreeConfig(kind="chain", depth=3),
        bench=BenchConfig(
            questions=str(numbered_questions(tmp_path / "q.jsonl", 2)),
            output=str(tmp_path / "out" / "res.jsonl"),
            max_new_tokens=8,
            methods=["baseline", "plain", "spec"],
            turns="all",
            warmup=0,
            plots=False,
            bandwidth_mib=0,
        ),
    )
    report = run_benchmark(settings, Session(tiny_target, head, None, {}), out=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "out" / "res.jsonl").read_text().splitlines()]
    assert "memory_bandwidth" not in report and not any("copy_gb_s" in r for r in rows)  # bandwidth_mib=0: off
    assert sorted({(r["question_id"], r["turn"]) for r in rows}) == [(80, 1), (80, 2), (81, 1), (81, 2)]
    tok = tiny_target.tokenizer
    for r in rows:
        if r["turn"] == 2:  # turn 2 is asked after the same method's own turn-1 answer
            first = next(
                x for x in rows if (x["question_id"], x["turn"], x["method"]) == (r["question_id"], 1, r["method"])
            )
            answer = tok.decode(first["output_ids"], skip_special_tokens=True)
            expect = encode_turns(
                tok,
                [
                    f"Question {r['question_id'] - 80}: tell me, briefly, about {(r['question_id'] - 80) * 7}.",
                    "second turn",
                ],
                [answer],
            )
            assert r["prompt_tokens"] == len(expect) > first["prompt_tokens"] + len(first["output_ids"]) - 2
    assert report["identical_to_baseline"]["spec"] == {"equal": 4, "total": 4, "divergences": []}
    assert report["turns"] == "all" and report["methods"]["spec"]["all"]["questions"] == 4


def test_encode_turns_alternates_user_and_answers():
    from specheads.tiny import byte_tokenizer

    tok = byte_tokenizer()
    one = tok.decode(encode_turns(tok, ["hi"], []))
    two = tok.decode(encode_turns(tok, ["hi", "more"], ["hello"]))
    assert two.startswith(one.removesuffix("<|im_start|>assistant\n")) and two.index("hello") < two.index("more")
    with pytest.raises(ValueError):
        encode_turns(tok, ["hi", "more"], [])


def side_by_side(tmp_path, **bench) -> InferJobConfig:
    """Settings of a short run (2 questions, 8 tokens) with more heads or precisions beside spec."""
    return InferJobConfig(
        tree=TreeConfig(kind="chain", depth=2),
        bench=BenchConfig(
            questions=str(numbered_questions(tmp_path / "q.jsonl", 2)),
            output=str(tmp_path / "out" / "res.jsonl"),
            max_new_tokens=8,
            methods=["baseline", "spec"],
            warmup=0,
            plots=False,
            **bench,
        ),
    )


def test_compared_heads_run_side_by_side_in_one_run(tmp_path, tiny_target):
    torch.manual_seed(0)
    main = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    other = build_head(HeadConfig(family="medusa", num_heads=2), tiny_target)
    save_head(other, tmp_path / "medusa-run" / "head")
    settings = side_by_side(tmp_path, heads=[str(tmp_path / "medusa-run" / "head")])
    out = io.StringIO()
    report = run_benchmark(settings, Session(tiny_target, main, tmp_path / "eagle3-run" / "head", {}), out=out)
    rows = [json.loads(line) for line in (tmp_path / "out" / "res.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"baseline", "spec", "spec:medusa-run"}
    assert set(report["methods"]) == {"baseline", "spec", "spec:medusa-run"}
    assert report["identical_to_baseline"]["spec:medusa-run"]["equal"] == 2  # lossless, like the main head
    info = report["compared_heads"]["spec:medusa-run"]
    assert info["costs"]["verify_ms"] > 0 and info["tree"].startswith("static tree")
    assert report["methods"]["spec:medusa-run"]["all"]["speedup_vs_baseline"] is not None
    assert "spec:medusa-run: spec step" in out.getvalue()


def test_compared_heads_are_refused_for_another_target_or_a_clashing_name(tmp_path, tiny_target):
    head = build_head(HeadConfig(family="medusa", num_heads=2), tiny_target)
    save_head(head, tmp_path / "a" / "head")
    config = json.loads((tmp_path / "a" / "head" / "config.json").read_text())
    config["target"]["name"] = "another-model"
    (tmp_path / "b").mkdir()
    save_head(head, tmp_path / "b" / "head")
    (tmp_path / "b" / "head" / "config.json").write_text(json.dumps(config))
    session = Session(tiny_target, head, tmp_path / "a" / "head", {})
    with pytest.raises(SpecHeadsError, match="trained for another-model"):
        open_compared_heads([str(tmp_path / "b" / "head")], session)
    with pytest.raises(SpecHeadsError, match="two heads are named 'a'"):
        open_compared_heads([str(tmp_path / "a" / "head")], session)
    config["target"]["name"], config["family"] = tiny_target.info.name, "medusa2"  # adapts the shared target
    (tmp_path / "c").mkdir()
    save_head(head, tmp_path / "c" / "head")
    (tmp_path / "c" / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecHeadsError, match="changes its target; benchmark it alone"):
        open_compared_heads([str(tmp_path / "c" / "head")], session)


def test_head_dtypes_run_the_main_head_in_other_precisions_with_its_tree(tmp_path, tiny_target, monkeypatch):
    torch.manual_seed(0)
    main = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    save_head(main, tmp_path / "eagle3-run" / "head")
    settings = side_by_side(tmp_path, head_dtypes=["bfloat16", "int8"])
    out = io.StringIO()
    session = Session(tiny_target, main, tmp_path / "eagle3-run" / "head", {})
    report = run_benchmark(settings, session, out=out)
    rows = [json.loads(line) for line in (tmp_path / "out" / "res.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"baseline", "spec", "spec@bfloat16", "spec@int8"}
    compared = report["compared_heads"]
    assert compared["spec@bfloat16"]["head_dtype"] == "bfloat16"
    assert compared["spec@int8"]["head_dtype"].startswith("int8/")
    assert report["head_dtype"] == "float32" and main.dtype == torch.float32  # the main head is left as it was
    for m in ("spec@bfloat16", "spec@int8"):
        assert compared[m]["tree"] == report["tree"]  # the main head's tree: only the precision differs
        assert report["identical_to_baseline"][m]["equal"] == 2
    assert "spec@int8: spec step" in out.getvalue()
    monkeypatch.setattr(type(main), "adapts_target", True)  # a head that changes its target: not loaded twice
    with pytest.raises(SpecHeadsError, match="bench.head_dtypes: .* changes its target"):
        open_precision_variants(["bfloat16"], session, None)


def test_bench_trees_run_the_main_head_with_other_trees(tmp_path, tiny_target):
    torch.manual_seed(0)
    main = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    settings = side_by_side(tmp_path, trees=["chain:1", "dynamic:2:2:3"])
    out = io.StringIO()
    report = run_benchmark(settings, Session(tiny_target, main, tmp_path / "eagle3-run" / "head", {}), out=out)
    rows = [json.loads(line) for line in (tmp_path / "out" / "res.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"baseline", "spec", "spec#chain:1", "spec#dynamic:2:2:3"}
    compared = report["compared_heads"]
    assert report["tree"] == "static tree (2 nodes, depth 2)"  # the session's own tree (chain of 2)
    assert compared["spec#chain:1"]["tree"] == "static tree (1 nodes, depth 1)"
    assert compared["spec#dynamic:2:2:3"]["tree"] == "dynamic tree (depth 2, top_k 2, 3 nodes)"
    # the trees really differ: a chain of 1 never drafts past depth 1, the others do
    depths = {m: max(d for r in rows if r["method"] == m for d in r["tree_depths"]) for m in compared}
    assert depths == {"spec#chain:1": 1, "spec#dynamic:2:2:3": 2}
    for m in compared:
        assert report["identical_to_baseline"][m]["equal"] == 2
        assert compared[m]["head_dtype"] == report["head_dtype"]
    assert "spec#dynamic:2:2:3: spec step" in out.getvalue()


def test_hybrid_without_a_head_is_prompt_lookup_through_our_loop(tmp_path, tiny_target):
    settings = InferJobConfig(
        bench=BenchConfig(
            questions=str(numbered_questions(tmp_path / "q.jsonl", 2)),
            output=str(tmp_path / "res.jsonl"),
            max_new_tokens=10,
            methods=["baseline", "hybrid"],
            warmup=0,
            plots=False,
        ),
    )
    report = run_benchmark(settings, Session(tiny_target, None, None, {}), out=io.StringIO())
    assert report["identical_to_baseline"]["hybrid"]["equal"] == 2
    assert report["hybrid"]["tree"].startswith("hybrid: no head") and report["hybrid"]["head"] is None
    rows = [json.loads(line) for line in (tmp_path / "res.jsonl").read_text().splitlines()]
    counts = [r["accepted_sources"] for r in rows if r["method"] == "hybrid"]
    assert all(set(c) <= {"text"} for c in counts)  # no head: every accepted draft is the text's


# a stored calibration unlike the tree settings' defaults in every part a method drafts from: the
# head's tree under a gate, a hybrid split with its own gate, text source and text-alone rule, and
# an adaptive rule with its own head tree and gate
CALIBRATION = {
    "min_path_prob": 0.05,
    "hybrid": {
        "paths": [[0], [0, 0]],
        "min_path_prob": 0.1,
        "ngram_nodes": 4,
        "text_source": "suffix",
        "ngram_max": 2,
        "suffix_match": 4,
        "suffix_history": 100,
        "text_alone": 6,
        "text_alone_ngram": 2,
        "rule": {
            **RuleParams(verify_ms=(1.0, 1.1, 1.2, 1.3), draft_ms=0.5, head_nodes=2, head_accept=1.0).to_record(),
            "paths": [[0], [1]],
            "min_path_prob": 0.2,
        },
    },
}


@pytest.mark.parametrize(
    "tree",
    [
        TreeConfig(),
        TreeConfig(hybrid_rule="fixed", ngram_nodes=3),
        TreeConfig(kind="chain", depth=2, min_path_prob=0.1),
    ],
    ids=["default", "fixed-split", "chain"],
)
def test_each_method_drafts_what_the_resolver_resolves(tmp_path, tiny_target, monkeypatch, tree):
    """The benchmark's drafters of spec, hybrid, lookup and suffix draft the policy that
    policy.method_policy resolves from the same tree settings and the head's stored calibration,
    and the summary describes that policy."""
    import specheads.bench.runner as runner

    head = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    head.default_tree, head.calibration = [[0], [1], [0, 0]], json.loads(json.dumps(CALIBRATION))
    methods = ["spec", "hybrid", "lookup", "suffix"]
    settings = InferJobConfig(
        tree=tree,
        bench=BenchConfig(
            questions=str(numbered_questions(tmp_path / "q.jsonl", 1)),
            output=str(tmp_path / "res.jsonl"),
            max_new_tokens=4,
            methods=methods,
            prompt_lookup_num_tokens=6,
            warmup=0,
            plots=False,
        ),
    )
    real, used = runner.method_runner, {}

    def spy(settings, target, drafters, assistant):
        used.update(drafters)
        return real(settings, target, drafters, assistant)

    monkeypatch.setattr(runner, "method_runner", spy)
    report = run_benchmark(settings, Session(tiny_target, head, tmp_path / "head", {}), out=io.StringIO())
    assert set(used) == set(methods)
    for m in methods:
        resolved = method_policy(head, tree, m, 6)
        drafter, policy, _ = used[m]
        assert drafter.policy == policy == resolved, m
        assert (report["tree"] if m == "spec" else report[m]["tree"]) == describe_policy(resolved)
    hybrid = used["hybrid"][0]
    assert hybrid.inner.policy == hybrid.policy.head  # the head part drafts the resolved head tree


def test_a_benchmark_resolves_what_it_drafts_once(tmp_path, tiny_target, monkeypatch):
    """One benchmark run merges the head's stored calibration into the tree settings once and
    fills their search keys once, into one DraftPlan that every drafting method (and the
    assistant's draft length) takes."""
    import specheads.decode.policy as policy

    head = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    head.default_tree, head.calibration = [[0], [1], [0, 0]], json.loads(json.dumps(CALIBRATION))
    calls = {"stored_settings": 0, "resolve_search": 0, "DraftPlan": 0}

    def counted(name):
        real = getattr(policy, name)

        def count(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(policy, name, count)

    for name in calls:
        counted(name)
    settings = InferJobConfig(
        bench=BenchConfig(
            questions=str(numbered_questions(tmp_path / "q.jsonl", 1)),
            output=str(tmp_path / "res.jsonl"),
            max_new_tokens=4,
            methods=["spec", "hybrid", "lookup", "suffix"],
            warmup=0,
            plots=False,
        ),
    )
    run_benchmark(settings, Session(tiny_target, head, tmp_path / "head", {}), out=io.StringIO())
    assert calls == {"stored_settings": 1, "resolve_search": 1, "DraftPlan": 1}
