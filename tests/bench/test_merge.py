"""Benchmark runs split by category (bench.categories) and joined (bench/merge.py): each category of
the joined summary is its run's own, the totals add the runs', every answer is compared with our
own plain loop's (a changed answer is counted unequal), and runs that cannot be joined are refused
in one line."""

import io
import json

import pytest
from conftest import write_questions

from specheads.bench.layer_skip import resolve_layer_skip
from specheads.bench.merge import main, merge_runs
from specheads.bench.runner import run_benchmark
from specheads.bench.session import Session
from specheads.config.infer import BenchConfig, InferJobConfig, LayerSkipConfig, validate
from specheads.config.model import ModelConfig
from specheads.errors import SpecHeadsError

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Tell me about cats.", "Count to five.", "Name a colour.", "Add two and two."]


@pytest.fixture(scope="module")
def two_runs(tiny_target, tmp_path_factory):
    """The same questions in two timed runs of plain and skip, writing apart from math."""
    tmp = tmp_path_factory.mktemp("merge")
    questions = write_questions(tmp / "q.jsonl", PROMPTS, ("writing", "math"))
    reports = {}
    for name, categories in (("a", ["writing"]), ("b", ["math"])):
        tiny = ModelConfig(name="tiny-random", path="tiny:llama")
        s = InferJobConfig(model=tiny, skip=LayerSkipConfig(layers=[5]), linear_layout="stock")
        s.bench = BenchConfig(questions=str(questions), output=str(tmp / f"{name}.jsonl"), max_new_tokens=10, warmup=0)
        s.bench.bandwidth_mib, s.bench.plots, s.bench.categories = 0, False, categories
        s.bench.methods = ["plain", "skip"]
        s = validate(s)
        session = Session(tiny_target, None, None, {})
        session.skip = resolve_layer_skip(s, tiny_target, False, io.StringIO())
        reports[name] = run_benchmark(s, session, io.StringIO())
    return tmp, reports


def test_each_category_is_its_runs_own_and_the_totals_add_up(two_runs):
    tmp, reports = two_runs
    assert reports["a"]["questions"] == reports["b"]["questions"] == 2
    assert reports["a"]["identical_to_plain"]["skip"] == {"equal": 2, "total": 2, "divergences": []}
    out = io.StringIO()
    joined = merge_runs([tmp / "a.jsonl", tmp / "b.jsonl"], tmp / "all.jsonl", out)
    for method in ("plain", "skip"):
        assert joined["methods"][method]["writing"] == reports["a"]["methods"][method]["writing"]
        assert joined["methods"][method]["math"] == reports["b"]["methods"][method]["math"]
        whole = joined["methods"][method]["all"]
        parts = [reports[r]["methods"][method]["all"] for r in "ab"]
        assert whole["new_tokens"] == sum(p["new_tokens"] for p in parts)
        assert whole["wall_s"] == pytest.approx(sum(p["wall_s"] for p in parts))
    assert joined["questions"] == 4 and joined["identical_to_plain"]["skip"]["equal"] == 4
    assert joined["drafters"]["skip"]["costs"]["tau"] == joined["methods"]["skip"]["all"]["tau"]
    assert json.loads((tmp / "all.summary.json").read_text()) == json.loads(json.dumps(joined))
    assert (tmp / "all.tau.png").stat().st_size > 0
    assert "skip: 4/4 outputs identical to plain" in out.getvalue()


def test_a_changed_answer_is_counted_unequal(two_runs, tmp_path):
    tmp, _ = two_runs
    rows = [json.loads(line) for line in (tmp / "b.jsonl").read_text().splitlines()]
    changed = next(r for r in rows if r["method"] == "skip")
    changed["output_ids"] = changed["output_ids"][:-1] + [changed["output_ids"][-1] + 1]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.summary.json").write_text((tmp / "b.summary.json").read_text())
    joined = merge_runs([tmp / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "all.jsonl", io.StringIO())
    assert joined["identical_to_plain"]["skip"]["equal"] == 3


def test_runs_that_cannot_be_joined_are_refused_in_one_line(two_runs, tmp_path, capsys):
    tmp, _ = two_runs
    with pytest.raises(SpecHeadsError, match="is in both"):
        merge_runs([tmp / "a.jsonl", tmp / "a.jsonl"], tmp_path / "x.jsonl", io.StringIO())
    rows = [json.loads(line) for line in (tmp / "b.jsonl").read_text().splitlines()]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["method"] == "plain"))
    (tmp_path / "b.summary.json").write_text((tmp / "b.summary.json").read_text())
    with pytest.raises(SpecHeadsError, match="ran methods"):
        merge_runs([tmp / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "x.jsonl", io.StringIO())
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main(["--output", str(tmp_path / "x.jsonl"), str(tmp / "a.jsonl"), str(tmp_path / "bad.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "x.jsonl").exists()


def test_runs_on_another_machine_are_refused(two_runs, tmp_path):
    """A run's summary names its machine (cpu, instruction sets, cores, threads, torch); two runs
    whose machines differ only in an instruction set (two processors of one model name) are not
    joined, and a run written before summaries named their machine still joins."""
    tmp, reports = two_runs
    machine = reports["b"]["machine"]
    assert {"cpu", "isa", "cores", "threads", "torch", "device"} <= machine.keys()
    assert machine == reports["a"]["machine"]
    (tmp_path / "b.jsonl").write_text((tmp / "b.jsonl").read_text())
    summary = json.loads((tmp / "b.summary.json").read_text())
    summary["machine"] = {**machine, "isa": machine["isa"] + ["amx_bf16"]}
    (tmp_path / "b.summary.json").write_text(json.dumps(summary))
    with pytest.raises(SpecHeadsError, match="another machine .*isa differ"):
        merge_runs([tmp / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "x.jsonl", io.StringIO())
    del summary["machine"]
    (tmp_path / "b.summary.json").write_text(json.dumps(summary))
    joined = merge_runs([tmp / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "x.jsonl", io.StringIO())
    assert joined["questions"] == 4 and joined["machine"] == machine
