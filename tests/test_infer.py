"""infer.py: the command-line contract (docs/contracts.md) and the pieces around it."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_questions

from specheads.config import register_configs, typed
from specheads.errors import SpecHeadsError

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}


pytestmark = pytest.mark.usefixtures("one_thread")


def run_infer(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "infer.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_demo_prints_marked_answer_and_stats(head_dir):
    """The demo mode in-process (the command line itself is exercised by the benchmark test)."""
    from specheads.bench.demo import run_demo
    from specheads.bench.session import load_session
    from specheads.config.infer import InferJobConfig

    settings = InferJobConfig(
        head_path=str(head_dir), prompt="Hi, what's [1, 2] + {3}?", max_new_tokens=12, mark="brackets"
    )
    session = load_session(settings, CONF)
    assert session.target.info.name == "tiny-random"  # the target named in the head's config.json
    out = io.StringIO()
    stats = run_demo(settings, session, out=out)
    last = out.getvalue().strip().splitlines()[-1]
    for word in ("tau", "tokens/s", "speedup", "identical to plain greedy: yes"):
        assert word in last
    assert stats["new_tokens"] == 12 and stats["identical_to_baseline"]


def test_an_int8_session_drafts_on_int8_weights_and_answers_as_the_target(head_dir):
    from specheads.bench.demo import run_demo
    from specheads.bench.session import load_session
    from specheads.config.infer import InferJobConfig
    from specheads.heads.io import draft_precision
    from specheads.kernels import weight_int8

    settings = InferJobConfig(head_path=str(head_dir), prompt="Tell me about writing.", max_new_tokens=12)
    settings.head_dtype = "int8"
    session = load_session(settings, CONF)
    assert weight_int8.installed(session.head) and not weight_int8.installed(session.target.model)
    assert draft_precision(session.head).startswith("int8/")
    stats = run_demo(settings, session, out=io.StringIO())
    assert stats["new_tokens"] == 12 and stats["identical_to_baseline"]


def test_bench_writes_the_contract_fields(head_dir, tmp_path):
    questions = tmp_path / "question.jsonl"
    categories = ("writing", "math")
    prompts = [f"Tell me about {c}, please." for c in categories]
    write_questions(questions, prompts, categories, first_id=1, later_turns=())
    out = tmp_path / "bench" / "out.jsonl"
    proc = run_infer(
        f"head={head_dir}",
        f"bench.questions={questions}",
        f"bench.output={out}",
        "bench.max_new_tokens=10",
        "bench.methods=[baseline,prompt_lookup,spec]",
        "temperature=0",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    for r in rows:
        assert {"question_id", "category", "method", "output_ids", "new_tokens", "target_forwards", "wall_s"} <= set(r)
    summary = json.loads(out.with_name("out.summary.json").read_text())
    assert summary["methods"]["spec"]["all"]["tau"] >= 1.0
    from specheads.heads.io import native_bf16_cpu

    assert summary["head_dtype"] == ("int8/bfloat16" if native_bf16_cpu() else "float32")  # head_dtype=auto
    assert summary["identical_to_baseline"]["spec"]["equal"] == 2
    assert "tok/s" in proc.stdout and "spec" in proc.stdout
    assert out.with_name("out.tau.png").is_file() and out.with_name("out.acceptance.png").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["head=/nonexistent/head", "prompt=hi"], "does not exist"),  # found while running
        (["head=/tmp", "prompt=hi", "no_such_key=1"], "no_such_key"),  # found while composing
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = run_infer(*args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["prompt=hi"], "head="),
        (["head_path=/tmp"], "prompt"),
        (["head_path=/tmp", "bench.output=o.jsonl"], "bench.questions"),
        (["head_path=/tmp", "prompt=hi", "tree.kind=weird"], "tree.kind"),
        (["head_path=/tmp", "prompt=hi", "head_dtype=int4"], "head_dtype must be one of"),
        (["head_path=/tmp", "prompt=hi", "bench.methods=[spec,eagle]"], "bench.methods"),
        (["head_path=/tmp", "prompt=hi", "acceptance=typical"], "temperature > 0"),
        (["head_path=/tmp", "prompt=hi", "bench.heads=[/tmp]"], "bench.heads compares heads in the benchmark"),
        (["head_path=/tmp", "prompt=hi", "bench.heads=[/no/such/head]"], "bench.heads: /no/such/head does not exist"),
        (["head_path=/tmp", "bench.questions=q.jsonl", "bench.head_dtypes=[int4]"], "bench.head_dtypes: each must be"),
        (["head_path=/tmp", "prompt=hi", "bench.head_dtypes=[int8]"], "bench.head_dtypes runs the head"),
        (
            ["head_path=/tmp", "bench.questions=q.jsonl", "bench.methods=[plain]", "bench.head_dtypes=[int8]"],
            "keep spec in bench.methods",
        ),
        (
            ["head_path=/tmp", "bench.questions=q.jsonl", "bench.head_dtypes=[int8,int8]"],
            "names a precision twice",
        ),
    ],
)
def test_settings_are_checked(overrides, message):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specheads.config.infer import validate

    register_configs()  # the infer and tree schemas (infer.py registers them when imported)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = compose("infer", overrides)
        with pytest.raises(SpecHeadsError, match=message.replace("(", "\\(")):
            validate(typed(cfg))
    finally:
        GlobalHydra.instance().clear()


def test_bench_output_defaults_next_to_the_runs(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specheads.config.infer import validate

    register_configs()
    questions = tmp_path / "mt_bench_question.jsonl"
    questions.write_text("{}\n")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = compose("infer", ["head_path=/tmp", f"bench.questions={questions}"])
        assert validate(typed(cfg)).bench.output == "runs/bench/mt_bench_question.jsonl"
    finally:
        GlobalHydra.instance().clear()


def test_free_text_arguments_stay_literal():
    import infer

    cases = ["Hello, world", "it's [a] {b} = c: d", "back\\slash and quote\\' end\\", "${not.interpolated}"]
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for text in cases:
            argv = infer.plain_values(["infer.py", "head=/some/dir,x", f"prompt={text}"])
            cfg = compose("infer", argv[1:])
            assert cfg.prompt == text and cfg.head_path == "/some/dir,x"
    GlobalHydra.instance().clear()
