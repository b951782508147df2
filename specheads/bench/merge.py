"""Timed benchmark runs of one question set, split by category (bench.categories) to fit the
sittings a long benchmark needs, joined into one table and summary.

Each run times every one of its methods on each of its questions back to back, so what a method
gains on a question is measured in one sitting; the joined totals add the runs' tokens and
seconds, per category exactly the run's own. The runs must have run the same methods on disjoint
questions on one machine (their summaries' `machine`); at temperature 0 every answer is compared
with our own plain loop's.

    python -m specheads.bench.merge --output runs/bench/mt_all.jsonl runs/bench/mt_a.jsonl runs/bench/mt_b.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..atomic import write_json, write_text
from ..errors import SpecHeadsError
from .runner import (
    acceptance_per_depth,
    compare_outputs,
    cost_breakdown,
    format_costs,
    format_table,
    output_paths,
    summarize,
)

NOT_DRAFTING = ("baseline", "plain", "prompt_lookup", "assisted")  # methods with no draft/verify split
# the first run's settings the joined summary repeats
REPORTED = (
    "target",
    "head",
    "family",
    "tree",
    "device",
    "machine",
    "dtype",
    "temperature",
    "max_new_tokens",
    "turns",
)


def read_run(path: Path) -> tuple[list[dict], dict]:
    """A run's rows (OUT.jsonl) and its summary (OUT.summary.json), refused in one line if unreadable."""
    summary_path = output_paths(path)["summary"]
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise SpecHeadsError(f"{err.filename} does not exist: give the OUT.jsonl of a finished timed run") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpecHeadsError(f"{path} (or its summary) is not a benchmark run's JSON: {err}") from None
    if not rows or not all(isinstance(r, dict) and {"question_id", "method", "wall_s"} <= set(r) for r in rows):
        raise SpecHeadsError(f"{path} holds no timed benchmark rows (bench.mode=timed writes them)")
    return rows, summary


def join_runs(paths: Sequence[Path]) -> tuple[list[dict], list[str], list[dict]]:
    """Every run's rows, the methods (in the first run's order) and the runs' summaries."""
    rows: list[dict] = []
    methods: list[str] | None = None
    summaries = []
    where: dict[tuple, Path] = {}
    settings = ("target", "head", "device", "dtype", "temperature", "top_p", "max_new_tokens", "turns")
    for path in paths:
        run, summary = read_run(path)
        ran = list(dict.fromkeys(r["method"] for r in run))
        if methods is None:
            methods = ran
        elif set(ran) != set(methods):
            raise SpecHeadsError(f"{path} ran methods {ran}, {paths[0]} ran {methods}: join runs of the same methods")
        first = summaries[0] if summaries else summary
        differ = [k for k in settings if summary.get(k) != first.get(k)]
        if differ:
            raise SpecHeadsError(f"{path} differs from {paths[0]} in {differ}: join runs of one setting")
        ours, theirs = summary.get("machine"), first.get("machine")
        if ours and theirs and ours != theirs:  # runs written before summaries named their machine pass
            changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise SpecHeadsError(
                f"{path} ran on another machine than {paths[0]} ({', '.join(changed)} differ): "
                "join runs of one machine, whose ratios are comparable"
            )
        for key in {(r["question_id"], r.get("turn", 1)) for r in run}:
            if key in where:
                raise SpecHeadsError(f"question {key[0]} (turn {key[1]}) is in both {where[key]} and {path}")
            where[key] = path
        rows += run
        summaries.append(summary)
    assert methods is not None
    return rows, methods, summaries


def merge_runs(paths: Sequence[str | Path], output: str | Path, out: TextIO = sys.stdout) -> dict:
    """Join the runs (module docstring): OUTPUT (the rows), OUTPUT.summary.json and OUTPUT.tau.png."""
    if len(paths) < 2:
        raise SpecHeadsError("give at least two runs to join")
    runs = [Path(p) for p in paths]
    rows, methods, summaries = join_runs(runs)
    greedy = summaries[0].get("temperature", 0.0) <= 0
    summary = summarize(rows, methods)
    report = {key: summaries[0].get(key) for key in REPORTED}
    report |= {
        "runs": [{"rows": str(p), "questions": s.get("questions")} for p, s in zip(runs, summaries)],
        "questions": len({r["question_id"] for r in rows}),
        "methods": summary,
        "drafters": {
            m: {
                "acceptance_per_depth": acceptance_per_depth([r for r in rows if r["method"] == m]),
                "costs": cost_breakdown(rows, m),
            }
            for m in methods
            if m not in NOT_DRAFTING
        },
    }
    if "plain" in methods and greedy:
        report["identical_to_plain"] = compare_outputs(rows, methods, "plain")
    paths_out = output_paths(output)
    paths_out["rows"].parent.mkdir(parents=True, exist_ok=True)
    write_text(paths_out["rows"], "".join(json.dumps(r) + "\n" for r in rows))
    write_json(paths_out["summary"], report)
    from .plots import plot_tau_per_category

    plot_tau_per_category(summary, paths_out["tau_png"])
    out.write(f"{len(runs)} runs, {report['questions']} questions\n{format_table(summary)}\n")
    for m, cmp in report.get("identical_to_plain", {}).items():
        out.write(f"{m}: {cmp['equal']}/{cmp['total']} outputs identical to plain\n")
    for m, info in report["drafters"].items():
        if info["costs"]:
            out.write(f"{m}: {format_costs(info['costs'])}\n")
    out.write(f"rows: {paths_out['rows']}\nsummary: {paths_out['summary']}\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specheads.bench.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="the runs' OUT.jsonl files (their OUT.summary.json beside them)")
    parser.add_argument("--output", required=True, help="the joined rows file; its summary and plot go beside it")
    args = parser.parse_args(argv)
    try:
        merge_runs(args.runs, args.output)
    except SpecHeadsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
