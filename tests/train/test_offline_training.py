"""distill.py caches features; train.py trains from them with the losses of online training."""

import json
import subprocess
import sys

from conftest import write_questions
from test_train import ROOT, clean_env, run


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_offline_features_train_like_online(tmp_path):
    questions = tmp_path / "questions.jsonl"
    topics = ["rivers", "stars", "bread", "chess", "rain", "glass", "maps", "bees", "salt", "wind"]
    write_questions(questions, [f"Tell me about {t} please." for t in topics], categories=("t",), later_turns=())
    data = tmp_path / "distilled"
    proc = run(
        [
            sys.executable,
            "distill.py",
            "model=tiny-random",
            f"distill.prompts={questions}",
            "distill.num_prompts=10",
            "distill.max_new_tokens=24",
            f"distill.output={data}",
            "distill.decontaminate=[]",
            "distill.features.enabled=true",
            "distill.features.dtype=float32",
            "distill.features.layer_ids=[1,3,5]",
            "distill.features.max_length=96",
            "distill.features.eval_fraction=0.2",
        ]
    )
    features = data / "features"
    assert (features / "train" / "index.json").is_file()
    index = json.loads((features / "train" / "index.json").read_text())
    assert index["bytes_per_token"] == 4 * 64 * 4  # three layers + final, hidden 64, fp32

    common = [
        "model=tiny-random",
        "head=eagle3",
        "head.layer_ids=[1,3,5]",
        "head.draft_vocab_size=64",
        "head.ttt_steps=3",
        f"data.path={data}",
        "data.max_length=96",
        "data.eval_fraction=0.2",
        "data.decontaminate=[]",
        "train.max_steps=4",
        "train.batch_size=2",
        "train.log_every=1",
        "train.eval_every=0",
        "wandb.mode=disabled",
        "seed=3",
    ]
    run([sys.executable, "train.py", *common, f"output_dir={tmp_path / 'online'}"])
    run([sys.executable, "train.py", *common, f"data.features={features}", f"output_dir={tmp_path / 'offline'}"])
    online, offline = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert sorted(online) == sorted(offline) == [1, 2, 3, 4]
    for step in online:
        assert abs(online[step] - offline[step]) <= 1e-4 * max(1.0, abs(online[step])), (online, offline)
    # a cache made for other layers is refused in one line
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            *common,
            "head.layer_ids=[2,3,4]",
            f"data.features={features}",
            f"output_dir={tmp_path / 'stale'}",
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: feature cache")
