"""Answer quality beside speed: repeated n-grams pooled over answers, agreement with a reference
run, and the reference refused in one line when it is missing, malformed or run otherwise."""

import io
import json

import pytest
import torch
from conftest import write_questions

from specheads.bench.quality import agreement, common_prefix, read_reference, repeat_rate
from specheads.bench.runner import run_benchmark
from specheads.bench.session import Session
from specheads.config.infer import BenchConfig, InferJobConfig, TreeConfig
from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.heads import build_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_repeat_rate_pools_over_answers():
    # pooled over answers, not a mean of rates: the short looping answer weighs by its n-grams
    assert repeat_rate([[1, 2, 3, 4] * 3, list(range(100, 120))]) == pytest.approx(5 / (9 + 17))
    assert repeat_rate([[1, 2], []]) is None


def test_agreement_counts_equal_answers_and_common_prefixes():
    reference = {(1, 1): [5, 6, 7, 8], (2, 1): [1, 2, 3]}
    rows = [
        {"question_id": 1, "turn": 1, "method": "a", "output_ids": [5, 6, 7, 8]},
        {"question_id": 2, "turn": 1, "method": "a", "output_ids": [1, 9, 3]},
        {"question_id": 1, "turn": 1, "method": "b", "output_ids": [5, 6]},
        {"question_id": 3, "turn": 1, "method": "b", "output_ids": [4]},  # not in the reference
    ]
    got = agreement(rows, reference, ["a", "b"])
    assert got["a"]["answers"] == 2 and got["a"]["equal"] == 1 and got["a"]["mean_common_prefix"] == 2.5
    assert got["b"]["answers"] == 1 and got["b"]["equal"] == 0 and got["b"]["mean_common_prefix"] == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0
    with pytest.raises(SpecHeadsError, match="shares no question"):
        agreement([{"question_id": 9, "method": "a", "output_ids": []}], reference, ["a"])


def write_rows(path, rows, summary=None):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        path.with_name(path.stem + ".summary.json").write_text(json.dumps(summary))
    return path


@pytest.mark.parametrize(
    "content, summary, message",
    [
        (None, None, "no such rows file"),
        ('{"method": "baseline"}\n', None, "line 1 is not a benchmark row"),
        ("not json\n", None, "line 1 is not a benchmark row"),
        ('{"question_id": 1, "method": "spec", "output_ids": [1]}\n', None, "no baseline rows"),
        ('{"question_id": 1, "method": "baseline", "output_ids": [1]}\n', {"max_new_tokens": 64}, "other settings"),
    ],
)
def test_a_bad_reference_is_one_line(tmp_path, content, summary, message):
    path = tmp_path / "ref.jsonl"
    if content is not None:
        path.write_text(content)
    if summary is not None:
        write_rows(path, [json.loads(content)], summary)
    with pytest.raises(SpecHeadsError, match=message) as err:
        read_reference(path, {"max_new_tokens": 96, "temperature": 0.0})
    assert "\n" not in str(err.value)


def test_a_benchmark_reports_agreement_with_a_reference_run(tmp_path, tiny_target):
    """A baseline-only run of the target is the reference of a second run: every method of the
    second equals it; a reference with one answer changed is caught."""
    questions = write_questions(tmp_path / "q.jsonl", [f"Tell me about {i}." for i in range(3)])

    def bench(output, head=None, reference=None, methods=("baseline",)):
        settings = InferJobConfig(
            tree=TreeConfig(kind="dynamic", depth=2, top_k=2, total_tokens=4),
            bench=BenchConfig(
                questions=str(questions),
                output=str(output),
                max_new_tokens=10,
                warmup=0,
                plots=False,
                methods=list(methods),
                reference=reference,
            ),
        )
        out = io.StringIO()
        return run_benchmark(settings, Session(tiny_target, head, tmp_path / "head", {}), out=out), out.getvalue()

    first, _ = bench(tmp_path / "ref.jsonl")
    assert first["methods"]["baseline"]["all"]["repeat_rate"] is not None
    torch.manual_seed(0)
    head = build_head(HeadConfig(family="eagle"), tiny_target)
    report, text = bench(tmp_path / "run.jsonl", head, str(tmp_path / "ref.jsonl"), ("baseline", "spec"))
    got = report["agreement_with_reference"]["methods"]
    assert got["spec"]["equal"] == got["baseline"]["equal"] == 3
    assert "spec: 3/3 answers equal to the reference's" in text
    rows = [json.loads(line) for line in (tmp_path / "ref.jsonl").read_text().splitlines()]
    rows[1]["output_ids"] = rows[1]["output_ids"][:3] + [(rows[1]["output_ids"][3] + 1) % 256]
    write_rows(tmp_path / "changed.jsonl", rows)
    report, _ = bench(tmp_path / "run2.jsonl", reference=str(tmp_path / "changed.jsonl"))
    changed = report["agreement_with_reference"]["methods"]["baseline"]
    assert changed["equal"] == 2 and changed["mean_common_prefix"] < 10
    # a reference run with another max_new_tokens is refused before anything runs
    with pytest.raises(SpecHeadsError, match="max_new_tokens=10 there, 12 here"):
        read_reference(tmp_path / "ref.jsonl", {"max_new_tokens": 12, "temperature": 0.0})
