"""BENCHMARKS.md's current results and README's table are the records in results/, of today's heads."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from specheads.bench.record import short, weights_sha256

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import results_tables  # noqa: E402

RECORDS = sorted((ROOT / "results").glob("*.json"))
SHIPPED = sorted(p.parent for p in (ROOT / "heads").glob("*/model.safetensors"))


def records() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in RECORDS}


def test_the_tables_are_made_from_the_records():
    assert results_tables.main(["--check"]) == 0


def test_every_shipped_head_has_a_record_of_its_own_weights():
    measured = {entry["weights_sha256"] for r in records().values() for entry in r["record"]["heads"].values()}
    missing = [p.name for p in SHIPPED if weights_sha256(p) not in measured]
    assert not missing, f"shipped heads without a results record of their weights: {missing}"


@pytest.mark.parametrize("name", [p.stem for p in RECORDS])
def test_a_record_of_a_shipped_head_names_the_weights_shipped_now(name):
    """A record that ran heads/NAME measured the weights there now: else it is of weights no longer
    shipped, and the run is made again (or its record removed)."""
    for label, entry in records()[name]["record"]["heads"].items():
        here = ROOT / entry["dir"]
        if entry["dir"].startswith("heads/") and here.is_dir():
            assert entry["weights_sha256"] == weights_sha256(here), f"results/{name}.json: {label} is stale"


def test_each_table_row_names_the_weights_of_its_record():
    text = (ROOT / "BENCHMARKS.md").read_text()
    blocks = re.findall(r"<!-- results: ([\w.+-]+) -->\n(.*?)<!-- results end -->", text, re.S)
    shown_names = [part for name, _ in blocks for part in name.split("+")]
    assert sorted(shown_names) == sorted(p.stem for p in RECORDS)  # each record in one table
    for name, block in blocks:
        parts = [records()[part]["record"] for part in name.split("+")]
        ran = {short(e["weights_sha256"]) for r in parts for e in r["heads"].values()}
        shown = set(re.findall(r"`([0-9a-f]{12})`", block)) - {short(r["questions"]["sha256"]) for r in parts}
        assert shown and shown <= ran, f"{name}: the table names {shown - ran}, the records ran {ran}"


def test_a_table_naming_other_weights_fails_the_check(tmp_path, monkeypatch):
    """The check has teeth: one digit of a table's digest changed and it fails."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    cell = re.search(r"\| `([0-9a-f]{12})` \|", text)  # a table's weights cell, not the prose's
    digest = cell.group(1)
    wrong = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    fake = tmp_path / "BENCHMARKS.md"
    fake.write_text(text[: cell.start(1)] + wrong + text[cell.end(1) :])
    assert results_tables.generated(fake.read_text()) != fake.read_text()
    assert results_tables.generated(text) == text


def test_a_missing_record_is_one_line():
    with pytest.raises(SystemExit, match="results/nowhere.json, which is not there"):
        results_tables.generated("<!-- results: nowhere -->\n<!-- results end -->")


@pytest.mark.parametrize("name", [p.stem for p in RECORDS])
def test_a_record_names_no_path_of_the_machine_that_ran_it(name):
    text = (ROOT / "results" / f"{name}.json").read_text()
    assert not re.findall(r'"/(?:root|work|home|tmp)/[^"]*"', text), f"results/{name}.json keeps a local path"


def test_adding_a_report_makes_its_paths_portable():
    kept = results_tables.kept({"head": "/tmp/elsewhere/run/head", "rows": [1], "n": {"q": str(ROOT / "README.md")}})
    assert kept == {"head": "head", "n": {"q": "README.md"}}


def test_records_named_together_share_one_table_in_order():
    """a+b: one header, a's rows then b's, each command once; kinds that cannot share a table refused."""
    a, b = "llamacpp-dev", "llamacpp-dspark"
    joined = results_tables.block(f"{a}+{b}")
    rows = [line for line in joined.splitlines() if line.startswith("| ") and "draft, K=" in line]
    alone = [results_tables.block(n) for n in (a, b)]
    assert rows == [line for text in alone for line in text.splitlines() if "draft, K=" in line]
    assert joined.count("| run |") == 1 and "The recorded commands, one a record" in joined
    with pytest.raises(SystemExit, match="no table for records"):
        results_tables.block(f"{a}+replay-mt-bench")
