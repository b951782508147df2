"""Every recipe of conf/recipe/ end to end on its twin: the recipe's target architecture built at
tiny size (the same transformers config class and layer pattern, tied embeddings where the target
ties them, small widths, random weights), then the commands docs/your-model.md shows, with only the
sizes changed: the recipe's own distill.py commands (budget.make_data; the first through the server
backend, against a server playing vLLM over the twin, the others through the built-in one),
train.py on two CPU ranks (the recipes train on several GPUs; a recipe whose target the plan shards
at 8 x 80 GB is sharded here too), infer.py on a prompt, the benchmark and the replay, and the
export with its check against the engine's loader. Commands run in this process where one process
runs them (conftest.run_script), the two ranks under torchrun."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_script, write_questions
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specheads.config import register_configs, typed
from specheads.config.distill import DistillConfig
from specheads.target import load_target
from specheads.train.arch import read_arch
from specheads.train.budget import timings

sys.path.insert(0, str(ROOT / "tests" / "distill"))
from test_server import FakeServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPES = sorted(p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml") if not p.stem.startswith("smollm2"))
# each recipe target's tiny twin: the transformers type of its config.json
TWINS = {
    "llama-3.1-8b": "llama",
    "llama-70b": "llama",
    "qwen3-8b": "qwen3",
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen3-1.7b": "qwen3",
}
# what shrinks with the model: its depth, the draft vocabulary and MLP, the rows, the prompts and answers
HEAD_SIZES = ["head.draft_vocab_size=64", "head.intermediate_size=null"]
ROWS = ["data.max_length=96", "data.eval_fraction=0.2", "tracker=none"]
PROMPTS, ANSWER_TOKENS = 10, 12
EXPORTS = {"eagle3": ["speculators", "eagle3"], "eagle": ["eagle"]}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def recipe_cfg(recipe: str, *overrides: str):
    model, head = recipe.split("_")
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            return typed(compose("config", [f"model={model}", f"head={head}", *overrides]))
    finally:
        GlobalHydra.instance().clear()


def twin_model(recipe: str) -> list[str]:
    """The overrides that make the recipe's target its twin."""
    model = recipe.split("_")[0]
    cfg = recipe_cfg(recipe)
    # a recipe that sets the thinking mode (Qwen3) gets a twin whose chat template reads it
    template = [] if cfg.model.thinking is None else ["+model.tiny.template=thinking"]
    return [
        f"model.path=tiny:{TWINS[model]}",
        "model.arch=null",
        "+model.tiny.num_hidden_layers=4",
        f"+model.tiny.tie_word_embeddings={str(cfg.model.arch.tie_word_embeddings).lower()}",
        *template,
    ]


def sharded_at_scale(recipe: str) -> bool:
    """The plan shards the recipe's target over 8 GPUs of 80 GB."""
    cfg = recipe_cfg(recipe, "plan.gpu_memory=80GB")
    rows = {t.gpus: t for t in timings(cfg, read_arch(cfg.model), 80 * 10**9, "h100")}
    return rows[8].mode == "sharded"


def distill_commands(recipe: str, prompts: Path, url: str) -> list[list[str]]:
    """The recipe's make_data commands for the twin: its prompts a local file, fewer and shorter
    answers, the first through `url`, the others through the built-in backend."""
    commands = []
    for i, line in enumerate(recipe_cfg(recipe).budget.make_data):
        words = shlex.split(line)
        assert words[:2] == ["python", "distill.py"], line
        kept = []
        for word in words[2:]:
            key = word.split("=", 1)[0]
            if key in ("distill.prompts", "distill.prompts_split", "distill.num_prompts", "distill.max_new_tokens"):
                continue
            if key == "distill.server.url" or (key == "distill.backend" and i > 0):
                continue
            kept.append(word)
        kept += [
            f"distill.prompts={prompts}",
            f"distill.num_prompts={PROMPTS}",
            f"distill.max_new_tokens={ANSWER_TOKENS}",
        ]
        kept += [f"distill.server.url={url}"] if i == 0 else ["distill.backend=hf"]
        commands.append(kept + twin_model(recipe))
    return commands


def ok(run: tuple[int, str, str]) -> tuple[int, str, str]:
    code, out, err = run
    assert code == 0 and "Traceback" not in err, f"{out[-2000:]}\n{err[-3000:]}"
    return run


