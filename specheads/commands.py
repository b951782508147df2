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
    """Train a draft head on the frozen target: `python train.py` and `specheads-train`.

    Reads its overrides (`key=value`, the config groups) from sys.argv and composes them over
    conf/config.yaml; every key is in docs/configuration.md. Writes OUTPUT_DIR/head/ (config.json +
    model.safetensors), the checkpoints, metrics.jsonl and curves.png under `output_dir`, and prints
    the head's directory as the last line of stdout; the same command resumes a run.

    Args:
        conf_dir: the Hydra config directory; None = the configs installed with specheads.
    """
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
    """Self-distillation: the frozen target answers prompts (`python distill.py`, `specheads-distill`).

    Reads its overrides from sys.argv over conf/distill.yaml (keys: docs/configuration.md).
    Writes the conversations to `distill.output` in resumable shards with a manifest (and, with
    `distill.features.enabled=true`, the target's hidden states), and prints the output directory
    as the last line of stdout.

    Args:
        conf_dir: the Hydra config directory; None = the configs installed with specheads.
    """
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
    if settings.skip.layers is not None:
        from .bench.layer_skip import resolve_layer_skip

        kernels = session.layouts is not None
        session.skip = resolve_layer_skip(settings, session.target, kernels)
    if settings.bench.questions and settings.bench.mode == "replay":
        from .bench.replay import run_replay

        run_replay(settings, session)
    elif settings.bench.questions:
        from .bench.runner import run_benchmark

        run_benchmark(settings, session)
    else:
        run_demo(settings, session)


def infer(conf_dir: str | os.PathLike | None = None) -> None:
    """Speculative decoding with a trained head: `python infer.py` and `specheads-infer`.

    Reads its overrides from sys.argv over conf/infer.yaml (keys: docs/configuration.md);
    `head=DIR_OR_HUB_ID` is the head. With `prompt=...` it prints the answer with the drafted tokens
    marked and a stats line; with `bench.questions=FILE` it runs the benchmark and writes OUT.jsonl,
    OUT.summary.json and plots (`bench.mode=replay`: OUT.replay.json); with `tree=auto` it first
    calibrates the tree on this machine and keeps it (`tree.save`).

    Args:
        conf_dir: the Hydra config directory; None = the configs installed with specheads.
    """
    conf_dir = conf_dir_or_installed(conf_dir)
    register_configs()
    require_group(sys.argv, "model", conf_dir)
    main = hydra_command("infer", "infer", conf_dir, lambda cfg: run_infer(cfg, conf_dir))
    run_hydra_main(main, plain_values(sys.argv))


# -- export -----------------------------------------------------------------------------------------


def export(conf_dir: str | os.PathLike | None = None) -> None:
    """Export a head for a serving engine: `python -m specheads.export` and `specheads-export`.

    Reads its overrides from sys.argv over conf/export.yaml (`head=DIR format=NAME out=DIR`; keys:
    docs/configuration.md). Writes the head in that format to `out`, checked against each
    engine's loader, prints the output directory last, and with `push_to_hub=true` uploads it with
    a model card.

    Args:
        conf_dir: the Hydra config directory; None = the configs installed with specheads.
    """
    from .export.command import export as export_head

    export_head(conf_dir)
