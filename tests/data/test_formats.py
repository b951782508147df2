import json

import pytest
from conftest import conversations, write_jsonl

from specheads.data.formats import load_conversations
from specheads.errors import SpecHeadsError


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"messages": [{"role": "user", "content": "x"}', "invalid JSON"),
        ('{"text": "no conversation"}', "no 'messages'"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown speaker"),
        ('{"messages": [{"role": "user", "content": 3}]}', "must be a string"),
        ('{"messages": []}', "non-empty list"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_malformed_rows_raise_naming_the_row(tmp_path, content, message):
    file = tmp_path / "bad.jsonl"
    file.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n' + content + "\n")
    with pytest.raises(SpecHeadsError, match=message) as err:
        load_conversations(str(file))
    assert "bad.jsonl:2" in str(err.value)


def test_missing_file_and_bad_format_raise(tmp_path):
    with pytest.raises(SpecHeadsError, match="does not exist"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    with pytest.raises(SpecHeadsError, match="unknown data format"):
        load_conversations(str(tmp_path / "nope.jsonl"), format="alpaca")
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(SpecHeadsError, match="invalid JSON"):
        load_conversations(str(bad))


def test_json_parquet_and_saved_dataset_dir(tmp_path):
    import datasets

    rows = conversations(5)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    expect = load_conversations(str(write_jsonl(tmp_path / "a.jsonl", rows)))
    assert load_conversations(str(tmp_path / "a.json")) == expect
    assert load_conversations(str(tmp_path / "a.parquet")) == expect
    assert load_conversations(str(tmp_path / "saved")) == expect
    with pytest.raises(SpecHeadsError, match="no split"):
        load_conversations(str(tmp_path / "saved"), split="test")


def test_hub_loader_reads_a_local_dataset_directory(tmp_path):
    from specheads.data.formats import _hub_rows

    write_jsonl(tmp_path / "train.jsonl", conversations(3))
    rows = [r for _, r in _hub_rows(str(tmp_path), "train")]
    assert [r["messages"][0]["content"] for r in rows] == [f"question number {i}" for i in range(3)]
    with pytest.raises(SpecHeadsError, match="cannot load data set"):
        list(_hub_rows(str(tmp_path / "missing-dir"), "train"))


def test_gzipped_jsonl_and_json_read_like_plain_files(tmp_path):
    import gzip

    rows = conversations(4)
    plain = load_conversations(str(write_jsonl(tmp_path / "a.jsonl", rows)))
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "b.json.gz", "wt", encoding="utf-8") as f:
        json.dump(rows, f)
    assert load_conversations(str(tmp_path / "a.jsonl.gz")) == plain
    assert load_conversations(str(tmp_path / "b.json.gz")) == plain
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "a.jsonl.gz").rename(folder / "a.jsonl.gz")
    assert load_conversations(str(folder)) == plain  # a folder of .gz files


def test_corrupt_or_missing_gzip_is_one_clear_error(tmp_path):
    import gzip

    good = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in conversations(50)))
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "junk.jsonl.gz").write_bytes(b"not gzip at all")
    for name in ("cut.jsonl.gz", "junk.jsonl.gz"):
        with pytest.raises(SpecHeadsError, match="cannot read"):
            load_conversations(str(tmp_path / name))
    with pytest.raises(SpecHeadsError, match="does not exist"):
        load_conversations(str(tmp_path / "missing.jsonl.gz"))
