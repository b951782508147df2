"""data/decontaminate.py: the shipped dev prompts are always evaluation prompts, unmatched globs say so."""

import json
from collections import Counter

import pytest
from conftest import write_questions

from specheads.data.decontaminate import NgramIndex, decontaminate, eval_prompts, resolve_eval_files, words
from specheads.data.questions import DEV_QUESTIONS
from specheads.errors import SpecHeadsError

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


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
    other = write_questions(tmp_path / "q.jsonl", ["anything at all"], first_id=1, later_turns=())
    assert resolve_eval_files([str(other)]) == [DEV_QUESTIONS, other]
    assert resolve_eval_files([str(tmp_path / "*.jsonl")]) == [DEV_QUESTIONS, other]
    # named again, it is not counted twice
    assert resolve_eval_files([str(DEV_QUESTIONS), str(other)]) == [DEV_QUESTIONS, other]


def test_unmatched_glob_prints_one_line(tmp_path, capsys):
    pattern = str(tmp_path / "missing" / "*.jsonl")
    assert resolve_eval_files([pattern]) == [DEV_QUESTIONS]
    assert capsys.readouterr().out.splitlines() == [f"decontamination: {pattern} matches no file; skipped"]
    write_questions(tmp_path / "q.jsonl", ["anything at all"], first_id=1, later_turns=())
    resolve_eval_files([str(tmp_path / "*.jsonl")])
    assert capsys.readouterr().out == ""  # a glob that matches says nothing


def test_relative_globs_are_read_from_the_working_directory_only(tmp_path, monkeypatch, capsys):
    """A relative glob that matches files of the source tree (here: the shipped dev set's folder)
    matches nothing when run elsewhere: an installed package has no checkout to fall back to."""
    pattern = "specheads/data/*.jsonl"
    monkeypatch.chdir(tmp_path)
    assert resolve_eval_files([pattern]) == [DEV_QUESTIONS]
    assert capsys.readouterr().out.splitlines() == [f"decontamination: {pattern} matches no file; skipped"]
    (tmp_path / "specheads" / "data").mkdir(parents=True)
    mine = write_questions(
        tmp_path / "specheads" / "data" / "q.jsonl", ["a prompt of mine"], first_id=1, later_turns=()
    )
    assert [f.resolve() for f in resolve_eval_files([pattern])] == [DEV_QUESTIONS.resolve(), mine.resolve()]


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


LONG = "please write a short poem about the quiet autumn rain falling on the old stone bridge tonight"


def test_ngram_overlap_is_dropped_and_counted(tmp_path):
    evalfile = write_questions(tmp_path / "question.jsonl", [LONG])
    words = LONG.split()
    convs = [
        [
            {"role": "user", "content": "Hey! " + " ".join(words[2:15]).upper() + "?"},  # 13 words shared
            {"role": "assistant", "content": "x"},
        ],
        [{"role": "user", "content": " ".join(words[2:14])}, {"role": "assistant", "content": "x"}],  # 12
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": LONG}],  # answers don't count
        [{"role": "user", "content": "Please shorter now."}, {"role": "assistant", "content": "x"}],
    ]
    kept, dropped = decontaminate(convs, [evalfile])
    assert dropped == 1 and kept == convs[1:]
    # An eval turn shorter than n words matches when it appears whole (if it has enough words).
    index = NgramIndex(["Rewrite your previous response with exactly three short bullet points."], n=13)
    assert index.matches("ok. REWRITE your previous response, with exactly three short bullet points!")
    assert not index.matches("rewrite your previous response with exactly three bullet points")


def test_eval_files_resolution(tmp_path):
    assert resolve_eval_files([str(tmp_path / "missing" / "*.jsonl")]) == [DEV_QUESTIONS]  # the dev set, always
    with pytest.raises(SpecHeadsError, match="does not exist"):
        resolve_eval_files([str(tmp_path / "nope.jsonl")])
    file = write_questions(tmp_path / "q.jsonl", [LONG])
    assert resolve_eval_files([str(tmp_path / "*.jsonl"), str(file)]) == [DEV_QUESTIONS, file]
