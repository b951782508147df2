"""Repetition inside an answer: the share of its n-grams that occurred earlier in it. Greedy
answers of a small target often loop; the benchmark reports the share (bench/quality.py) and
data.max_repeat_rate drops training rows above a limit."""

from __future__ import annotations

from collections.abc import Sequence

REPEAT_N = 4


def repeated_ngrams(ids: Sequence[int], n: int = REPEAT_N) -> tuple[int, int]:
    """(n-grams that occurred earlier in the same answer, n-grams) of one answer."""
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated, len(grams)


def answer_repeat_rate(row: dict, n: int = REPEAT_N) -> float:
    """The share of repeated n-grams in a tokenized row's trained (assistant) tokens; 0 with none."""
    answer = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    repeated, total = repeated_ngrams(answer, n)
    return repeated / total if total else 0.0
