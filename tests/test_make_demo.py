"""`make demo` measures every head on questions its tree was not calibrated on: the fresh head's
calibration prompts and the shipped head's recorded ones are disjoint from the benchmark's."""

import json
import re
import shlex
from pathlib import Path

import pytest

from specheads.bench.calibrate import calibration_texts
from specheads.bench.questions import read_questions
from specheads.bench.trees import overlap, prompts_record
from specheads.config.infer import InferJobConfig, TreeConfig

ROOT = Path(__file__).resolve().parent.parent


def demo_infer_args() -> dict[str, str]:
    """key=value arguments of the infer.py command in the Makefile's demo recipe, variables expanded."""
    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+)\s*[:?]?=\s*(.*?)\s*$", text, flags=re.M))
    recipe = re.search(r"^demo:.*?\n((?:\t.*\n?)+)", text, flags=re.M).group(1)
    command = next(line for line in recipe.replace("\\\n", " ").splitlines() if "infer.py" in line)
    command = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), command)
    return dict(word.split("=", 1) for word in shlex.split(command) if "=" in word)


@pytest.fixture(scope="module")
def demo():
    args = demo_infer_args()
    questions = read_questions(
        ROOT / args["bench.questions"],
        int(args["bench.limit"]) if "bench.limit" in args else None,
        int(args["bench.per_category"]) if "bench.per_category" in args else None,
    )
    return args, questions


def test_the_fresh_heads_calibration_prompts_are_not_benchmarked(demo):
    args, questions = demo
    assert args.get("tree") == "auto" and args.get("tree.save") == "head"  # a head it just trained
    tree = TreeConfig(kind="auto", calibration_prompts=int(args.get("tree.calibration_prompts", 8)))
    if "tree.calibration_questions" in args:
        tree.calibration_questions = str(ROOT / args["tree.calibration_questions"])
    source, texts = calibration_texts(InferJobConfig(tree=tree))
    assert texts and overlap({"prompts": prompts_record(source, texts)}, questions) == []


def test_the_compared_heads_trees_were_not_calibrated_on_the_benchmarked_questions(demo):
    args, questions = demo
    heads = args["bench.heads"].strip("[]").split(",")
    assert heads
    for head in heads:
        calibration = json.loads((ROOT / head / "config.json").read_text()).get("calibration")
        assert calibration and calibration["prompts"]["count"] > 0, f"{head} records no calibration prompts"
        assert overlap(calibration, questions) == [], f"{head}'s tree was calibrated on benchmarked questions"
