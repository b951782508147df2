"""README.md's results table is BENCHMARKS.md's headline table, copied by this tool, never by hand.

BENCHMARKS.md marks its headline table (the first of "Current results") with HEADLINE_BEGIN and
HEADLINE_END; README.md marks where the copy goes with INCLUDED_BEGIN and INCLUDED_END. Run

    .venv/bin/python tools/readme_results.py            # rewrite README.md's copy
    .venv/bin/python tools/readme_results.py --check    # exit 1 if it differs (tests/test_docs_commands.py)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specheads.atomic import write_text  # noqa: E402

HEADLINE_BEGIN = "<!-- headline: the README shows this table (tools/readme_results.py) -->"
HEADLINE_END = "<!-- headline end -->"
INCLUDED_BEGIN = "<!-- included from BENCHMARKS.md by tools/readme_results.py: edit it there -->"
INCLUDED_END = "<!-- included end -->"


def between(text: str, begin: str, end: str, where: str) -> tuple[int, int]:
    """(start, stop) of the text strictly between the two markers; one line if they are missing."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{where}: the markers {begin!r} ... {end!r} are missing or out of order")
    return start + len(begin), stop


def headline(benchmarks: str) -> str:
    """The headline block: the table and the heading of its section, linked."""
    start, stop = between(benchmarks, HEADLINE_BEGIN, HEADLINE_END, "BENCHMARKS.md")
    heading = re.findall(r"^### (.+)$", benchmarks[:start], re.M)[-1]
    anchor = re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")
    table = benchmarks[start:stop].strip()
    return f"\n{heading} ([the study and its command](BENCHMARKS.md#{anchor})):\n\n{table}\n"


def included(readme: str, benchmarks: str) -> str:
    start, stop = between(readme, INCLUDED_BEGIN, INCLUDED_END, "README.md")
    return readme[:start] + headline(benchmarks) + readme[stop:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md's copy is not BENCHMARKS.md's table")
    args = p.parse_args(argv)
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    want = included(readme, (ROOT / "BENCHMARKS.md").read_text())
    if args.check:
        if want != readme:
            print(
                "README.md's results table differs from BENCHMARKS.md's: run tools/readme_results.py", file=sys.stderr
            )
            return 1
        return 0
    if want != readme:
        write_text(readme_path, want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