@pytest.fixture(scope="module", params=RECIPES)
def twin_run(request, tmp_path_factory):
    """One recipe's commands on its twin, each checked as it runs; the run's directory."""
    recipe = request.param
    work = tmp_path_factory.mktemp(recipe)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECHEADS_CACHE", str(work / "cache"))
        mp.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded: a twin names no Hub repo
        prompts = write_questions(work / "prompts.jsonl", [f"Say {i}." for i in range(16)])
        twin = recipe_cfg(recipe, *twin_model(recipe))
        target = load_target(twin.model, device=torch.device("cpu"))
        server = FakeServer(target, DistillConfig())
        try:
            for words in distill_commands(recipe, prompts, server.url):
                ok(run_script("distill.py", *words, cwd=work))
        finally:
            server.close()
        model, head = recipe.split("_")
        train = [f"model={model}", f"head={head}", *twin_model(recipe), *HEAD_SIZES, *ROWS, "output_dir=runs/twin"]
        if sharded_at_scale(recipe):
            train.append("deepspeed.shard_target=true")
        proc = subprocess.run(
            [*TORCHRUN, str(ROOT / "train.py"), *train],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        )
        assert proc.returncode == 0, "\n".join(l for l in proc.stderr.splitlines() if "error" in l.lower())[-4000:]
        yield recipe, work, proc, train


def test_every_recipe_has_a_twin():
    assert RECIPES and all(recipe.split("_")[0] in TWINS for recipe in RECIPES)


def test_the_recipes_data_commands_wrote_the_data_it_trains_on(twin_run):
    recipe, work, _, _ = twin_run
    cfg = recipe_cfg(recipe)
    for source in [cfg.data.path, *cfg.data.mix]:
        rows = [json.loads(line) for f in sorted((work / source / "shards").glob("*.jsonl*")) for line in f.open()]
        assert len(rows) == PROMPTS, source
    first = json.loads((work / cfg.data.path / "metadata.json").read_text())
    assert "server" in json.dumps(first)  # the first command went through the served twin


def test_two_ranks_trained_the_recipes_head(twin_run):
    recipe, work, proc, train = twin_run
    head = work / "runs" / "twin" / "head"
    assert proc.stdout.strip().splitlines()[-1].endswith("runs/twin/head")
    record = json.loads((head / "config.json").read_text())
    cfg = recipe_cfg(recipe)
    assert record["training"]["world_size"] == 2 and record["training"]["lr"] == cfg.train.lr
    if "deepspeed.shard_target=true" in train:
        assert "sharded over 2 ranks" in proc.stderr
    # the chat template and the thinking setting the head was trained with travel with it
    assert record["training"]["chat"]["thinking"] == cfg.model.thinking


def test_infer_answers_benchmarks_and_replays_with_the_twins_head(twin_run):
    recipe, work, _, _ = twin_run
    head = "runs/twin/head"
    _, out, _ = ok(run_script("infer.py", f"head={head}", "prompt=hello", "max_new_tokens=8", cwd=work))
    assert "identical to plain greedy: yes" in out.strip().splitlines()[-1]
    questions = write_questions(work / "questions.jsonl", ["Name a color.", "Why is the sky blue?"])
    common = [f"head={head}", f"bench.questions={questions}", "bench.max_new_tokens=8"]
    ok(run_script("infer.py", *common, "bench.output=runs/bench/q.jsonl", cwd=work))
    summary = json.loads((work / "runs" / "bench" / "q.summary.json").read_text())
    assert "spec" in json.dumps(summary)
    ok(run_script("infer.py", *common, "bench.mode=replay", "bench.output=runs/replay/q.jsonl", cwd=work))
    assert (work / "runs" / "replay" / "q.replay.json").is_file()


def test_the_export_passes_the_engines_loader_check(twin_run):
    recipe, work, _, _ = twin_run
    model, head = recipe.split("_")
    for fmt in EXPORTS[head]:
        out = f"export/{fmt}"
        target = [f"model={model}", *twin_model(recipe)]  # as the page exports: the target named
        _, printed, _ = ok(
            run_script("-m specheads.export", "head=runs/twin/head", f"format={fmt}", f"out={out}", *target, cwd=work)
        )
        checked = [line for line in printed.splitlines() if line.endswith(": ok")]  # each engine's loader check
        assert checked and (work / out / "config.json").is_file(), printed
