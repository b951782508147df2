"""Benchmark questions: FastChat question.jsonl files (MT-Bench and its like)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import SpecHeadsError


def read_questions(
    path: str | os.PathLike,
    limit: int | None = None,
    per_category: int | None = None,
    categories: Sequence[str] = (),
) -> list[dict]:
    """FastChat question.jsonl rows: question_id, category, prompt (the first turn), turns (all).

    per_category keeps the first N questions of every category (a quick run that still covers all);
    categories, when given, keeps only those (a long benchmark split into runs that each fit a
    sitting; every run still times all its methods on each of its questions). limit applies last.
    """
    p = Path(path)
    if not p.is_file():
        raise SpecHeadsError(f"questions file {path} does not exist")
    rows: list[dict] = []
    seen: set[str] = set()
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecHeadsError(f"{path}:{n} is not valid JSON: {err.msg}") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if not turns or not isinstance(turns, list) or "question_id" not in row:
                raise SpecHeadsError(f"{path}:{n} needs question_id and a non-empty turns list (FastChat format)")
            category = row.get("category", "all") or "all"
            seen.add(category)
            if categories and category not in categories:
                continue
            if per_category is not None and sum(r["category"] == category for r in rows) >= per_category:
                continue
            rows.append(
                {
                    "question_id": row["question_id"],
                    "category": category,
                    "prompt": str(turns[0]),
                    "turns": [str(t) for t in turns],
                }
            )
    unknown = sorted(set(categories) - seen)
    if unknown:
        raise SpecHeadsError(f"{path} has no questions of categories {unknown} (it has: {', '.join(sorted(seen))})")
    if not rows:
        raise SpecHeadsError(f"{path} holds no questions")
    return rows[:limit] if limit is not None else rows
