"""Hub side: loading a head by Hub id from the local HF cache (offline), and publishing an export
(the huggingface_hub calls mocked) with its model card."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_questions
from huggingface_hub import HfApi, ModelCard
from test_export import EAGLE3, PROMPT, ROOT, compose_export, draft_outputs, make_head_dir

from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.export import export_head, open_head, resolve_head_path
from specheads.export.model_card import bench_context, bench_table, check_bench_summary
from specheads.heads import build_head, load_head

pytestmark = pytest.mark.usefixtures("one_thread")

REVISION = "0123456789abcdef0123456789abcdef01234567"


def put_in_hf_cache(hub_cache: Path, repo_id: str, folder: Path) -> Path:
    """The layout snapshot_download leaves behind: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_existing_paths_resolve_to_themselves(tmp_path):
    assert resolve_head_path(tmp_path) == tmp_path
    with pytest.raises(SpecHeadsError, match="does not exist"):
        resolve_head_path(tmp_path / "missing" / "head")


def test_hub_id_resolves_offline_from_a_fresh_hf_home(tiny_target, tmp_path):
    """A new process with HF_HOME and HF_HUB_OFFLINE=1 set, as a user would run it."""
    snapshot = put_in_hf_cache(
        tmp_path / "hf" / "hub", "org/tiny-head", make_head_dir(tiny_target, tmp_path / "head", "medusa")
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    code = (
        "import sys; from specheads.export.hub import resolve_head_path\n"
        "from specheads.errors import SpecHeadsError\n"
        "print(resolve_head_path('org/tiny-head'))\n"
        "try:\n    resolve_head_path('org/not-cached')\n"
        "except SpecHeadsError as e:\n    print('ERROR', e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    found, error = run.stdout.strip().splitlines()
    assert Path(found).resolve() == snapshot.resolve()
    assert error.startswith("ERROR cannot get head org/not-cached") and "HF_HUB_OFFLINE" in error


def test_open_head_by_hub_id_reads_an_engine_format(tiny_target, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    src = make_head_dir(tiny_target, tmp_path / "head", "eagle3", **EAGLE3)
    exported = export_head(src, "eagle3", tmp_path / "export", engine="vllm").path
    put_in_hf_cache(tmp_path / "hub", "org/eagle3-head", exported)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    from_hub = open_head("org/eagle3-head", tiny_target)
    original = load_head(src, tiny_target)
    assert from_hub.target_layer_ids() == [1, 3, 5]
    assert torch.equal(draft_outputs(from_hub, tiny_target, PROMPT), draft_outputs(original, tiny_target, PROMPT))


@pytest.fixture(scope="module")
def bench_summary(tiny_target, tmp_path_factory):
    """A real benchmark summary: infer.py's bench mode on the tiny target (2 questions, 6 tokens)."""
    from specheads.bench.runner import output_paths, run_benchmark
    from specheads.bench.session import Session
    from specheads.config.infer import BenchConfig, InferJobConfig, TreeConfig

    d = tmp_path_factory.mktemp("bench")
    questions = write_questions(
        d / "q.jsonl", [f"Say {i}." for i in (1, 2)], categories=("math", "writing"), first_id=1, later_turns=()
    )
    torch.manual_seed(0)
    head = build_head(HeadConfig(family="medusa", num_heads=2), tiny_target)
    settings = InferJobConfig(
        tree=TreeConfig(kind="chain", depth=2),
        bench=BenchConfig(
            questions=str(questions), output=str(d / "out.jsonl"), max_new_tokens=6, warmup=0, plots=False
        ),
    )
    run_benchmark(settings, Session(tiny_target, head, d / "head", {}), out=io.StringIO())
    return output_paths(d / "out.jsonl")["summary"]


def test_bench_table_reads_a_real_benchmark_summary(bench_summary):
    summary = json.loads(bench_summary.read_text())
    table = bench_table(summary)
    spec = summary["methods"]["spec"]["all"]
    row = (
        f"| spec | all | 2 | {spec['tau']:.2f} | {spec['tokens_per_s']:.2f} | {spec['speedup_vs_baseline']:.2f} | "
        f"{spec['speedup_vs_plain']:.2f} | {spec['speedup_vs_prompt_lookup']:.2f} |"
    )
    assert row in table.splitlines()
    assert "| baseline | math | 1 | 1.00 |" in table
    context = " ".join(bench_context(summary))
    assert "spec: 2/2 outputs identical to HF greedy" in context and "break-even tau" in context
    costs = {**summary["costs"], "plain_step_ms": None, "own_plain_step_ms": 12.5}  # a run without HF greedy
    assert "against our own loop's plain step of 12.5 ms" in " ".join(bench_context({**summary, "costs": costs}))
    with pytest.raises(SpecHeadsError, match="not a benchmark summary"):
        check_bench_summary({"spec": {"overall": {"tau": 2.0, "speedup": 1.4}}})


def test_push_to_hub_uploads_the_folder_with_a_model_card(tiny_target, tmp_path, monkeypatch, capsys, bench_summary):
    from specheads.export.job import run_export

    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        calls["upload_folder"] = (repo_id, sorted(p.name for p in folder.iterdir()), kwargs)
        calls["card"] = (folder / "README.md").read_text()
        calls["config"] = json.loads((folder / "config.json").read_text())
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    summary = bench_summary
    src = make_head_dir(tiny_target, tmp_path / "head", "eagle", fc_bias=False)
    run_export(
        compose_export(
            [
                f"head_path={src}",
                "format=eagle",
                "push_to_hub=true",
                "repo_id=org/tiny-eagle",
                "base_model=org/tiny-target",
                f"bench.summary={summary}",
            ]
        )
    )
    assert calls["create_repo"] == ("org/tiny-eagle", {"private": False, "exist_ok": True, "repo_type": "model"})
    repo_id, files, kwargs = calls["upload_folder"]
    assert (repo_id, files) == ("org/tiny-eagle", ["README.md", "config.json", "model.safetensors"])
    assert kwargs["repo_type"] == "model"
    card = ModelCard(calls["card"])
    meta = card.data.to_dict()
    assert meta["base_model"] == "org/tiny-target" and meta["library_name"] == "specheads"
    assert {"speculative-decoding", "eagle", "vllm", "sglang"} <= set(meta["tags"])
    text = card.text
    assert (
        """vllm serve org/tiny-target --speculative-config '{"method": "eagle", "model": "org/tiny-eagle", """
        """"num_speculative_tokens": 3}\'""" in text
    )
    assert (
        "python -m sglang.launch_server --model-path org/tiny-target --speculative-algorithm EAGLE "
        "--speculative-draft-model-path org/tiny-eagle --speculative-num-steps 3 --speculative-eagle-topk 2 "
        "--speculative-num-draft-tokens 6"
    ) in text
    speedup = json.loads(bench_summary.read_text())["methods"]["spec"]["writing"]["speedup_vs_baseline"]
    assert "| spec | writing | 1 |" in text and f"| {speedup:.2f} |" in text  # the speedup column is kept
    assert '"steps": 7' in text and '"family": "eagle"' in text
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "https://huggingface.co/org/tiny-eagle/commit/abc"
    assert calls["config"]["specheads"]["format"] == "eagle"


def test_failed_upload_is_one_line(tmp_path, monkeypatch):
    from specheads.export.hub import push_to_hub

    def refuse(self, repo_id, **kwargs):
        raise PermissionError("401 Client Error: Unauthorized\nmore detail")

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    with pytest.raises(
        SpecHeadsError, match=r"^upload to org/x failed: PermissionError: 401 Client Error: Unauthorized$"
    ):
        push_to_hub(tmp_path, "org/x")
    with pytest.raises(SpecHeadsError, match="org/name"):
        push_to_hub(tmp_path, "not a repo id")
