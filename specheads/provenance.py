"""Where an artifact came from: the specheads version, the checkout's git commit, the command."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from . import __version__


def git_commit(package_dir: Path | None = None) -> str | None:
    """The commit of the git checkout that holds this package's own files ("+dirty" with local
    changes), or None when git does not track them: an installed wheel, even one installed into a
    virtualenv that lies inside some checkout. Git finds the checkout from the package's folder."""
    package = (package_dir or Path(__file__).parent).resolve()
    try:
        subprocess.run(
            ["git", "-C", str(package), "ls-files", "--error-unmatch", "__init__.py"],
            capture_output=True,
            timeout=10,
            check=True,
        )
        commit = subprocess.run(
            ["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(package), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


def provenance() -> dict[str, str | None]:
    command = portable_command([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else None
    return {"specheads_version": __version__, "commit": git_commit(), "command": command}


# Records (a head's config.json, a data set's manifest) travel to other machines: they name files
# by a path inside the repository that holds them, else by name and digest, never by a path that
# only means something on the machine that wrote them.
OUTSIDE = "PATH/TO"  # stands for a folder of the writing machine in a recorded command
# ":" before the slash: a URL (http://host:port/v1), which means the same on every machine
_ABSOLUTE = re.compile(r"(?<![\w.~$/:-])(?:~|/)[^\s'\",\[\]=]*")


def work_tree(path: Path) -> Path | None:
    """The git work tree holding `path` (the nearest parent with a .git), or None."""
    for parent in [path, *path.parents]:
        if (parent / ".git").exists():
            return parent
    return None


def portable_path(path: str | os.PathLike) -> str:
    """A local path as a record names it: relative to the git work tree holding it (data/x.jsonl),
    else its own name. Anything that is not a local path (a Hub id, "builtin") is kept as given."""
    text = str(path)
    local = Path(text).expanduser()
    if not local.is_absolute() and not local.exists():
        return text
    local = local.resolve()
    tree = work_tree(local if local.is_dir() else local.parent)
    return local.relative_to(tree).as_posix() if tree is not None and local != tree else local.name


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a directory's files (their relative names and contents, in order)."""
    root = Path(path).expanduser()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        if root.is_dir():
            h.update(f"{f.relative_to(root).as_posix()}\0".encode())
        with open(f, "rb") as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def data_record(sources: list[str]) -> dict[str, str]:
    """portable name -> sha256 for every source that is a local file or directory."""
    return {portable_path(s): file_digest(s) for s in sources if Path(str(s)).expanduser().exists()}


def portable_command(argv: list[str]) -> str:
    """The command line with every absolute or home path made portable: a path inside a git work
    tree by its path there, another by PATH/TO/<its name>."""

    def one(match: re.Match) -> str:
        text = match.group(0)
        local = Path(text).expanduser()
        parent = next((p for p in [local, *local.parents] if p.exists()), None)
        tree = work_tree(parent.resolve()) if parent is not None else None
        if tree is not None and local.resolve() != tree:
            return local.resolve().relative_to(tree).as_posix()
        return f"{OUTSIDE}/{local.name}" if local.name else OUTSIDE

    return shlex.join([_ABSOLUTE.sub(one, arg) for arg in argv])
