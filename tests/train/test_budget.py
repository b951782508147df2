"""A real target's run: refused when it could only make a useless head (built-in data, a recipe's
data not made yet, a sliver of an epoch), each in one line that says what to run first; the plan's
time per GPU count and its disk; a disk that fills during a checkpoint leaves the last complete one."""

import dataclasses
import errno
import re
import shutil

import pytest
from conftest import write_conversations
from test_plan import job, train_py
from test_run import tiny_job

from specheads.errors import SpecHeadsError, one_line_errors
from specheads.train import budget as budget_module
from specheads.train import checkpoint, run
from specheads.train.arch import read_arch
from specheads.train.budget import budget, check_epochs, check_real_target, dry_run, timings


def test_builtin_data_on_a_real_target_is_refused_with_what_to_run(capsys):
    with pytest.raises(SpecHeadsError) as refused:
        check_real_target(job("model=mistral-7b", "head=medusa"))
    line = str(refused.value)
    assert "\n" not in line and "7.2B parameters: data.path=builtin" in line
    assert "python distill.py model=mistral-7b" in line and "200,000 conversations" in line
    assert re.search(r"about [\d,]+ GPU-hours of h100", line) and "budget.allow_toy=true" in line
    # allowed: said on stderr, not refused
    check_real_target(job("model=mistral-7b", "head=medusa", "budget.allow_toy=true"))
    assert "running anyway: budget.allow_toy=true" in capsys.readouterr().err
    # small targets keep their built-in data
    check_real_target(job())
    check_real_target(job("model=tiny-random"))


def test_a_recipe_names_its_own_data_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe's data directories are relative: none here
    cfg = job("model=llama-3.1-8b", "head=eagle3")
    with pytest.raises(SpecHeadsError) as refused:
        check_real_target(cfg)
    line = str(refused.value)
    assert line.startswith(
        "the recipe's data runs/distill-llama-3.1-8b, runs/distill-llama-3.1-8b-ultrachat is not there"
    )
    assert all(command in line for command in cfg.budget.make_data) and "268,000 conversations" in line
    (tmp_path / "runs" / "distill-llama-3.1-8b").mkdir(parents=True)
    (tmp_path / "runs" / "distill-llama-3.1-8b-ultrachat").mkdir()
    check_real_target(cfg)  # made: nothing to say


def test_the_mission_command_refuses_in_one_line_before_loading(tmp_path):
    proc = train_py(tmp_path, "model=llama-70b", "head=eagle")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: the recipe's data runs/distill-llama-3.3-70b")
    assert "python distill.py model=llama-70b" in lines[0]
    assert not (tmp_path / "hf" / "hub").exists()  # nothing fetched


@pytest.mark.parametrize("epochs,refused", [(0.01, True), (0.49, True), (0.5, False), (2.0, False)])
def test_a_sliver_of_an_epoch_on_a_real_target_is_refused(epochs, refused):
    cfg = job("model=llama-3.1-8b", "head=eagle3")
    if refused:
        with pytest.raises(SpecHeadsError, match=r"trains on [\d.]+% of an epoch of the 200,000 training"):
            check_epochs(cfg, 8e9, epochs, 200_000)
    else:
        check_epochs(cfg, 8e9, epochs, 200_000)
    check_epochs(cfg, 1e8, epochs, 200_000)  # a small target: any budget


def test_train_py_refuses_a_sliver_once_the_rows_are_known(tmp_path):
    """The tiny target made 'real' by the threshold: 1 step of 2 rows over 18 is 11% of an epoch."""
    data = write_conversations(tmp_path / "chats.jsonl", n=24)
    cfg = tiny_job(data, tmp_path / "run", max_steps=1)
    cfg = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, real_target_parameters=0))
    with pytest.raises(SpecHeadsError, match=r"trains on 11\.1% of an epoch of the 18 training conversations"):
        run.train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "head").exists()


