import os
import stat

import pytest

from specheads import atomic


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_directory_gets_ordinary_permissions_and_replaces_the_old_one(tmp_path, umask_022):
    out = tmp_path / "head"
    atomic.write_directory(out, lambda d: (d / "old.txt").write_text("old"))
    atomic.write_directory(out, lambda d: (d / "config.json").write_text("{}"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # replaced whole
    assert mode(out) == 0o755 and mode(out / "config.json") == 0o644  # not mkdtemp's private 0700
    assert [p.name for p in tmp_path.iterdir()] == ["head"]  # no temporary left beside it


def test_a_failed_write_leaves_the_old_directory_and_nothing_else(tmp_path):
    out = tmp_path / "head"
    atomic.write_directory(out, lambda d: (d / "a").write_text("1"))

    def bad_check(d):
        raise ValueError("refused")

    with pytest.raises(ValueError):
        atomic.write_directory(out, lambda d: (d / "b").write_text("2"), check=bad_check)
    assert [p.name for p in out.iterdir()] == ["a"] and [p.name for p in tmp_path.iterdir()] == ["head"]


def test_files_are_written_whole_or_not_at_all(tmp_path, umask_022):
    path = atomic.write_json(tmp_path / "s.json", {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n' and mode(path) == 0o644
    with pytest.raises(RuntimeError), atomic.atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert path.read_text() == '{\n  "a": 1\n}\n' and [p.name for p in tmp_path.iterdir()] == ["s.json"]
