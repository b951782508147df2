"""Benchmark questions: FastChat question.jsonl files (MT-Bench and its like) and SPEED-Bench.

SPEED-Bench (nvidia/SPEED-Bench on the Hub; its `qualitative` config is the 880 prompts in 11
categories) keeps FastChat's question_id, category and turns, beside sub_category, source,
src_id, difficulty and multiturn; NeMo-Skills' prepare.py writes the turns as OpenAI messages. It
is read from its Hub id, a parquet or jsonl file, or a directory (`datasets` save_to_disk, or
parquet files) through specheads.data.formats, the same readers as the training data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..data.formats import DATA_FILE_SUFFIXES, iter_rows
from ..errors import SpecHeadsError

SPEED_BENCH = "nvidia/SPEED-Bench"
SPEED_BENCH_CONFIG = "qualitative"  # its other configs, throughput_1k .. throughput_32k, are long inputs
# what SPEED-Bench's Hub rows hold instead of the prompts their sources do not let it redistribute;
# its prepare scripts (NVIDIA Model-Optimizer examples/specdec_bench/prepare_data.py, NeMo-Skills
# nemo_skills/dataset/speed-bench/prepare.py) fetch them from the sources
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(:[\w.-]+)?")
EXPECTED = (
    "needs question_id and a non-empty turns list (a FastChat question.jsonl row, or SPEED-Bench's "
    "question_id, category and turns, or messages as its prepare.py writes them)"
)


def read_questions(
    path: str | os.PathLike,
    limit: int | None = None,
    per_category: int | None = None,
    categories: Sequence[str] = (),
) -> list[dict]:
    """Question records: question_id, category, prompt (the first turn), turns (all).

    path: a FastChat question.jsonl, or SPEED-Bench (see the module's docstring; NAME:CONFIG picks
    a Hub data set's config). per_category keeps the first N questions of every category (a quick
    run that still covers all); categories, when given, keeps only those (a long benchmark split
    into runs that each fit a sitting; every run still times all its methods on each of its
    questions). limit applies last.
    """
    rows: list[dict] = []
    seen: set[str] = set()
    for where, row in question_rows(str(path)):
        q = question(where, row)
        seen.add(q["category"])
        if categories and q["category"] not in categories:
            continue
        if per_category is not None and sum(r["category"] == q["category"] for r in rows) >= per_category:
            continue
        rows.append(q)
    unknown = sorted(set(categories) - seen)
    if unknown:
        raise SpecHeadsError(f"{path} has no questions of categories {unknown} (it has: {', '.join(sorted(seen))})")
    if not rows:
        raise SpecHeadsError(f"{path} holds no questions")
    rows = rows[:limit] if limit is not None else rows
    refuse_placeholders(path, rows)
    return rows


def check_question_source(source: str) -> None:
    """One line, before any model loads, for a question set that is neither here nor a Hub id."""
    if not Path(source).expanduser().exists() and hub_id(source) is None:
        raise SpecHeadsError(f"questions file {source} does not exist")


def hub_id(source: str) -> tuple[str, str | None] | None:
    """(name, config) of a Hub data set NAME or NAME:CONFIG; None for a local path."""
    local = source.startswith((".", "/", "~")) or source.lower().endswith(DATA_FILE_SUFFIXES)
    if local or not HUB_ID.fullmatch(source):
        return None
    name, _, config = source.partition(":")
    return name, config or (SPEED_BENCH_CONFIG if name == SPEED_BENCH else None)


def question_rows(source: str) -> Iterable[tuple[str, Any]]:
    """(location, row) of every row: a local file or directory, else a Hub data set's test split
    (SPEED-Bench's only split)."""
    hub = None if Path(source).expanduser().exists() else hub_id(source)
    if hub is not None:
        yield from iter_rows(hub[0], "test", config=hub[1])
        return
    check_question_source(source)
    yield from iter_rows(source, "test")


def question(where: str, row: Any) -> dict:
    """A FastChat or SPEED-Bench row -> its question record; SpecHeadsError naming the row."""
    if not isinstance(row, dict) or "question_id" not in row:
        raise SpecHeadsError(f"{where} {EXPECTED}")
    turns = row.get("turns")
    if turns is None and isinstance(row.get("messages"), list):
        turns = user_turns(where, row["messages"])
    if not turns or not isinstance(turns, list):
        raise SpecHeadsError(f"{where} {EXPECTED}")
    return {
        "question_id": row["question_id"],
        "category": row.get("category", "all") or "all",
        "prompt": str(turns[0]),
        "turns": [str(t) for t in turns],
    }


def user_turns(where: str, messages: list) -> list[str]:
    """The user turns of SPEED-Bench's messages ([{"role": "user", "content"}, ...])."""
    if not all(isinstance(m, dict) and "content" in m for m in messages):
        raise SpecHeadsError(f"{where} messages must be objects with role and content")
    return [m["content"] for m in messages if m.get("role", "user") == "user"]


def refuse_placeholders(source, rows: list[dict]) -> None:
    """A placeholder benchmarked would time a sentence that is not the benchmark's prompt."""
    held = [q for q in rows if any(PLACEHOLDER in t for t in q["turns"])]
    if held:
        first = held[0]
        raise SpecHeadsError(
            f"{source}: {len(held)} of the {len(rows)} questions (first: {first['question_id']}, "
            f"{first['category']}) hold SPEED-Bench's placeholder for a prompt it may not redistribute: "
            "build the prompts with its prepare script (NVIDIA Model-Optimizer "
            "examples/specdec_bench/prepare_data.py, or NeMo-Skills' speed-bench prepare.py) and give "
            "the file it writes"
        )
