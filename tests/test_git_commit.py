"""provenance.git_commit: the commit of the checkout that tracks the package's own files, or None."""

import subprocess
from pathlib import Path

import pytest

import specheads
from specheads.provenance import git_commit


def git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(cwd), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_is_the_one_of_the_checkout_holding_the_package():
    package = Path(specheads.__file__).parent
    head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("specheads does not run from a git checkout here")
    assert git_commit().partition("+")[0] == head.stdout.strip()


def test_an_untracked_copy_inside_a_checkout_has_no_commit(tmp_path):
    """An installed specheads in a virtualenv inside some checkout must not claim that checkout's
    commit: git does not track its files."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "README").write_text("x\n")
    git(repo, "add", "README")
    git(repo, "commit", "-q", "-m", "first")
    installed = repo / ".venv" / "lib" / "site-packages" / "specheads"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    assert git_commit(installed) is None
    git(repo, "add", "-f", ".venv")
    git(repo, "commit", "-q", "-m", "tracked now")
    assert git_commit(installed) == git(repo, "rev-parse", "HEAD")
    (installed / "__init__.py").write_text("changed = True\n")
    assert git_commit(installed) == git(repo, "rev-parse", "HEAD") + "+dirty"
    assert git_commit(tmp_path / "nowhere") is None