def test_the_plan_gives_time_per_gpu_count_from_the_budget(capsys):
    cfg = job("model=llama-3.1-8b", "head=eagle3", "plan.gpu_memory=80GB")
    text = dry_run(cfg)
    b = budget(cfg, 1)
    # the recipe's budget: 2 epochs of its conversations, each ~1,024 tokens
    assert b.train_tokens == 2 * 268_000 * 1024
    assert "budget  2 epochs of 268,000 conversations x ~1,024 tokens = 549M tokens" in text
    rows = timings(cfg, read_arch(cfg.model), 80 * 10**9, "h100")
    assert [t.gpus for t in rows] == [1, 2, 4, 8, 16] and all(t.mode == "replicated" for t in rows)
    for t in rows:  # wall time is the budget over the speed, the speed grows with the GPUs
        assert t.seconds == pytest.approx(b.train_tokens / t.tokens_per_s)
        assert t.tokens_per_s == pytest.approx(rows[0].tokens_per_s * t.gpus)
    eight = next(line for line in text.splitlines() if line.strip().startswith("8 "))
    assert "(a) whole" in eight and "2.0 h" in eight
    assert "an ESTIMATE" in text and "disk    this run writes no feature cache" in text


def test_the_70b_recipe_shards_and_the_plan_says_so():
    cfg = job("model=llama-70b", "head=eagle3", "plan.gpu_memory=80GB")
    rows = {t.gpus: t for t in timings(cfg, read_arch(cfg.model), 80 * 10**9, "h100")}
    assert rows[1].mode is None and rows[8].mode == "sharded"
    assert rows[8].memory < 72e9


def test_a_feature_cache_the_disk_cannot_hold_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10**9))
    cfg = job("model=llama-3.1-8b", "head=eagle3", "data.features=auto", "plan.gpu_memory=80GB")
    with pytest.raises(SpecHeadsError, match=r"the feature cache needs 8992\.6 GB .* has 1\.0 GB free"):
        dry_run(cfg)
    assert not (tmp_path / "cache").exists()
    assert budget_module.feature_directory(cfg) == tmp_path / "cache" / "features"


def test_a_disk_that_fills_during_a_checkpoint_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """The second checkpoint's write fails as a full disk does: one line, exit 2, and the first
    checkpoint is the newest complete one (the half-written step is gone), so the run resumes."""
    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    out = tmp_path / "run"
    cfg = tiny_job(data, out, max_steps=2, save_every=1)
    calls = {"n": 0}
    real = checkpoint.save_rng

    def fills(state, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(state, path)

    monkeypatch.setattr(checkpoint, "save_rng", fills)
    with pytest.raises(SystemExit) as exit_:
        one_line_errors(run.train)(cfg)
    err = capsys.readouterr().err
    errors = [line for line in re.split(r"[\r\n]", err) if line.startswith("error")]  # beside the progress bars
    assert exit_.value.code == 2 and "Traceback" not in err and len(errors) == 1
    assert errors[0].startswith("error: the disk is full writing ") and "which resumes" in errors[0]
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())  # DeepSpeed adds its scripts
    assert kept == ["step-1"], kept
    monkeypatch.setattr(checkpoint, "save_rng", real)
    run.train(cfg)  # resumes from step 1
    assert (out / "head" / "model.safetensors").is_file()


def test_the_recipe_table_of_the_your_model_page_is_the_plans():
    """docs/your-model.md's time on 8 H100 and offline disk per recipe are what dry_run=true gives
    now (a changed recipe or throughput model fails here until the page is written again)."""
    from test_plan import ROOT

    from specheads.train.plan import make_plan

    text = (ROOT / "docs" / "your-model.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `") and not line.startswith("| `model=`")]
    recipes = sorted(p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml") if not p.stem.startswith("smollm2"))
    assert len(rows) == len(recipes)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        model, head = cells[0].strip("`"), cells[1].strip("`")
        assert f"{model}_{head}" in recipes, row
        cfg = job(f"model={model}", f"head={head}", "plan.gpu_memory=80GB")
        arch = read_arch(cfg.model)
        eight = next(t for t in timings(cfg, arch, 80 * 10**9, "h100") if t.gpus == 8)
        assert cells[-2] == f"{eight.seconds / 3600:.1f} h ({eight.seconds * 8 / 3600:.0f} GPU-h)", row
        assert cells[-1] == f"{make_plan(cfg, arch, None, 1).disk / 1e12:.1f} TB", row
