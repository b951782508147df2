"""Where an artifact came from: the specheads version, the checkout's git commit, the command."""

from __future__ import annotations

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
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else None
    return {"specheads_version": __version__, "commit": git_commit(), "command": command}
