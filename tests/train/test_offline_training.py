"""distill.py caches features (on one process or two ranks); train.py trains from them with the
losses of online training."""

import filecmp
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import write_questions
from test_train import ROOT, TORCHRUN, clean_env, run

FEATURE_ARGS = [
    "distill.features.enabled=true",
    "distill.features.dtype=float32",
    "distill.features.layer_ids=[1,3,5]",
    "distill.features.max_length=96",
    "distill.features.eval_fraction=0.2",
    "distill.features.shard_tokens=150",  # several shards, so that both ranks write some
]
COMMON = [
    "model=tiny-random",
    "head=eagle3",
    "head.layer_ids=[1,3,5]",
    "head.draft_vocab_size=64",
    "head.ttt_steps=3",
    "data.max_length=96",
    "data.eval_fraction=0.2",
    "data.decontaminate=[]",
    "train.max_steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "wandb.mode=disabled",
    "seed=3",
]


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def distill_command(data, *extra):
    return ["distill.py", "model=tiny-random", f"distill.output={data}", *FEATURE_ARGS, *extra]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A finished distillation of 10 questions with its features, cached by one process."""
    tmp = tmp_path_factory.mktemp("distilled")
    questions = tmp / "questions.jsonl"
    topics = ["rivers", "stars", "bread", "chess", "rain", "glass", "maps", "bees", "salt", "wind"]
    write_questions(questions, [f"Tell me about {t} please." for t in topics], categories=("t",), later_turns=())
    data = tmp / "distilled"
    generation = [f"distill.prompts={questions}", "distill.num_prompts=10", "distill.max_new_tokens=24"]
    run([sys.executable, *distill_command(data, *generation, "distill.decontaminate=[]")])
    return data, generation


def test_offline_features_train_like_online(distilled, tmp_path):
    data, _ = distilled
    features = data / "features"
    index = json.loads((features / "train" / "index.json").read_text())
    assert index["bytes_per_token"] == 4 * 64 * 4  # three layers + final, hidden 64, fp32
    trainings = [
        [sys.executable, "train.py", *COMMON, f"data.path={data}", "train.batch_size=2", *extra]
        + [f"output_dir={tmp_path / name}"]
        for name, extra in (("online", []), ("offline", [f"data.features={features}"]))
    ]
    # a cache made for other layers is refused in one line
    stale = [
        sys.executable,
        "train.py",
        *COMMON,
        f"data.path={data}",
        "head.layer_ids=[2,3,4]",
        f"data.features={features}",
        f"output_dir={tmp_path / 'stale'}",
    ]
    # the two runs side by side (each child is single-threaded), the refused one in the first free slot
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(run, cmd) for cmd in trainings]
        refused = pool.submit(
            subprocess.run, stale, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=240
        )
        for d in done:
            d.result()
    online, offline = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert sorted(online) == sorted(offline) == [1, 2, 3, 4]
    for step in online:
        assert abs(online[step] - offline[step]) <= 1e-4 * max(1.0, abs(online[step])), (online, offline)
    proc = refused.result()
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: feature cache")
    # each head records where its states came from: the online forward, or the cache and its writer
    recorded = {
        name: json.loads((tmp_path / name / "head" / "config.json").read_text())["training"]["features"]
        for name in ("online", "offline")
    }
    assert recorded["online"] == {"online": True, "writer": {"backend": "transformers"}}
    assert recorded["offline"]["cache"] == "features" and recorded["offline"]["dtype"] == "float32"
    assert recorded["offline"]["writer"]["backend"] == "transformers" and recorded["offline"]["writer"]["transformers"]


def test_two_ranks_cache_the_features_of_one_and_train_from_them(distilled, tmp_path):
    data, generation = distilled
    two = tmp_path / "features-2"
    proc = run(
        [*TORCHRUN, *distill_command(data, *generation, "distill.decontaminate=[]", f"distill.features.output={two}")]
    )
    assert proc.stdout.strip().splitlines()[-1] == str(data)  # rank 0 prints the directory, once
    one = data / "features"
    for split in ("train", "eval"):
        files = sorted(p.name for p in (one / split).iterdir())
        assert files == sorted(p.name for p in (two / split).iterdir())
        # byte for byte: the same shards (numbered by the plan, whichever rank wrote them) and index
        match, mismatch, errors = filecmp.cmpfiles(one / split, two / split, files, shallow=False)
        assert (mismatch, errors) == ([], []) and len(match) == len(files)
    shards = json.loads((one / "train" / "index.json").read_text())["shards"]
    assert len(shards) >= 3  # rank 1 wrote shard 1 at least: the check compares work of both ranks
    assert not list(tmp_path.glob(".features-2.tmp-*"))

    # two ranks read the cache through the distributed sampler: the losses of two ranks online
    for name, extra in (("online", []), ("offline", [f"data.features={two}"])):
        out = tmp_path / f"train-2-{name}"
        run([*TORCHRUN, "train.py", *COMMON, f"data.path={data}", "train.batch_size=1", *extra, f"output_dir={out}"])
    online, offline = losses(tmp_path / "train-2-online"), losses(tmp_path / "train-2-offline")
    assert sorted(online) == sorted(offline) == [1, 2, 3, 4]
    assert list(offline.values()) == pytest.approx(list(online.values()), rel=1e-4)


def test_several_ranks_refuse_to_regenerate(tmp_path):
    env = clean_env() | {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run(
        [sys.executable, *distill_command(tmp_path / "new")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "is not a finished distillation" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "new").exists()
