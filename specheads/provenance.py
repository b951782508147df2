"""Where an artifact came from: the specheads version, the checkout's git commit, the command."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from . import __version__


def git_commit() -> str | None:
    """The commit of the checkout specheads runs from ("+dirty" with local changes), or None
    when it is not a git checkout (an installed wheel)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


def provenance() -> dict[str, str | None]:
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else None
    return {"specheads_version": __version__, "commit": git_commit(), "command": command}
