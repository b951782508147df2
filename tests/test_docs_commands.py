"""The commands the documents show run as written, and each result has one home.

Every `train.py`, `distill.py`, `infer.py` and `specheads.export` command in a fenced ```bash
block of the README, the guides, BENCHMARKS.md and the study pages of docs/studies/ from
CHECKED_FROM on is composed with `--cfg job` (Hydra prints the composed config and exits before any
model is loaded; an unknown key or a wrong type fails in one line with exit status 2), and every
`make` target named there exists in the Makefile. The studies dated before CHECKED_FROM (the
results history they came from was never checked) are left out: they keep each study's commands as
they were run, with the keys of their day. docs/configuration.md is generated and shows no commands.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from hydra.core.global_hydra import GlobalHydra

ROOT = Path(__file__).resolve().parents[1]
# The first day of the studies that BENCHMARKS.md kept, and checked, before they moved to
# docs/studies/ (YYYY-MM-DD-slug.md); every later study is checked too.
CHECKED_FROM = "2026-11-27"
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "BENCHMARKS.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "configuration.md"),
    *sorted(p for p in (ROOT / "docs" / "studies").glob("*.md") if p.name == "index.md" or p.name >= CHECKED_FROM),
]
SCRIPTS = {"train.py", "distill.py", "infer.py"}
MODULES = {"specheads.export"}
# The console scripts of an installed specheads, as the checkout's entry points.
CONSOLE = {
    "specheads-train": ["train.py"],
    "specheads-distill": ["distill.py"],
    "specheads-infer": ["infer.py"],
    "specheads-export": ["-m", "specheads.export"],
}
# Launchers that run one of the scripts above with their own options first.
LAUNCHERS = {"deepspeed", "torchrun"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
# Commands shown that --cfg job cannot check as written, each with the reason (matched by a word).
NOT_COMPOSED = {
    "head=$1": "docs/studies/2026-11-27-families-equal-cost-h200.md: a shell loop gives the head and lr",
}
BLOCK = re.compile(r"^(?P<indent>[ \t]*)```bash[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


def bash_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of each fenced ```bash block, its indentation removed."""
    text = path.read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        indent = len(match.group("indent"))
        lines = [line[indent:] for line in match.group("body").splitlines()]
        blocks.append((text.count("\n", 0, match.start("body")) + 1, "\n".join(lines)))
    return blocks


