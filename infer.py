"""Speculative decoding with a trained draft head: a demo answer, or the benchmark (conf/infer.yaml).

    python infer.py head=runs/demo/head prompt="Why is the sky blue?"
    python infer.py head=DIR bench.questions=question.jsonl bench.output=OUT.jsonl bench.max_new_tokens=64
    python infer.py head=DIR tree=auto        # calibrate the tree for this machine, store it in DIR

The demo prints the answer with the drafted-and-accepted tokens marked and a stats line (tau,
tokens/s, speedup); the benchmark writes OUT.jsonl, OUT.summary.json and plots (docs/contracts.md).
"""

import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specheads.cli import job, run_hydra_main
from specheads.config import register_configs, typed
from specheads.errors import one_line_errors

register_configs()
CONF_DIR = Path(__file__).resolve().parent / "conf"


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


@hydra.main(config_path="conf", config_name="infer", version_base=None)
@job
@one_line_errors
def main(cfg: DictConfig) -> None:
    from specheads.config.infer import validate

    settings = validate(typed(cfg))  # before torch is imported: bad input fails at once
    from specheads.bench.demo import run_demo
    from specheads.bench.session import load_session

    session = load_session(settings, CONF_DIR)
    if settings.tree.kind == "auto":
        from specheads.bench.calibrate import calibrate_tree

        settings.tree = calibrate_tree(settings, session)
    if settings.bench.questions:
        from specheads.bench.runner import run_benchmark

        run_benchmark(settings, session)
    else:
        run_demo(settings, session)


if __name__ == "__main__":
    run_hydra_main(main, plain_values(sys.argv))
