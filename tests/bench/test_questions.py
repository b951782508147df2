"""FastChat question files and SPEED-Bench: first turns, categories, and one-line errors for bad rows."""

import io
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl, write_questions

from specheads.bench.questions import PLACEHOLDER, check_question_source, read_questions
from specheads.bench.runner import run_benchmark
from specheads.bench.session import Session
from specheads.config.infer import BenchConfig, InferJobConfig, TreeConfig, validate
from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.heads import build_head


def questions_about(path, categories):
    """Two-turn questions (ids 80..), one per category, each asking about its category."""
    prompts = [f"Question {i}: tell me about {c}." for i, c in enumerate(categories)]
    return write_questions(path, prompts, categories, first_id=80, later_turns=("second turn",))


def test_read_questions(tmp_path):
    rows = read_questions(questions_about(tmp_path / "q.jsonl", ["writing", "math", "writing", "coding"]), limit=3)
    assert [r["question_id"] for r in rows] == [80, 81, 82]
    assert rows[0]["prompt"].startswith("Question 0") and rows[1]["category"] == "math"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["a"]}\nnot json\n')
    with pytest.raises(SpecHeadsError, match=":2: invalid JSON"):
        read_questions(bad)
    bad.write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(SpecHeadsError, match="turns"):
        read_questions(bad)
    with pytest.raises(SpecHeadsError, match="does not exist"):
        read_questions(tmp_path / "missing.jsonl")


def test_per_category_keeps_the_first_questions_of_every_category(tmp_path):
    path = questions_about(tmp_path / "q.jsonl", ["a", "a", "a", "b", "b", "c"])
    picked = read_questions(path, per_category=2)
    assert [q["question_id"] - 80 for q in picked] == [0, 1, 3, 4, 5]


def test_categories_keep_only_those_and_name_the_ones_missing(tmp_path):
    path = questions_about(tmp_path / "q.jsonl", ["a", "b", "a", "c", "b"])
    assert [q["question_id"] - 80 for q in read_questions(path, categories=["b", "c"])] == [1, 3, 4]
    assert [q["question_id"] - 80 for q in read_questions(path, per_category=1, categories=["a", "b"])] == [0, 1]
    with pytest.raises(SpecHeadsError, match=r"no questions of categories \['d'\] \(it has: a, b, c\)"):
        read_questions(path, categories=["a", "d"])


# SPEED-Bench (nvidia/SPEED-Bench): five rows written for these tests in its schema, not its data
SPEED_FIXTURE = Path(__file__).with_name("speed_bench_fixture.jsonl")
SPEED_RECORDS = [
    (1, "coding", ["Fixture prompt: write a Python function that reverses a string."]),
    (2, "coding", ["Fixture prompt: why does `x = [] * 3` give an empty list?", "Fixture follow-up: and `[[]] * 3`?"]),
    (3, "math", ["Fixture prompt: what is 17 times 23?"]),
    (4, "math", ["Fixture prompt: solve 2x + 6 = 14 for x."]),
    (5, "writing", ["Fixture prompt: write a four-line poem about a lighthouse."]),
]


def speed_rows():
    return [json.loads(line) for line in SPEED_FIXTURE.read_text().splitlines()]


def expected_records():
    return [
        {"question_id": f"{i:032x}", "category": c, "prompt": turns[0], "turns": turns} for i, c, turns in SPEED_RECORDS
    ]


def with_messages(row):
    """The row as NeMo-Skills' SPEED-Bench prepare.py writes it: turns as OpenAI user messages."""
    rest = {k: v for k, v in row.items() if k != "turns"}
    return {**rest, "messages": [{"role": "user", "content": t} for t in row["turns"]]}


def test_speed_bench_rows_become_question_records(tmp_path):
    import datasets

    assert read_questions(SPEED_FIXTURE) == expected_records()
    # its prompts built by NVIDIA's prepare scripts: Model-Optimizer's parquet, NeMo-Skills' messages
    datasets.Dataset.from_list(speed_rows()).to_parquet(str(tmp_path / "test.parquet"))
    assert read_questions(tmp_path / "test.parquet") == expected_records()
    assert read_questions(tmp_path) == expected_records()  # the directory prepare_data.py writes
    as_messages = [with_messages(r) for r in speed_rows()]
    assert read_questions(write_jsonl(tmp_path / "qualitative.jsonl", as_messages)) == expected_records()


