"""Every YAML under conf/ composes against the structured schema; bad keys and types fail early."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from specheads.config import register_configs, typed
from specheads.config.export import ExportJobConfig
from specheads.config.infer import InferJobConfig
from specheads.config.train import TrainJobConfig
from specheads.errors import SpecHeadsError

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
PRIMARIES = sorted(p.stem for p in CONF.glob("*.yaml"))


def group_options() -> list[tuple[str, str]]:
    """(group, option) for every YAML in a subfolder of conf/, at any depth."""
    return sorted((str(p.parent.relative_to(CONF)), p.stem) for p in CONF.rglob("*.yaml") if p.parent != CONF)


def entry_points() -> dict[str, Path]:
    """primary config name -> the @hydra.main script that uses it (train.py, infer.py, ...)."""
    found = {}
    for path in [*ROOT.glob("*.py"), *(ROOT / "specheads").rglob("__main__.py")]:
        match = re.search(r'config_name\s*=\s*"([^"]+)"', path.read_text())
        if match:
            found[match.group(1)] = path
    return found


def register_all() -> None:
    """Import every entry point once: each registers the structured schemas its primary needs."""
    register_configs()
    for name, path in sorted(entry_points().items()):
        module_name = f"_entry_{name}"
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)


@pytest.fixture
def hydra_conf():
    register_all()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield
    GlobalHydra.instance().clear()


_CHOICES: dict[str, set] = {}


def primaries_using(group: str) -> list[str]:
    """Primary configs whose defaults list has `group` (composed once per primary)."""
    for primary in PRIMARIES:
        if primary not in _CHOICES:
            _CHOICES[primary] = set(compose(primary, return_hydra_config=True).hydra.runtime.choices)
    return [p for p in PRIMARIES if group in _CHOICES[p]]


def test_train_config_has_the_contract_groups(hydra_conf):
    cfg = compose("config", return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    assert (choices["model"], choices["head"], choices["deepspeed"]) == ("smollm2-135m", "eagle3", "zero2")
    assert cfg.model.path == "embedded:smollm2"
    for name in ("medusa", "eagle", "eagle3"):
        assert compose("config", [f"head={name}"]).head.family == name
    tiny = compose("config", ["model=tiny-random", "train.max_steps=3", "output_dir=/tmp/x", "seed=5"])
    assert (tiny.model.path, tiny.train.max_steps, tiny.output_dir, tiny.seed) == ("tiny:llama", 3, "/tmp/x", 5)


@pytest.mark.parametrize("primary", PRIMARIES)
def test_every_primary_composes(hydra_conf, primary):
    cfg = compose(primary)
    OmegaConf.to_container(cfg, resolve=True)  # interpolations resolve too


@pytest.mark.parametrize("group,option", group_options())
def test_every_group_option_composes(hydra_conf, group, option):
    users = primaries_using(group)
    assert users, f"no primary config in conf/ uses the group {group!r}"
    for primary in users:
        cfg = compose(primary, [f"{group}={option}"])
        OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("group,option", group_options())
def test_group_files_extend_their_schema(group, option):
    """Each group file names its <group>_schema first, so it is validated on its own too."""
    register_all()
    from hydra.core.config_store import ConfigStore

    try:
        registered = ConfigStore.instance().list(group)
    except OSError:
        registered = []
    if (CONF / group / f"{option}.yaml").read_text().startswith("# @package _global_"):
        return  # a recipe writes into the primary's own typed nodes: checked when composed
    assert f"{group}_schema.yaml" in registered, f"no {group}_schema registered"
    raw = OmegaConf.load(CONF / group / f"{option}.yaml")
    assert f"{group}_schema" in list(raw.get("defaults", [])), f"conf/{group}/{option}.yaml"


@pytest.mark.parametrize(
    "override,words",
    [
        ("train.max_stepz=3", ["max_stepz"]),
        ("train.max_steps=many", ["many", "train.max_steps"]),
        ("head.ttt_steps=1.5", ["1.5", "head.ttt_steps"]),
        ("model.nope=1", ["nope"]),
    ],
)
def test_unknown_key_or_wrong_type_fails_at_compose(hydra_conf, override, words):
    with pytest.raises(ConfigCompositionException) as info:
        compose("config", [override])
    text = f"{info.value} {info.value.__cause__}"
    assert all(w in text for w in words)


def test_group_file_with_unknown_key_fails(tmp_path):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model" / "typo.yaml").write_text("defaults:\n  - model_schema\n  - _self_\n\npathh: tiny:llama\n")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        with pytest.raises(ConfigCompositionException):
            compose("config", ["model=typo"])
    GlobalHydra.instance().clear()


def run_train(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "override,words",
    [
        ("train.max_stepz=3", ["max_stepz", "TrainConfig"]),
        ("train.max_steps=many", ["many", "train.max_steps"]),
        ("model=no-such-model", ["model/no-such-model", "tiny-random"]),
    ],
)
def test_cli_config_error_is_one_line(override, words):
    proc = run_train(override, "--cfg", "job")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in proc.stderr


def test_cfg_job_prints_the_composed_config_without_loading_weights():
    proc = run_train("model=llama-70b", "head=eagle", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.model.path == "meta-llama/Llama-3.3-70B-Instruct"
    assert cfg.head.family == "eagle"
    # its recipe (conf/recipe/llama-70b_eagle.yaml): the target's own data, EAGLE-1's lr, ZeRO-3
    assert (cfg.data.path, cfg.train.lr, cfg.deepspeed.zero_stage) == ("runs/distill-llama-3.3-70b", 3e-5, 3)


def test_recipe_applies_to_its_pair_only(hydra_conf):
    """conf/recipe/<model>_<head>.yaml tunes the embedded default; other pairs keep the group
    defaults, and the command line still overrides a recipe."""
    default = compose("config")
    assert (default.head.ttt_steps, default.data.features, default.train.max_steps) == (3, "auto", 80)
    other = compose("config", ["head=eagle"])
    assert other.data.features is None and other.train.max_steps == 60
    assert compose("config", ["head.ttt_steps=7"]).head.ttt_steps == 7


@pytest.mark.parametrize(
    "primary,override,words",
    [
        ("infer", "bench.foo=1", ["foo"]),
        ("infer", "tree.bar=2", ["bar"]),
        ("infer", "max_new_tokens=many", ["many", "max_new_tokens"]),
        ("infer", "tree=auto", []),  # a group option is still fine
        ("export", "bench.sumary=x", ["sumary"]),
        ("export", "push_to_hub=maybe", ["maybe", "push_to_hub"]),
        ("distill", "distill.magpie.top_q=1", ["top_q"]),
    ],
)
def test_every_primary_is_strict(hydra_conf, primary, override, words):
    """infer.yaml, export.yaml and distill.yaml compose against their schemas too."""
    if not words:
        compose(primary, [override])
        return
    with pytest.raises(ConfigCompositionException) as info:
        compose(primary, [override])
    text = f"{info.value} {info.value.__cause__}"
    assert all(w in text for w in words)


def test_typed_gives_the_schema_objects(hydra_conf):
    train = typed(compose("config", ["model=tiny-random", "head=medusa", "train.lr=1"]))
    assert isinstance(train, TrainJobConfig) and train.output_dir == "runs/tiny-random-medusa"
    assert train.train.lr == 1.0 and isinstance(train.train.lr, float) and isinstance(train.model.tiny, dict)
    infer = typed(compose("infer", ["head_path=/tmp", "prompt=hi", "tree=dynamic"]))
    assert isinstance(infer, InferJobConfig) and infer.tree.kind == "dynamic" and infer.model is None
    export = typed(compose("export", ["head_path=/tmp", "format=eagle3", "out=x", "model=tiny-random"]))
    assert isinstance(export, ExportJobConfig) and export.model.path == "tiny:llama"
    with pytest.raises(SpecHeadsError, match="format"):  # mandatory (???) and left unset
        typed(compose("export", ["head_path=/tmp"]))


@pytest.mark.parametrize(
    "primary, overrides, unknown",
    [
        ("config", ["model=tiny-random", "+head.foo=1"], "head.foo"),
        ("config", ["model=tiny-random", "+zzz=2"], "zzz"),
        ("infer", ["head_path=/tmp", "+bench.zz=1"], "bench.zz"),
    ],
)
def test_typed_refuses_keys_added_with_plus(hydra_conf, primary, overrides, unknown):
    cfg = compose(primary, overrides)  # `+key=value` gets past Hydra's struct check
    with pytest.raises(SpecHeadsError, match=f"unknown config key {unknown}"):
        typed(cfg)


def test_typed_lets_free_form_dicts_take_any_key(hydra_conf):
    cfg = compose("config", ["model=tiny-random", "+deepspeed.extra.wall_clock_breakdown=true"])
    assert typed(cfg).deepspeed.extra == {"wall_clock_breakdown": True}


@pytest.mark.parametrize(
    "command",
    [
        ["infer.py", "head=/tmp", "prompt=hi", "bench.foo=1"],
        ["infer.py", "head=/tmp", "prompt=hi", "tree.bar=2"],
        ["-m", "specheads.export", "head=/tmp", "format=eagle3", "out=x", "bench.sumary=x"],
        ["-m", "specheads.export", "head=/tmp", "out=x"],  # format=??? is never set
    ],
)
def test_cli_unknown_key_is_one_line_for_every_entry_point(command, tmp_path):
    key = {"bench.foo=1": "foo", "tree.bar=2": "bar", "bench.sumary=x": "sumary", "out=x": "format"}[command[-1]]
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], proc.stderr
    assert not (ROOT / "x").exists()


def test_an_output_path_no_write_could_succeed_at_is_refused(tmp_path):
    from specheads.cli import check_output_path

    taken = tmp_path / "taken"
    taken.write_text("keep")
    assert check_output_path(tmp_path / "new" / "dir", "output_dir") == tmp_path / "new" / "dir"
    assert check_output_path(tmp_path, "output_dir") == tmp_path  # an existing directory is resumed into
    assert check_output_path(taken, "bench.output", directory=False) == taken  # an existing file is replaced
    with pytest.raises(SpecHeadsError, match=r"^output_dir=.*taken is a file; give a directory"):
        check_output_path(taken, "output_dir")
    with pytest.raises(SpecHeadsError, match=r"^out=.*taken/a/b lies under .*taken, which is a file"):
        check_output_path(taken / "a" / "b", "out")
    with pytest.raises(SpecHeadsError, match=r"^bench.output=.* is a directory; give a file path"):
        check_output_path(tmp_path, "bench.output", directory=False)


def one_line_refusal(command: list[str], *words: str) -> None:
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]
    assert proc.stdout.strip() == ""  # refused before any work: no progress, no target loaded


@pytest.mark.parametrize(
    "command, words",
    [
        (["train.py", "model=tiny-random", "train.max_steps=1", "output_dir={taken}"], ["output_dir=", "is a file"]),
        (["train.py", "model=tiny-random", "output_dir={taken}/run"], ["output_dir=", "lies under"]),
        (["distill.py", "model=tiny-random", "distill.num_prompts=2", "distill.output={taken}"], ["distill.output="]),
        (["distill.py", "model=tiny-random", "distill.features.output={taken}"], ["distill.features.output="]),
        (
            [
                "infer.py",
                "head={tmp}",
                "bench.questions=specheads/data/dev_questions.jsonl",
                "bench.output={taken}/o.jsonl",
            ],
            ["bench.output=", "lies under"],
        ),
        (["-m", "specheads.export", "head={tmp}", "format=eagle3", "out={taken}"], ["out=", "is a file"]),
    ],
)
def test_every_entry_point_refuses_an_output_at_a_file_in_one_line(command, words, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("keep")
    one_line_refusal([a.format(taken=taken, tmp=tmp_path) for a in command], *words)
    assert taken.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize(
    "command",
    [
        ["infer.py", "head=/tmp", "model.path=/some/target", "prompt=hi"],
        ["-m", "specheads.export", "head=/tmp", "format=eagle3", "out=x", "model.path=/some/target"],
    ],
)
def test_a_model_field_without_model_says_what_to_add(command):
    """These entry points take the target from the head unless model=NAME is given."""
    one_line_refusal(command, "model.path=/some/target needs model=NAME before it", "smollm2-135m")
    assert not (ROOT / "x").exists()
