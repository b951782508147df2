"""Benchmark questions: FastChat question.jsonl files (MT-Bench and its like)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import SpecHeadsError


def read_questions(path: str | os.PathLike, limit: int | None = None, per_category: int | None = None) -> list[dict]:
    """FastChat question.jsonl rows: question_id, category, prompt (the first turn), turns (all).

    per_category keeps the first N questions of every category (a quick run that still covers all).
    """
    p = Path(path)
    if not p.is_file():
        raise SpecHeadsError(f"questions file {path} does not exist")
    rows = []
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
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise SpecHeadsError(f"{path} holds no questions")
    return rows
