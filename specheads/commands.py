"""The commands: train, distill, infer and export, one function each over a Hydra config directory.

The console scripts of an installed specheads (`specheads-train`, `specheads-distill`,
`specheads-infer`, `specheads-export`) call them with the configs installed in the package
(`specheads.conf`); `train.py`, `distill.py` and `infer.py` of a checkout call the same functions
with the checkout's conf/, so both compose the same configs and run the same jobs.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig

from .cli import check_output_path, hydra_command, require_group, run_hydra_main
from .config import installed_conf_dir, register_configs, typed
from .errors import one_line_errors


@one_line_errors
def conf_dir_or_installed(conf_dir: str | os.PathLike | None) -> Path:
    return Path(conf_dir) if conf_dir is not None else installed_conf_dir()


# -- train ------------------------------------------------------------------------------------------


def run_train(cfg: DictConfig) -> None:
    settings = typed(cfg)
    check_output_path(settings.output_dir, "output_dir")
    from .train.run import train as train_head

    head_dir = train_head(settings)
    if head_dir is not None:  # rank 0
        print(head_dir, flush=True)


def train(conf_dir: str | os.PathLike | None = None) -> None:
    """Train a draft head (conf/config.yaml); prints the head's directory as the last line."""
    conf_dir = conf_dir_or_installed(conf_dir)
    register_configs()
    main = hydra_command("train", "config", conf_dir, run_train)
    run_hydra_main(main, run_dir_key="output_dir")  # hydra.run.dir is ${output_dir}


# -- distill ----------------------------------------------------------------------------------------


def run_distill(cfg: DictConfig) -> None:
    settings = typed(cfg)
    check_output_path(settings.distill.output, "distill.output")
    if settings.distill.features.output:
        check_output_path(settings.distill.features.output, "distill.features.output")
    from .distill.run import distill as distill_data

    out = distill_data(settings)
    if out is not None:  # rank 0 of a launched group, or the only process
        print(out, flush=True)


def distill(conf_dir: str | os.PathLike | None = None) -> None:
    """Self-distillation (conf/distill.yaml); prints the output directory as the last line."""
    conf_dir = conf_dir_or_installed(conf_dir)
    register_configs()
    run_hydra_main(hydra_command("distill", "distill", conf_dir, run_distill))


# -- infer ------------------------------------------------------------------------------------------

FREE_TEXT = ("prompt", "system", "head_path")


def quoted(value: str) -> str:
    """A Hydra-quoted string, so that free text (commas, brackets, quotes, ${...}) stays literal."""
    value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)  # backslashes before a quote
    return "'" + value.replace("'", "\\'").replace("${", "\\${") + "'"


def plain_values(argv: list[str]) -> list[str]:
    """`head` is a config group of train.py (conf/head/); for infer.py head=PATH is a value
    (head_path of the schema). Prompts are free text, not Hydra override syntax."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = "head_path" if key == "head" else key
        out.append(f"{key}={quoted(value)}" if sep and key in FREE_TEXT else arg)
    return out


def run_infer(cfg: DictConfig, conf_dir: Path) -> None:
    from .config.infer import validate

    settings = validate(typed(cfg))  # before torch is imported: bad input fails at once
    if settings.bench.questions:
        check_output_path(settings.bench.output, "bench.output", directory=False)
    from .bench.demo import run_demo
    from .bench.session import load_session

    session = load_session(settings, conf_dir)
    if settings.tree.kind == "auto":
        from .bench.calibrate import calibrate_tree

        settings.tree = calibrate_tree(settings, session)
    if settings.bench.questions and settings.bench.mode == "replay":
        from .bench.replay import run_replay

        run_replay(settings, session)
    elif settings.bench.questions:
        from .bench.runner import run_benchmark

        run_benchmark(settings, session)
    else:
        run_demo(settings, session)


def infer(conf_dir: str | os.PathLike | None = None) -> None:
    """Speculative decoding with a trained head: a demo answer or the benchmark (conf/infer.yaml)."""
    conf_dir = conf_dir_or_installed(conf_dir)
    register_configs()
    require_group(sys.argv, "model", conf_dir)
    main = hydra_command("infer", "infer", conf_dir, lambda cfg: run_infer(cfg, conf_dir))
    run_hydra_main(main, plain_values(sys.argv))


# -- export -----------------------------------------------------------------------------------------


def export(conf_dir: str | os.PathLike | None = None) -> None:
    """Export a head for a serving engine (conf/export.yaml); `python -m specheads.export` too."""
    from .export.command import export as export_head

    export_head(conf_dir)
