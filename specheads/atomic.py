"""Atomic writes: a reader (or a crash) sees the old file or directory or the new one, never half.

Files and directories are written under a temporary name beside their destination and renamed
into place. They get the permissions an ordinary write would give (0666 / 0777 less the umask):
mkstemp and mkdtemp create private 0600 / 0700 entries, which would leave head directories and
exports unreadable to the rest of a team.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary file path beside `path`; renamed onto `path` when the block ends normally."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str, fsync: bool = False) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = False) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return Path(path)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2) + "\n")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> Path:
    return write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """matplotlib figure -> PNG, atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", **savefig_kwargs)
    finally:
        plt.close(fig)
    return Path(path)


def write_directory(
    out: str | os.PathLike, fill: Callable[[Path], None], check: Callable[[Path], None] | None = None
) -> Path:
    """Build a directory with `fill(tmp)` (then `check(tmp)`), and put it in place of `out`.

    An existing `out` is replaced whole; a failure anywhere leaves `out` as it was and no
    temporary directory behind.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        fill(tmp)
        if check is not None:
            check(tmp)
        umask = _umask()
        tmp.chmod(0o777 & ~umask)
        for path in tmp.rglob("*"):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
