"""The export command: `python -m specheads.export` and `specheads-export` (conf/export.yaml)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from ..cli import check_output_path, hydra_command, require_group, run_hydra_main
from ..config import installed_conf_dir, register_configs, typed
from ..errors import one_line_errors


def head_alias(argv: list[str]) -> list[str]:
    """`head=X` -> `head_path=X`: `head` is a config group of train.py in the same conf/ tree, so
    Hydra would read `head=X` as a group choice."""
    return [("head_path=" + a[len("head=") :]) if a.startswith("head=") else a for a in argv]


def run_export_job(cfg: DictConfig, conf_dir: Path) -> None:
    settings = typed(cfg)
    from .exporter import FORMATS

    if settings.out:
        check_output_path(
            settings.out, "out", directory=not getattr(FORMATS.get(settings.format), "SINGLE_FILE", False)
        )
    from .job import run_export

    run_export(settings, conf_dir)


@one_line_errors
def _conf_dir(conf_dir: str | os.PathLike | None) -> Path:
    return Path(conf_dir) if conf_dir is not None else installed_conf_dir()


def export(conf_dir: str | os.PathLike | None = None) -> None:
    """Export a trained head; `conf_dir` defaults to the configs installed with specheads."""
    conf_dir = _conf_dir(conf_dir)
    register_configs()
    require_group(sys.argv, "model", conf_dir)
    main = hydra_command("export", "export", conf_dir, lambda cfg: run_export_job(cfg, conf_dir))
    run_hydra_main(main, head_alias(sys.argv))
