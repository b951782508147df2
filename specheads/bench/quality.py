"""What the answers say, beside how fast they came: repetition within an answer, and agreement
with a reference run's answers (bench.reference).

Lossless decoding needs neither: its answers equal its own target's. They are for a head that
changes its target (Medusa-2's adapted target), where the question is how far the new target's
answers are from the original's: a reference run of the original target gives its answers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..data.repeats import REPEAT_N, repeated_ngrams
from ..errors import SpecHeadsError


def repeat_rate(answers: Sequence[Sequence[int]], n: int = REPEAT_N) -> float | None:
    """The share of n-grams repeating an earlier one in their answer, pooled over the answers
    (a looping answer scores near 1, fluent text near 0); None with no n-gram at all."""
    counts = [repeated_ngrams(a, n) for a in answers]
    total = sum(c for _, c in counts)
    return sum(r for r, _ in counts) / total if total else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def read_reference(path: str | Path, settings: dict) -> dict[tuple, list[int]]:
    """(question_id, turn) -> output_ids of the `baseline` rows of an earlier benchmark's rows file.

    settings: this run's max_new_tokens and temperature, which the reference's summary (when it
    sits beside its rows) must share, or the comparison would measure the settings."""
    path = Path(path)
    if not path.is_file():
        raise SpecHeadsError(f"bench.reference={path}: no such rows file (an earlier benchmark's OUT.jsonl)")
    answers: dict[tuple, list[int]] = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if row["method"] == "baseline":
                    answers[row["question_id"], row.get("turn", 1)] = [int(t) for t in row["output_ids"]]
            except (ValueError, KeyError, TypeError) as err:
                raise SpecHeadsError(f"bench.reference={path}: line {n} is not a benchmark row ({err})") from None
    if not answers:
        raise SpecHeadsError(
            f"bench.reference={path} holds no baseline rows (run it with bench.methods including baseline)"
        )
    summary = path.with_name(path.name.removesuffix(".jsonl") + ".summary.json")
    if summary.is_file():
        recorded = json.loads(summary.read_text(encoding="utf-8"))
        differ = [k for k, v in settings.items() if k in recorded and recorded[k] != v]
        if differ:
            said = ", ".join(f"{k}={recorded[k]} there, {settings[k]} here" for k in differ)
            raise SpecHeadsError(f"bench.reference={path} was run with other settings: {said}")
    return answers


def agreement(rows: Sequence[dict], reference: dict[tuple, list[int]], methods: Sequence[str]) -> dict:
    """Per method: how many of its answers equal the reference's answer to the same question and
    turn, their mean common prefix in tokens, and the reference's own repeat rate on those answers."""
    out = {}
    for m in methods:
        pairs = [
            (r["output_ids"], reference[r["question_id"], r.get("turn", 1)])
            for r in rows
            if r["method"] == m and (r["question_id"], r.get("turn", 1)) in reference
        ]
        if not pairs:
            raise SpecHeadsError("bench.reference shares no question with this run (same questions file?)")
        out[m] = {
            "answers": len(pairs),
            "equal": sum(a == b for a, b in pairs),
            "mean_common_prefix": sum(common_prefix(a, b) for a, b in pairs) / len(pairs),
            "repeat_rate": repeat_rate([a for a, _ in pairs]),
            "reference_repeat_rate": repeat_rate([b for _, b in pairs]),
        }
    return out


def format_agreement(report: dict) -> list[str]:
    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    return [
        f"{m}: {a['equal']}/{a['answers']} answers equal to the reference's, mean common prefix "
        f"{a['mean_common_prefix']:.1f} tokens; repeated {REPEAT_N}-grams {pct(a['repeat_rate'])} "
        f"(reference {pct(a['reference_repeat_rate'])})"
        for m, a in report.items()
    ]
