"""BENCHMARKS.md's current results and README.md's table, made from the results records in results/.

Every benchmark, replay and engine run writes a `record` beside its figures
(specheads.bench.record: the weights digest of each head it ran, the questions and their digest,
the machine, the date, the command). A run that measures a shipped head is kept in results/ as one
JSON file, and the tables are made from those files, never typed:

    .venv/bin/python tools/results_tables.py --add cpu-mt-bench runs/bench/mt.summary.json
    .venv/bin/python tools/results_tables.py            # rewrite the tables and the plot
    .venv/bin/python tools/results_tables.py --check    # exit 1 if a table differs (tests/test_results_tables.py)

BENCHMARKS.md marks each table with `<!-- results: NAME -->` ... `<!-- results end -->`, NAME
being a file results/NAME.json; the kind of its record picks the table. Each row that ran a head
names its weights by the first 12 hex digits of their sha256.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "engines"))

from compare import FORMATS  # noqa: E402  (each vLLM run's format and the family it exports)
from readme_results import included  # noqa: E402

from specheads.atomic import write_json, write_text  # noqa: E402
from specheads.bench.record import short  # noqa: E402
from specheads.heads import HEADS  # noqa: E402
from specheads.provenance import portable_path  # noqa: E402

RESULTS = ROOT / "results"
BEGIN = re.compile(r"<!-- results: ([\w.+-]+) -->\n")
END = "<!-- results end -->"
# what a record keeps of a run's report: the per-question rows and texts stay in the run's folder
DROPPED = {"rows", "infer", "vllm", "output_ids", "question_ids"}
METHOD_NAMES = {
    "plain": "plain (our own loop)",
    "baseline": "HF greedy (`generate`)",
    "prompt_lookup": "HF prompt lookup",
    "lookup": "`lookup` (prompt lookup, our loop)",
    "spec": "`spec` (the head, its calibrated tree)",
    "hybrid": "`hybrid` (head + text repeats)",
    "skip": "`skip` (layers skipped, no training)",
    "draft": "`draft` (a draft model)",
}


def read_record(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"BENCHMARKS.md shows results/{name}.json, which is not there: --add it from a run's report")
    return json.loads(path.read_text())


def caption(report: dict) -> tuple[str, str]:
    """Where the figures come from (questions and their digest, machine, date, commit) and the command."""
    r = report["record"]
    q, m = r.get("questions") or {}, r.get("machine") or {}
    machine = f"{m.get('cpu', '?')}, {m.get('threads', '?')} threads" + (
        f", {m['cores']} cores" if m.get("cores") else ""
    )
    commit = r.get("commit") or ""
    commit = short(commit) + ("+dirty" if commit.endswith("+dirty") else "")
    tokens = f", {report['max_new_tokens']} new tokens, greedy" if report.get("max_new_tokens") else ""
    where = (
        f"{q.get('count', '?')} questions of `{q.get('path', '?')}` (sha256 {short(q.get('sha256'))}){tokens}; "
        f"{machine}; {r['date'][:10]}; commit {commit}."
    )
    return where, r.get("command")


def captions(reports: list[dict]) -> str:
    """Each distinct where-from line once, then the recorded command of each record."""
    parts = [caption(r) for r in reports]
    wheres = "\n\n".join(dict.fromkeys(w for w, _ in parts))
    commands = "\n".join(c for _, c in parts)
    label = "The recorded command" if len(parts) == 1 else "The recorded commands, one a record"
    return f"{wheres}\n\n{label}:\n\n```text\n{commands}\n```\n"


def weights_of(report: dict, method: str) -> str:
    """The weights a method drafted with: its own head's (spec:NAME), the main head's (spec, hybrid)."""
    heads = report["record"]["heads"]
    entry = heads.get(method) or (heads.get("spec") if method in ("spec", "hybrid") else None)
    return f"`{short(entry['weights_sha256'])}`" if entry and entry.get("weights_sha256") else "-"


def bench_table(report: dict) -> str:
    methods = report["methods"]
    checks = report.get("identical_to_plain") or report.get("identical_to_baseline") or {}
    lines = [
        "| method | weights (sha256) | tau | tokens/s | x our plain loop | identical to plain |",
        "|---|---|---|---|---|---|",
    ]
    plain = methods.get("plain", {}).get("all", {}).get("tokens_per_s")
    for m, cats in methods.items():
        s = cats["all"]
        same = checks.get(m)
        identical = f"{same['equal']}/{same['total']}" if same else "-"
        ratio = f"{s['tokens_per_s'] / plain:.2f}x" if plain else "-"
        name = METHOD_NAMES.get(m, f"`{m}`")
        lines.append(
            f"| {name} | {weights_of(report, m)} | {s['tau']:.2f} | {s['tokens_per_s']:.1f} | {ratio} | {identical} |"
        )
    return "\n".join(lines) + "\n"


def replay_table(report: dict) -> str:
    chains = list(next(iter(report["heads"].values()))["chain_tau"])
    lines = [
        "| head | weights (sha256) | its tree (nodes) | " + " | ".join(f"K={k}" for k in chains) + " |",
        "|---|---|---|" + "---|" * len(chains),
    ]
    for label, r in report["heads"].items():
        entry = report["record"]["heads"].get(label) or {}
        tree = f"{r['tree']['tau']:.3f} ({r['tree']['nodes']})" if r.get("tree") else "-"
        taus = " | ".join(f"{r['chain_tau'][k]:.3f}" for k in chains)
        lines.append(f"| `{label}` | `{short(entry.get('weights_sha256'))}` | {tree} | {taus} |")
    return "\n".join(lines) + "\n"


def vllm_table(report: dict) -> str:
    """One row per run: loaded, greedy outputs equal to vLLM plain, acceptance length in vLLM and in
    infer.py on the same prompts (agree: within the two's counting), tokens/s at batch 1 and batched."""
    heads = report["record"]["heads"]
    batch = report.get("batch", "n")
    lines = [
        "| run | weights (sha256) | loaded | = vLLM plain | vLLM acceptance | infer.py acceptance | agree | "
        f"tokens/s (batch 1) | x vLLM plain | tokens/s (batch {batch}) | x vLLM plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    def length(acceptance):
        return num((acceptance or {}).get("mean_acceptance_length"), ".2f")

    for row in report["rows"]:
        fam = FORMATS.get(re.sub(r"-k\d+$", "", row["run"]), (None,))[0]  # a head's run is named by its format
        weights = f"`{short(heads[fam]['weights_sha256'])}`" if fam in heads else "-"
        same = row.get("identical")
        agree = "-" if row.get("agree") is None else "yes" if row["agree"] else "NO"
        lines.append(
            f"| {row['run']} | {weights} | {'yes' if row['loaded'] else 'NO'} | "
            f"{f'{same[0]}/{same[1]}' if same else '-'} | {length(row.get('vllm_acceptance'))} | "
            f"{length(row.get('infer_acceptance'))} | {agree} | "
            f"{num(row.get('tokens_per_s_batch1'), '.1f')} | {num(row.get('speedup_batch1'), '.2f')} | "
            f"{num(row.get('tokens_per_s_batch'), '.1f')} | {num(row.get('speedup_batch'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def llamacpp_table(report: dict) -> str:
    """One row per K of the record's head; each run's own llama.cpp plain speed beside it (a
    marker naming several records, a+b, shows their rows in one table)."""
    lines = [
        "| run | weights (sha256) | = llama.cpp plain | llama.cpp acceptance | replay acceptance "
        "| tokens/s | plain tokens/s | x plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + llamacpp_rows(report)) + "\n"


def llamacpp_rows(report: dict) -> list[str]:
    ((family, entry),) = report["record"]["heads"].items()
    title, n, plain = HEADS[family].title, report["questions"], report["plain_tokens_per_s"]
    rows = []
    for k, s in report["by_k"].items():
        llama = "-" if s["llama_acceptance"] is None else f"{s['llama_acceptance']:.3f}"
        replayed = "-" if s["replay_acceptance"] is None else f"{s['replay_acceptance']:.3f}"
        rows.append(
            f"| {title} draft, K={k} | `{short(entry['weights_sha256'])}` | {s['identical']}/{n} | {llama} | "
            f"{replayed} | {s['tokens_per_s']:.1f} | {plain:.1f} | {s['vs_plain']:.2f}x |"
        )
    return rows


TABLES = {"bench": bench_table, "replay": replay_table, "vllm": vllm_table, "llamacpp": llamacpp_table}
ROWS = {"llamacpp": llamacpp_rows}  # the kinds whose records can share one table


def block(name: str) -> str:
    """The table of results/NAME.json and where it comes from; NAME a+b: one table of several
    records of the same kind (their rows in order), each record's caption once."""
    reports = [read_record(part) for part in name.split("+")]
    kinds = {r["record"]["kind"] for r in reports}
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind not in TABLES or (len(reports) > 1 and kind not in ROWS):
        raise SystemExit(f"results/{name}.json: no table for records of kind(s) {sorted(kinds | {kind} - {None})}")
    table = TABLES[kind](reports[0])
    for report in reports[1:]:
        table += "\n".join(ROWS[kind](report)) + "\n"
    return table + "\n" + captions(reports)


def generated(text: str) -> str:
    """`text` with every marked block made again from its record."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        stop = text.find(END, m.end())
        if stop < 0:
            raise SystemExit(f"BENCHMARKS.md: {m.group(0).strip()} has no {END}")
        out += [text[pos : m.end()], block(m.group(1))]
        pos = stop
    return "".join(out) + text[pos:]


def kept(report: dict) -> dict:
    """A run's report as results/ keeps it: without per-question rows, outputs and texts, and with
    no path of the machine that ran it (provenance.portable_path, as a recorded command has them)."""
    if isinstance(report, dict):
        return {k: kept(v) for k, v in report.items() if k not in DROPPED}
    if isinstance(report, list):
        return [kept(v) for v in report]
    if isinstance(report, str) and report.startswith("/"):
        return portable_path(report)
    return report


def add(name: str, source: Path) -> Path:
    report = json.loads(source.read_text())
    if "record" not in report:
        raise SystemExit(f"{source} has no record (made before records were written): run it again")
    if report["record"]["kind"] in ("vllm", "llamacpp"):
        keep = {"rows"} if report["record"]["kind"] == "vllm" else set()
        report = {k: (v if k in keep else kept(v)) for k, v in report.items() if k not in DROPPED - keep}
    else:
        report = kept(report)
    return write_json(RESULTS / f"{name}.json", report)


def acceptance_plot(name: str, path: Path) -> None:
    """Acceptance per depth of each replayed head: the picture of how deep a head's drafts hold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specheads.atomic import save_figure

    report = read_record(name)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, r in report["heads"].items():
        digest = short(report["record"]["heads"][label]["weights_sha256"])
        depths = range(1, len(r["acceptance_per_depth"]) + 1)
        ax.plot(depths, r["acceptance_per_depth"], marker="o", label=f"{label} ({digest})")
    q = report["record"]["questions"]
    ax.set(xlabel="draft depth", ylabel="P(accepted | depth reached)", ylim=(0, 1))
    ax.set_title(f"Acceptance per depth, a chain of 8 replayed: {q['count']} questions of {q['path']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--add", nargs=2, metavar=("NAME", "REPORT"), help="keep a run's report as results/NAME.json")
    p.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md or README.md differs from the records")
    args = p.parse_args(argv)
    if args.add:
        print(add(args.add[0], Path(args.add[1])))
    bench_path, readme_path = ROOT / "BENCHMARKS.md", ROOT / "README.md"
    benchmarks = generated(bench_path.read_text())
    readme = included(readme_path.read_text(), benchmarks)
    if args.check:
        stale = [p.name for p, want in ((bench_path, benchmarks), (readme_path, readme)) if p.read_text() != want]
        if stale:
            print(
                f"{', '.join(stale)} differ from the records in results/: run tools/results_tables.py", file=sys.stderr
            )
            return 1
        return 0
    write_text(bench_path, benchmarks)
    write_text(readme_path, readme)
    if (RESULTS / "replay-mt-bench.json").exists():
        acceptance_plot("replay-mt-bench", ROOT / "docs" / "img" / "acceptance_per_depth.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