def simple_commands(block: str) -> list[tuple[int, list[str]]]:
    """(line offset, words) of each simple command of a block: continuation lines and quoted
    strings over several lines joined, comments dropped, split at `&&`, `;`, `|` and `&`, and
    leading VAR=value assignments dropped."""
    commands = []
    logical, start = "", None
    for offset, line in enumerate(block.splitlines()):
        start = offset if start is None else start
        if line.rstrip().endswith("\\"):
            logical += line.rstrip()[:-1] + " "
            continue
        logical += line
        lexer = shlex.shlex(logical, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = [*lexer, ";"]
        except ValueError:  # a quoted string that goes on over the next line
            logical += "\n"
            continue
        words: list[str] = []
        for word in tokens:
            if word in SEPARATORS:
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                    words.pop(0)
                if words:
                    commands.append((start, words))
                words = []
            else:
                words.append(word)
        logical, start = "", None
    return commands


def entry_point(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(how to run it with sys.executable, its overrides) if `words` runs one of our commands."""
    program = Path(words[0]).name
    if program in CONSOLE:
        return CONSOLE[program], words[1:]
    if program in LAUNCHERS:
        for i, word in enumerate(words):
            if word in SCRIPTS:
                return [word], words[i + 1 :]
        return None
    if not re.fullmatch(r"python3?(\.\d+)?", program):
        return None
    if len(words) > 1 and words[1] in SCRIPTS:
        return [words[1]], words[2:]
    if len(words) > 2 and words[1] == "-m" and words[2] in MODULES:
        return ["-m", words[2]], words[3:]
    return None


def documented(kind: str) -> list:
    found = []
    for path in DOCUMENTS:
        for first, block in bash_blocks(path):
            for offset, words in simple_commands(block):
                where = f"{path.relative_to(ROOT)}:{first + offset}"
                if kind == "make" and words[0] == "make":
                    found.append(pytest.param(words, id=where))
                elif kind == "command" and entry_point(words) is not None:
                    found.append(pytest.param(words, id=where))
    return found


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def cfg_job(script: list[str], overrides: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python SCRIPT OVERRIDES --cfg job` from the checkout's root,
    run in this process as `python` would run it (runpy: the script's own __main__, the same argv
    rewriting and one-line errors): half the time of a new interpreter for each of a hundred
    commands. test_composing_here_is_what_the_command_line_does holds the two to the same output."""
    argv, cwd = sys.argv, os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        os.chdir(ROOT)
        sys.argv = [script[-1], *[w for w in overrides if w not in ("--cfg", "job")], "--cfg", "job"]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if script[0] == "-m":
                runpy.run_module(script[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / script[0]), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
        os.chdir(cwd)
        GlobalHydra.instance().clear()
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("words", documented("command"))
def test_documented_command_composes(words):
    for word, reason in NOT_COMPOSED.items():
        if word in words:
            pytest.skip(reason)
    code, _, err = cfg_job(*entry_point(words))
    assert code == 0, f"{shlex.join(words)}\n{err.strip()}"


def test_composing_here_is_what_the_command_line_does():
    """cfg_job against a real `python train.py ... --cfg job` (and a bad key: one line, status 2)."""
    for overrides in (["data.path=runs/distill", "output_dir=runs/e3"], ["distill.bogus=1"]):
        script = ["train.py"] if overrides[0].startswith("data") else ["distill.py"]
        cli = subprocess.run(
            [sys.executable, *script, *overrides, "--cfg", "job"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert cfg_job(script, overrides) == (cli.returncode, cli.stdout, cli.stderr)
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1 and "bogus" in cli.stderr


@pytest.mark.parametrize("words", documented("command"))
def test_documented_command_runs_the_checkouts_python(words):
    """One convention: a checkout's command is run with its virtualenv's programs (`make setup`),
    never a bare `python` (a system Python has no torch)."""
    assert words[0].startswith(".venv/bin/") or Path(words[0]).name in CONSOLE, shlex.join(words)


@pytest.mark.parametrize("words", documented("make"))
def test_documented_make_target_exists(words):
    targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w] or ["setup"]
    missing = [t for t in targets if t not in makefile_targets()]
    assert not missing, f"{shlex.join(words)}: no such target in the Makefile: {missing}"


def test_the_readme_and_quickstart_commands_are_found():
    """The extraction itself: the README's tour, the quickstart and the studies from CHECKED_FROM on
    are among the commands checked, the older studies not."""
    ids = [p.id for p in documented("command")]
    assert any(i.startswith("README.md:") for i in ids)
    assert any(i.startswith(f"docs/studies/{CHECKED_FROM}-") for i in ids)
    assert not any(i.startswith("docs/studies/") and i[len("docs/studies/") :] < CHECKED_FROM for i in ids)
    assert any(i.startswith("docs/quickstart.md:") for i in ids)
    assert any(p.id.startswith("docs/quickstart.md:") for p in documented("make"))


def test_documented_extras_exist():
    """Every `specheads[EXTRA]` / `.[EXTRA]` a document names is an extra of pyproject.toml."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {
        (path.name, extra.strip())
        for path in DOCUMENTS
        for group in re.findall(r"(?:specheads|['\"]\.)\[([\w, -]+)\]", path.read_text())
        for extra in group.split(",")
    }
    assert named, "no extra found: the pattern is stale"
    assert not {(doc, extra) for doc, extra in named if extra not in extras}


# A row of a results table: a markdown table row with a measured ratio ("1.54x") or a column
# of tokens/s. Those tables live in BENCHMARKS.md; the README's one table is its headline table,
# copied by tools/readme_results.py between its markers.
RESULT_ROW = re.compile(r"^\s*\|.*(\b\d+(\.\d+)?x\b|tokens/s|tok/s|x our|vs HF greedy|tau)", re.I)


def readme_results():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import readme_results

        return readme_results
    finally:
        sys.path.remove(str(ROOT / "tools"))


def copied_result_rows(markdown: str) -> list[str]:
    """Result rows outside the included block."""
    tool = readme_results()
    if tool.INCLUDED_BEGIN in markdown:
        start, stop = tool.between(markdown, tool.INCLUDED_BEGIN, tool.INCLUDED_END, "README.md")
        markdown = markdown[:start] + markdown[stop:]
    return [line for line in markdown.splitlines() if RESULT_ROW.match(line)]


def test_the_readmes_results_table_is_benchmarks_headline_table_and_no_other():
    """README.md shows BENCHMARKS.md's headline table as tools/readme_results.py copies it: a
    number edited in either file alone, or another results table copied by hand, fails."""
    tool = readme_results()
    readme, benchmarks = (ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()
    assert tool.included(readme, benchmarks) == readme, "run .venv/bin/python tools/readme_results.py"
    headline = benchmarks.index(tool.HEADLINE_BEGIN)
    figure = re.compile(r"\| (\d+\.\d+) \|").search(benchmarks, headline)  # the headline table's first figure
    edited = benchmarks[: figure.start(1)] + str(float(figure.group(1)) + 1) + benchmarks[figure.end(1) :]
    assert tool.included(readme, edited) != readme
    rows = copied_result_rows(readme)
    assert not rows, "README.md copies a results table by hand:\n" + "\n".join(rows)
    assert copied_result_rows(readme.replace(tool.INCLUDED_BEGIN, "")), "the row pattern finds no table: stale"
    assert "BENCHMARKS.md#current-results" in readme


def test_every_study_has_a_dated_page_and_a_row_in_the_studies_index():
    """docs/studies/: one page a study, YYYY-MM-DD-slug.md under a dated title, each listed once in
    index.md's table (the site's nav follows that table, tools/mkdocs_hooks.py); BENCHMARKS.md
    keeps only its current results and links the index."""
    folder = ROOT / "docs" / "studies"
    pages = sorted(p.name for p in folder.glob("*.md") if p.name != "index.md")
    assert pages, "no study pages"
    for name in pages:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+\.md", name), name
        title = (folder / name).read_text().split("\n", 1)[0]
        assert re.fullmatch(rf"# .+ \({name[:10]}\)", title), f"{name}: {title}"
    rows = re.findall(r"^\| (\d{4}-\d\d-\d\d) \| \[[^\]]+\]\(([^)]+\.md)\)", (folder / "index.md").read_text(), re.M)
    assert sorted(page for _, page in rows) == pages
    assert all(page.startswith(date) for date, page in rows)
    assert [date for date, _ in rows] == sorted((date for date, _ in rows), reverse=True), "index.md: newest first"
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert "docs/studies/index.md" in benchmarks and "\n### " not in benchmarks.split("\n## Studies", 1)[1]
