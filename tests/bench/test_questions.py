"""FastChat question files: first turns, categories, and one-line errors for bad rows."""

import pytest
from conftest import write_questions

from specheads.bench.questions import read_questions
from specheads.errors import SpecHeadsError


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
    with pytest.raises(SpecHeadsError, match=":2 is not valid JSON"):
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
