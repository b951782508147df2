"""data/decontaminate.py: the shipped dev prompts are always evaluation prompts, unmatched globs say so."""

import json
from collections import Counter

import pytest

from specheads.data.decontaminate import decontaminate, eval_prompts, resolve_eval_files, words
from specheads.data.questions import DEV_QUESTIONS
from specheads.errors import SpecHeadsError

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def write_questions(path, turns):
    path.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": turns}) + "\n")
    return path


def test_dev_questions_ship_in_fastchat_format():
    rows = [json.loads(line) for line in DEV_QUESTIONS.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 40
    assert Counter(r["category"] for r in rows) == {c: 5 for c in CATEGORIES}
    assert len({r["question_id"] for r in rows}) == 40
    assert all(isinstance(r["question_id"], int) for r in rows)
    assert all(len(r["turns"]) == 2 and all(isinstance(t, str) and t.strip() for t in r["turns"]) for r in rows)


def test_dev_set_is_always_included(tmp_path):
    assert resolve_eval_files([]) == [DEV_QUESTIONS]
    assert resolve_eval_files(None) == [DEV_QUESTIONS]
    other = write_questions(tmp_path / "q.jsonl", ["anything at all"])
    assert resolve_eval_files([str(other)]) == [DEV_QUESTIONS, other]
    assert resolve_eval_files([str(tmp_path / "*.jsonl")]) == [DEV_QUESTIONS, other]
    # named again, it is not counted twice
    assert resolve_eval_files([str(DEV_QUESTIONS), str(other)]) == [DEV_QUESTIONS, other]


def test_unmatched_glob_prints_one_line(tmp_path, capsys):
    pattern = str(tmp_path / "missing" / "*.jsonl")
    assert resolve_eval_files([pattern]) == [DEV_QUESTIONS]
    assert capsys.readouterr().out.splitlines() == [f"decontamination: {pattern} matches no file; skipped"]
    write_questions(tmp_path / "q.jsonl", ["anything at all"])
    resolve_eval_files([str(tmp_path / "*.jsonl")])
    assert capsys.readouterr().out == ""  # a glob that matches says nothing


def test_missing_plain_file_is_an_error(tmp_path):
    with pytest.raises(SpecHeadsError, match="does not exist"):
        resolve_eval_files([str(tmp_path / "nope.jsonl")])


def test_conversation_overlapping_a_dev_question_is_dropped():
    dev = max(eval_prompts([DEV_QUESTIONS]), key=lambda p: len(words(p)))
    toks = words(dev)
    assert len(toks) >= 14
    leaked = "Quick one: " + " ".join(toks[1:14]).upper() + ", please."  # 13 words shared
    near = " ".join(toks[1:13])  # 12 words shared: not enough
    convs = [
        [{"role": "user", "content": leaked}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": near}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": "Tell me a joke about cats."}, {"role": "assistant", "content": dev}],
    ]
    kept, dropped = decontaminate(convs, resolve_eval_files([]))
    assert dropped == 1 and kept == convs[1:]