def test_a_saved_dataset_directory_and_the_hub_id_read_the_same(tmp_path, monkeypatch):
    import datasets

    saved = tmp_path / "speed"
    datasets.Dataset.from_list(speed_rows()).save_to_disk(str(saved))
    assert read_questions(saved) == expected_records()
    calls = []

    def hub(name, config=None, split=None):  # nothing downloaded: the Hub's rows are the saved ones
        calls.append((name, config, split))
        return datasets.load_from_disk(str(saved))

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert read_questions("nvidia/SPEED-Bench") == expected_records()
    assert read_questions("nvidia/SPEED-Bench:throughput_1k", limit=1) == expected_records()[:1]
    assert calls == [("nvidia/SPEED-Bench", "qualitative", "test"), ("nvidia/SPEED-Bench", "throughput_1k", "test")]


def test_speed_bench_categories_are_kept_and_picked():
    assert [q["category"] for q in read_questions(SPEED_FIXTURE, per_category=1)] == ["coding", "math", "writing"]
    assert [q["question_id"][-1] for q in read_questions(SPEED_FIXTURE, categories=["math"])] == ["3", "4"]
    with pytest.raises(SpecHeadsError, match=r"no questions of categories \['rag'\] \(it has: coding, math, writing\)"):
        read_questions(SPEED_FIXTURE, categories=["rag"])


def test_a_speed_bench_placeholder_is_refused_where_it_would_be_benchmarked(tmp_path):
    rows = speed_rows()
    rows[2]["turns"] = [f"{PLACEHOLDER}\n\nTranslate: {{question}}"]  # as the Hub ships a row it may not redistribute
    path = write_jsonl(tmp_path / "hub.jsonl", rows)
    with pytest.raises(SpecHeadsError, match=r"1 of the 5 questions .*placeholder.*prepare") as err:
        read_questions(path)
    assert "\n" not in str(err.value) and f"{3:032x}, math" in str(err.value)
    assert len(read_questions(path, categories=["coding", "writing"])) == 3  # the rows without one still run


@pytest.mark.parametrize(
    "rows",
    [
        [{"messages": [{"role": "user", "content": "hi"}]}],  # a training conversation: no question_id
        [{"question_id": "a", "category": "math", "prompt": "hi"}],  # no turns
        [{"question_id": "a", "category": "math", "messages": [{"role": "assistant", "content": "hi"}]}],
    ],
)
def test_neither_schema_is_one_line_naming_both(tmp_path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "other.parquet"))
    for path in (write_jsonl(tmp_path / "other.jsonl", rows), tmp_path / "other.parquet"):
        with pytest.raises(SpecHeadsError, match=r"needs question_id and a non-empty turns list .*SPEED-Bench") as err:
            read_questions(path)
        assert "\n" not in str(err.value)


def test_a_hub_id_is_checked_without_the_network_and_a_missing_file_is_named(tmp_path):
    for source in ("nvidia/SPEED-Bench", "nvidia/SPEED-Bench:throughput_8k", str(tmp_path)):
        check_question_source(source)
    for source in ("runs/missing.jsonl", "./nvidia/SPEED-Bench", "missing"):
        with pytest.raises(SpecHeadsError, match=f"questions file {re.escape(source)} does not exist"):
            check_question_source(source)
    settings = InferJobConfig(head_path="org/head", bench=BenchConfig(questions="nvidia/SPEED-Bench"))
    assert validate(settings).bench.output == "runs/bench/SPEED-Bench.jsonl"  # infer.py takes it
    with pytest.raises(SpecHeadsError, match="does not exist"):
        validate(InferJobConfig(head_path="org/head", bench=BenchConfig(questions="runs/missing.parquet")))


def test_the_benchmark_summarizes_speed_bench_per_category(tmp_path, tiny_target):
    """The timed benchmark on the fixture, as short as it runs: its summary has SPEED-Bench's categories."""
    torch.manual_seed(0)
    head = build_head(HeadConfig(family="medusa", draft_vocab_size=320, num_heads=2), tiny_target)
    settings = InferJobConfig(
        head_path=str(tmp_path / "head"),
        tree=TreeConfig(kind="chain", depth=2),
        bench=BenchConfig(
            questions=str(SPEED_FIXTURE),
            output=str(tmp_path / "out.jsonl"),
            methods=["baseline", "spec"],
            max_new_tokens=3,
            warmup=0,
            bandwidth_mib=0,
            plots=False,
        ),
    )
    run_benchmark(settings, Session(tiny_target, head, tmp_path / "head", {}), out=io.StringIO())
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert set(summary["methods"]["spec"]) == {"all", "coding", "math", "writing"}
    assert summary["methods"]["spec"]["coding"]["questions"] == 2 and summary["questions"] == 5
