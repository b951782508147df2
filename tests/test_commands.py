"""The commands as an installed package runs them: a wheel built from this source tree, installed
into a fresh virtualenv, composes its configs from a directory with no checkout in sight, and its
console scripts print what the checkout's scripts print."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("specheads-train", "specheads-distill", "specheads-infer", "specheads-export")


def run(cmd, cwd, env=None, timeout=120):
    proc = subprocess.run(list(map(str, cmd)), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def clean_env() -> dict:
    """No PYTHONPATH or Hydra switches of the caller: the installed package alone answers."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(virtualenv, wheel): the wheel of this tree, installed without its dependencies into a
    virtualenv that sees the test interpreter's site-packages through a .pth line (so nothing is
    downloaded), but not this checkout (an editable install's finder is not activated that way)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("conf", "specheads"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src], cwd=tmp, timeout=300)
    (wheel,) = dist.glob("specheads-*.whl")
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "specheads_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    install = [*pip, "--python", python, "install", "--no-deps", "--no-index", "--force-reinstall", wheel]
    run(install, cwd=tmp, timeout=300)
    return venv, wheel


def test_the_wheel_carries_every_config(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"specheads/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert len(configs) > 20 and configs <= names, sorted(configs - names)
    assert "specheads/data/dev_questions.jsonl" in names
    assert not any(n.startswith(("conf/", "tests/", "engines/")) for n in names)


def test_installed_package_and_configs_come_from_the_virtualenv(installed, tmp_path):
    venv, _ = installed
    code = "import specheads, specheads.config as c; print(specheads.__file__); print(c.installed_conf_dir())"
    package, conf = run([venv / "bin" / "python", "-c", code], cwd=tmp_path, env=clean_env()).split()
    assert Path(package).is_relative_to(venv) and Path(conf).is_relative_to(venv)
    assert (Path(conf) / "config.yaml").read_text() == (ROOT / "conf" / "config.yaml").read_text()
    for script in SCRIPTS:
        assert (venv / "bin" / script).is_file(), script


def test_console_script_composes_what_train_py_composes(installed, tmp_path):
    venv, _ = installed
    args = ["model=llama-70b", "head=eagle", "--cfg", "job"]
    ours = run([venv / "bin" / "specheads-train", *args], cwd=tmp_path, env=clean_env())
    checkout = run([sys.executable, "train.py", *args], cwd=ROOT, env=clean_env())
    assert ours == checkout
    assert "name: llama-3.3-70b" in ours and "family: eagle" in ours
    assert list(tmp_path.iterdir()) == []  # --cfg job writes nothing


@pytest.mark.parametrize(
    "script, args, expect",
    [
        ("specheads-distill", ["model=tiny-random"], "  path: tiny:llama"),
        ("specheads-infer", ["head=some/head", "prompt=a, b"], "prompt: a, b"),
        ("specheads-export", ["head=some/head", "format=eagle3", "out=x"], "head_path: some/head"),
    ],
)
def test_every_console_script_composes_its_config(installed, tmp_path, script, args, expect):
    venv, _ = installed
    out = run([venv / "bin" / script, *args, "--cfg", "job"], cwd=tmp_path, env=clean_env())
    assert expect in out.splitlines(), out


def test_a_bad_override_is_one_line_from_the_console_script(installed, tmp_path):
    venv, _ = installed
    proc = subprocess.run(
        [venv / "bin" / "specheads-train", "model=no-such-model"], cwd=tmp_path, env=clean_env(), capture_output=True
    )
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "model/no-such-model" in lines[0] and "llama-70b" in lines[0]
