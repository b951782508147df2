"""Results records name the weights they measured; a calibration names the weights it was made for."""

from __future__ import annotations

import hashlib
import io
import json

import torch
from conftest import write_questions

from specheads.bench.record import results_record, short, weights_sha256
from specheads.bench.runner import run_benchmark
from specheads.bench.session import Session
from specheads.bench.trees import other_weights_line, use_cached_tree
from specheads.config.infer import BenchConfig, InferJobConfig, TreeConfig
from specheads.config.train import HeadConfig
from specheads.heads import build_head, save_head
from specheads.heads.io import load_head


def saved_head(tiny_target, path, seed=0, calibration=None):
    torch.manual_seed(seed)
    head = build_head(HeadConfig(family="eagle3", draft_vocab_size=320), tiny_target)
    head.calibration = calibration
    return save_head(head, path)


def test_a_record_names_each_head_by_the_sha256_of_its_weights_file(tmp_path, tiny_target):
    head_dir = saved_head(tiny_target, tmp_path / "head")
    digest = hashlib.sha256((head_dir / "model.safetensors").read_bytes()).hexdigest()
    questions = write_questions(tmp_path / "q.jsonl", ["Name a river.", "Count to three."])
    record = results_record("bench", {"spec": head_dir, "lookup": None}, questions, 2)
    assert record["heads"] == {"spec": {"dir": "head", "weights_sha256": digest}}
    assert record["questions"] == {
        "path": "q.jsonl",
        "sha256": hashlib.sha256(questions.read_bytes()).hexdigest(),
        "count": 2,
    }
    assert record["kind"] == "bench" and record["date"].endswith("+00:00") and "command" in record
    # a calibration stored in config.json changes no weights: the same digest
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, "default_tree": [[0]]}))
    assert weights_sha256(head_dir) == digest and short(digest) == digest[:12]
    assert weights_sha256(tmp_path) is None and short(None) == "-"


def test_the_benchmark_summary_carries_its_record(tmp_path, tiny_target):
    head_dir = saved_head(tiny_target, tmp_path / "head")
    settings = InferJobConfig(
        head_path=str(head_dir),
        tree=TreeConfig(kind="chain", depth=2),
        bench=BenchConfig(
            questions=str(write_questions(tmp_path / "q.jsonl", ["Name a river.", "Count to three."])),
            output=str(tmp_path / "out" / "res.jsonl"),
            max_new_tokens=6,
            warmup=0,
            methods=["plain", "spec"],
            plots=False,
        ),
    )
    head = load_head(head_dir, tiny_target)
    run_benchmark(settings, Session(tiny_target, head, head_dir, {}), out=io.StringIO())
    summary = json.loads((tmp_path / "out" / "res.summary.json").read_text())
    record = summary["record"]
    assert record["heads"]["spec"]["weights_sha256"] == weights_sha256(head_dir)
    assert record["questions"]["count"] == 2 and record["machine"] == summary["machine"]


def test_a_calibration_made_for_other_weights_says_so_in_one_line(tmp_path, tiny_target):
    head_dir = saved_head(tiny_target, tmp_path / "head")
    mine = weights_sha256(head_dir)
    assert other_weights_line({"weights_sha256": mine}, head_dir) is None
    assert other_weights_line({"nodes": 3}, head_dir) is None  # a record from before: names no weights
    assert other_weights_line(None, head_dir) is None
    line = other_weights_line({"weights_sha256": "ab" * 32}, head_dir)
    assert line.count("\n") == 1 and short("ab" * 32) in line and short(mine) in line
    carried = {"carried_over": {"from_weights_sha256": "cd" * 32, "why": "kept"}}
    assert short("cd" * 32) in other_weights_line(carried, head_dir)
    # where the calibration is used: tree=default's choice of tree says it once
    other = saved_head(tiny_target, tmp_path / "other", calibration={"weights_sha256": "ab" * 32, "nodes": 1})
    out = io.StringIO()
    use_cached_tree(load_head(other, tiny_target), other, tiny_target, kernels=False, out=out)
    assert out.getvalue().count("made for other weights") == 1
    own = saved_head(tiny_target, tmp_path / "own", calibration={"nodes": 1})
    config = json.loads((own / "config.json").read_text())
    config["calibration"]["weights_sha256"] = weights_sha256(own)
    (own / "config.json").write_text(json.dumps(config))
    out = io.StringIO()
    use_cached_tree(load_head(own, tiny_target), own, tiny_target, kernels=False, out=out)
    assert "other weights" not in out.getvalue()
