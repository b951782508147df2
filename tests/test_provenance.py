"""specheads/provenance.py: records name files portably (a path inside their repository, else a
name with a digest) and a recorded command carries no path of the machine that ran it."""

import hashlib
import re
import shlex

from specheads.provenance import OUTSIDE, data_record, file_digest, portable_command, portable_path

ABSOLUTE = re.compile(r"(?:^|[\s'\"=\[,(])(?:/|~/)")


def repo(tmp_path):
    root = tmp_path / "checkout"
    (root / ".git").mkdir(parents=True)
    (root / "data" / "set").mkdir(parents=True)
    (root / "data" / "rows.jsonl").write_text('{"a": 1}\n')
    (root / "data" / "set" / "shard.jsonl").write_text('{"b": 2}\n')
    outside = tmp_path / "elsewhere" / "mine.jsonl"
    outside.parent.mkdir()
    outside.write_text('{"c": 3}\n')
    return root, outside


def test_portable_path_is_relative_to_its_repository_or_a_bare_name(tmp_path, monkeypatch):
    root, outside = repo(tmp_path)
    assert portable_path(root / "data" / "rows.jsonl") == "data/rows.jsonl"
    assert portable_path(str(root / "data" / "set") + "/") == "data/set"
    monkeypatch.chdir(root)
    assert portable_path("data/rows.jsonl") == "data/rows.jsonl"  # relative input, same answer
    assert portable_path(outside) == "mine.jsonl"
    assert portable_path("org/some-dataset") == "org/some-dataset"  # a Hub id is a name already
    assert portable_path("builtin") == "builtin"


def test_data_record_digests_files_and_directories(tmp_path):
    root, outside = repo(tmp_path)
    record = data_record([str(root / "data" / "rows.jsonl"), str(root / "data" / "set"), str(outside), "org/x"])
    assert set(record) == {"data/rows.jsonl", "data/set", "mine.jsonl"}
    assert record["mine.jsonl"] == hashlib.sha256(outside.read_bytes()).hexdigest()
    before = file_digest(root / "data" / "set")
    (root / "data" / "set" / "shard.jsonl").write_text('{"b": 3}\n')
    assert file_digest(root / "data" / "set") != before


def test_a_recorded_command_holds_no_machine_path(tmp_path):
    root, outside = repo(tmp_path)
    argv = [
        "train.py",
        f"output_dir={tmp_path}/runs/x",
        f"data.path={root}/data/rows.jsonl",
        f"data.mix=[{root}/data/set,{outside}]",
        f"data.decontaminate=[{tmp_path}/eval/*.jsonl]",
        "model.path=~/models/target.gguf",
        "prompt=a/b and c",
        "train.max_steps=7",
        "distill.server.url=http://127.0.0.1:8771/v1",
    ]
    command = portable_command(argv)
    assert not ABSOLUTE.search(command), command
    words = shlex.split(command)
    assert words[1] == f"output_dir={OUTSIDE}/x"
    assert words[2] == "data.path=data/rows.jsonl"
    assert words[3] == f"data.mix=[data/set,{OUTSIDE}/mine.jsonl]"
    assert words[4] == f"data.decontaminate=[{OUTSIDE}/*.jsonl]"
    assert words[5] == f"model.path={OUTSIDE}/target.gguf"
    assert words[6:] == ["prompt=a/b and c", "train.max_steps=7", "distill.server.url=http://127.0.0.1:8771/v1"]
