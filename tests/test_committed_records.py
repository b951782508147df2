"""No committed head, manifest or record names a file by a path of the machine that wrote it: the JSON
under heads/ and data/ names files by a path inside the repository, or by name and digest."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDS = sorted(p for folder in ("heads", "data") for p in (ROOT / folder).rglob("*.json"))
# an absolute POSIX path, a home path or a Windows drive path, where a value or a word starts
MACHINE_PATH = re.compile(r"(?:^|[\s'\"=\[,(])(?:/[\w.-]|~/|[A-Za-z]:\\)")


def machine_paths(value, where="$") -> list[str]:
    """JSON paths of the strings in `value` that hold a machine's path."""
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in machine_paths(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in machine_paths(v, f"{where}[{i}]")]
    return [f"{where}: {value[:120]}"] if isinstance(value, str) and MACHINE_PATH.search(value) else []


def test_the_scan_finds_machine_paths_and_passes_portable_ones():
    bad = {"data": "/work/shared/train.jsonl.gz", "mix": ["data/x"], "cmd": "train.py 'data.mix=[/root/d]'"}
    assert machine_paths(bad) == ["$.data: /work/shared/train.jsonl.gz", "$.cmd: train.py 'data.mix=[/root/d]'"]
    assert machine_paths({"home": ["~/runs/x"], "win": "C:\\data"}) == ["$.home[0]: ~/runs/x", "$.win: C:\\data"]
    fine = {"data": "data/smollm2_selfdistill_23k.jsonl.gz", "mapping": "d2t offsets (target_id = draft_id + d2t)"}
    assert machine_paths({**fine, "cmd": "train.py output_dir=PATH/TO/run a/b"}) == []


def test_there_are_records_to_scan():
    assert ROOT / "heads" / "smollm2-135m-eagle3" / "config.json" in RECORDS


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_record_holds_no_machine_path(path):
    assert machine_paths(json.loads(path.read_text())) == []
