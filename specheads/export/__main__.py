"""Export a trained head for a serving engine (config: conf/export.yaml).

    python -m specheads.export head=runs/x/head format=eagle3 out=export/eagle3
    python -m specheads.export head=org/head format=vllm-medusa push_to_hub=true repo_id=org/head-vllm

Prints each engine's verdict, then the output directory (or the upload URL) as the last line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specheads.cli import job, run_hydra_main
from specheads.config import register_configs, typed
from specheads.errors import one_line_errors

register_configs()
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def head_alias(argv: list[str]) -> list[str]:
    """`head=X` -> `head_path=X`: `head` is a config group of train.py in the same conf/ tree, so
    Hydra would read `head=X` as a group choice."""
    return [("head_path=" + a[len("head=") :]) if a.startswith("head=") else a for a in argv]


@hydra.main(config_path=CONF_DIR, config_name="export", version_base=None)
@job
@one_line_errors
def main(cfg: DictConfig) -> None:
    from specheads.export.job import run_export

    run_export(typed(cfg))


if __name__ == "__main__":
    run_hydra_main(main, head_alias(sys.argv))
