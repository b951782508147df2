"""`make engines` (engines/compare.py, a tool of the repository): the orchestrator's pure parts
(always), and the whole vLLM check (marker `engines`, only where vLLM's virtualenv exists:
`pytest -m engines tests/engines/test_compare.py`)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.data.questions import DEV_QUESTIONS
from specheads.errors import SpecHeadsError

TOOL = Path(__file__).resolve().parents[2] / "engines" / "compare.py"
_spec = importlib.util.spec_from_file_location("engines_compare", TOOL)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)
ROOT = compare.ROOT
acceptance_from_counters = compare.acceptance_from_counters
acceptance_from_steps = compare.acceptance_from_steps
agrees = compare.agrees
count_identical = compare.count_identical
format_table = compare.format_table
parse_args = compare.parse_args
root_cause = compare.root_cause
run_logged = compare.run_logged
split_log = compare.split_log
table_rows = compare.table_rows

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def test_counters_to_acceptance():
    acc = acceptance_from_counters(
        {"num_drafts": 958, "num_draft_tokens": 2874, "num_accepted_tokens": 187, "accepted_per_pos": [181, 6, 0]}
    )
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 187 / 958)
    assert acc["per_position"] == pytest.approx([181 / 958, 6 / 958, 0.0])
    assert acceptance_from_counters({"num_drafts": 0}) is None
    assert acceptance_from_counters(None) is None
    assert acc["kept_acceptance_length"] is None


def test_vllms_accepts_past_the_answers_end_are_not_counted_as_kept():
    """Answers of at most 6 and 4 tokens, chains of 3, the prefill giving each its first token.
    Answer 1: a step accepting 3 (5 tokens), then one accepting 2 of which none fits. Answer 2: a
    step accepting 1 (3 tokens), then one accepting 3 of which none fits. vLLM counts 9 accepts in 4
    drafts (3.25); the answers kept 8 tokens past the prefill (2.00 a draft), which is what infer.py
    measures: it drafts only what can still be kept, so its last step of each answer accepts 0."""
    counters = {"num_drafts": 4, "num_accepted_tokens": 9, "accepted_per_pos": [4, 3, 2]}
    acc = acceptance_from_counters(counters, [[1] * 6, [1] * 4])
    assert acc["mean_acceptance_length"] == pytest.approx(3.25)
    assert acc["kept_acceptance_length"] == pytest.approx(2.0)
    ours = acceptance_from_steps([3, 0, 1, 0], k=3)
    assert ours["mean_acceptance_length"] == pytest.approx(acc["kept_acceptance_length"])
    assert agrees({**ours, "stderr": 0.0}, acc) and not agrees(
        {**ours, "stderr": 0.0}, {**acc, "kept_acceptance_length": None}
    )


def test_steps_count_like_vllm():
    """infer.py's accepted drafts per step, counted as vLLM counts them: the same numbers for the same steps."""
    steps = [0, 1, 3, 0, 2, 1]
    ours = acceptance_from_steps(steps, k=3)
    per_pos = [sum(a >= p for a in steps) for p in (1, 2, 3)]
    theirs = acceptance_from_counters(
        {"num_drafts": len(steps), "num_accepted_tokens": sum(steps), "accepted_per_pos": per_pos}
    )
    assert ours["mean_acceptance_length"] == pytest.approx(theirs["mean_acceptance_length"])
    assert ours["per_position"] == pytest.approx(theirs["per_position"])
    assert ours["stderr"] > 0
    assert acceptance_from_steps([], k=3) is None


def test_identical_counting_catches_a_difference():
    ref = [[1, 2, 3], [4, 5]]
    assert count_identical([[1, 2, 3], [4, 5]], ref) == (2, 2)
    assert count_identical([[1, 2, 3], [4, 6]], ref) == (1, 2)
    assert count_identical([[1, 2, 3]], ref) == (1, 2)  # a missing output is not identical
    assert count_identical([[1, 2, 3, 7], [4, 5]], ref) == (1, 2)


def test_agreement_within_noise_only():
    a = {"mean_acceptance_length": 1.20, "stderr": 0.01}
    assert agrees(a, {"mean_acceptance_length": 1.22}) is True
    assert agrees(a, {"mean_acceptance_length": 1.05}) is False  # e.g. a wrong layer id in an exporter
    assert agrees(None, {"mean_acceptance_length": 1.2}) is None
    assert agrees({"mean_acceptance_length": 1.2, "stderr": 0.1}, {"mean_acceptance_length": 1.45}) is True


def test_root_cause_of_a_failed_load():
    log = [
        "INFO loading",
        "(EngineCore pid=1) ValueError: num_speculative_tokens 4 exceeds the 3 Medusa heads",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert root_cause(log) == "ValueError: num_speculative_tokens 4 exceeds the 3 Medusa heads"
    assert root_cause(["all fine"]) is None
    sections = split_log(["vllm_run: plain", "a", "vllm_run: plain done", "vllm_run: eagle", "b"])
    assert sections == {"plain": ["a"], "eagle": ["b"]}


def test_a_failed_step_is_one_line(tmp_path):
    log = tmp_path / "step.log"
    with pytest.raises(SpecHeadsError, match=r"^export format=eagle failed \(ValueError: boom\); log: "):
        run_logged("export format=eagle", [sys.executable, "-c", "raise ValueError('boom')"], log)
    assert "ValueError: boom" in log.read_text()
    with pytest.raises(SpecHeadsError, match="make engines"):
        parse_args(["--vllm-python", str(tmp_path / "absent")])


def test_questions_default_to_the_dev_set_and_a_missing_file_is_an_error(tmp_path):
    """The tool reads nothing beside the checkout: its questions are the package's dev set unless
    --questions names a file, and a file that is not there stops it (no fallback to another set)."""
    python = tmp_path / "python"
    python.write_text("")
    assert parse_args(["--vllm-python", str(python)]).questions == DEV_QUESTIONS
    assert ROOT == TOOL.parents[1] and (ROOT / "engines" / "vllm_run.py").is_file()
    with pytest.raises(SpecHeadsError, match=r"--questions .*mt_bench_question.jsonl does not exist"):
        parse_args(["--vllm-python", str(python), "--questions", str(tmp_path / "mt_bench_question.jsonl")])


def _results():
    answers = [[1] * 8, [2] * 8]  # 14 tokens past the prefills: 10 drafts and 4 accepts
    plain = {"loaded": True, "output_ids": answers, "tokens_per_s_batch1": 20.0, "tokens_per_s_batch": 100.0}
    good = {
        "loaded": True,
        "output_ids": answers,
        "tokens_per_s_batch1": 22.0,
        "tokens_per_s_batch": 90.0,
        "spec": {"num_drafts": 10, "num_accepted_tokens": 4, "accepted_per_pos": [3, 1, 0]},
    }
    bad = {**good, "output_ids": [[1] * 8, [2] * 3 + [3]], "spec": {"num_drafts": 10, "num_accepted_tokens": 0}}
    failed = {"loaded": False, "error": "ValueError: unknown method"}
    vllm = {"plain": plain, "eagle3": good, "eagle": bad, "vllm-medusa": failed}
    infer = {
        name: {
            "acceptance": acceptance_from_steps([1, 1, 0, 0, 1, 0, 0, 1, 0, 0] * 10, 3),
            "output_ids": answers,
        }
        for name in ("eagle3", "eagle", "vllm-medusa")
    }
    return vllm, infer


def test_table_shows_failures():
    vllm, infer = _results()
    rows = {r["run"]: r for r in table_rows(vllm, infer)}
    assert rows["eagle3"]["identical"] == (2, 2) and rows["eagle3"]["agree"] is True
    assert rows["eagle3"]["speedup_batch1"] == pytest.approx(1.1)
    assert rows["eagle"]["identical"] == (1, 2) and rows["eagle"]["agree"] is False
    assert not rows["vllm-medusa"]["loaded"] and rows["vllm-medusa"]["identical"] is None
    table = format_table(list(rows.values()), k=3, batch=8)
    lines = table.splitlines()
    assert lines[0].startswith("| run | loaded | = vLLM plain")
    eagle3 = next(line for line in lines if line.startswith("| eagle3 "))
    assert "| yes | 2/2 | 1.40 (1.40 kept) | 0.30 0.10 0.00 | 1.40 |" in eagle3 and "| 1.10 |" in eagle3
    assert "| eagle | yes | 1/2 |" in table and "| NO |" in table
    assert "| vllm-medusa | NO |" in table
    assert "- vllm-medusa: ValueError: unknown method" in table
    assert "- eagle: acceptance differs between vLLM (1.00 (1.00 kept)) and infer.py (1.40)" in table


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_vllm_serves_every_export(tmp_path):
    """Every format vLLM loads: loaded, greedy outputs identical to vLLM's plain decoding, and the
    same acceptance as infer.py for the same head, prompts and chain length (heads trained once,
    into runs/engines/heads, and reused)."""
    cmd = [sys.executable, str(TOOL), "--num-questions", "4", "--max-new-tokens", "48"]
    cmd += ["--out", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
    report = json.loads((tmp_path / "engines.json").read_text())
    rows = {r["run"]: r for r in report["rows"]}
    assert set(rows) == {"plain", *compare.DEFAULT_FORMATS, "ngram"}
    for name, r in rows.items():
        assert r["loaded"], f"{name}: {r['error']}"
        assert r["identical"][0] == r["identical"][1], f"{name}: outputs differ from vLLM plain"
        if name not in ("plain", "ngram"):
            assert r["agree"], f"{name}: vLLM {r['vllm_acceptance']} vs infer.py {r['infer_acceptance']}"


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_a_head_with_the_speculators_trainers_norms_drafts_in_infer_what_it_drafts_in_vllm(tmp_path):
    """speculators' trainer writes norm_before_residual and norm_output on by default: such a head,
    in its speculators directory, is drafted by vLLM as it is and by our reader read back onto the
    target (--given), with the same acceptance and greedy outputs identical to vLLM's plain. The head
    continues the shipped one for 30 steps with the norms on, so drafts at depth 2 and 3 (where
    norm_output feeds back) are accepted and the check can tell the readers apart."""
    trained = ROOT / "runs" / "engines" / "heads" / "eagle3-speculators-norms"
    if not (trained / "head" / "config.json").is_file():
        cmd = [sys.executable, "train.py", "head=eagle3", "head.norm_before_residual=true", "head.norm_output=true"]
        cmd += [f"train.init_from={compare.SHIPPED_EAGLE3}", "train.max_steps=30", "train.eval_every=0"]
        cmd += ["wandb.mode=disabled", f"output_dir={trained}"]
        run_logged("train.py", cmd, tmp_path / "train.log")
    exported = compare.export(trained / "head", "speculators", tmp_path / "given", 3, tmp_path)
    config = json.loads((exported / "config.json").read_text())
    assert config["norm_before_residual"] is True and config["norm_output"] is True
    cmd = [sys.executable, str(TOOL), "--num-questions", "4", "--max-new-tokens", "48", "--k", "3"]
    cmd += ["--formats", "--peers", "--given", f"norms={exported}", "--out", str(tmp_path / "out")]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
    rows = {r["run"]: r for r in json.loads((tmp_path / "out" / "engines.json").read_text())["rows"]}
    assert set(rows) == {"plain", "norms"}
    norms = rows["norms"]
    assert norms["loaded"], norms["error"]
    assert norms["identical"][0] == norms["identical"][1] == 4
    vllm, ours = (norms[k]["mean_acceptance_length"] for k in ("vllm_acceptance", "infer_acceptance"))
    assert norms["vllm_acceptance"]["per_position"][1] > 0, "no depth-2 draft accepted: norm_output unexercised"
    assert norms["agree"], f"vLLM {vllm} vs infer.py {ours}"


def test_runs_per_chain_length_name_each_k_and_keep_medusa_at_its_head_count(tmp_path):
    exports = {"eagle3": tmp_path / "e3", "vllm-medusa": tmp_path / "m"}
    runs = {r["name"]: r for r in compare.vllm_runs(exports, ["ngram", "suffix"], [2, 3])}
    assert list(runs) == [
        "plain",
        "eagle3-k2",
        "ngram-k2",
        "suffix-k2",
        "eagle3-k3",
        "vllm-medusa-k3",
        "ngram-k3",
        "suffix-k3",
    ]
    assert runs["plain"]["speculative_config"] is None
    assert runs["eagle3-k2"]["speculative_config"] == {
        "method": "eagle3",
        "model": str(tmp_path / "e3"),
        "num_speculative_tokens": 2,
    }
    assert runs["suffix-k3"]["speculative_config"] == {"method": "suffix", "num_speculative_tokens": 3}
    # Suffix Decoding remembers earlier answers: its batched pass must not reuse the batch-1 pass's engine
    assert runs["suffix-k2"].get("fresh_engine_per_pass") and not runs["ngram-k2"].get("fresh_engine_per_pass")
    # one K keeps the plain names the single-K table and engines.json have always used
    assert [r["name"] for r in compare.vllm_runs(exports, ["ngram"], [3])] == [
        "plain",
        "eagle3",
        "vllm-medusa",
        "ngram",
    ]


def test_chain_lengths_are_sorted_unique_and_positive(tmp_path):
    python = tmp_path / "python"
    python.touch()
    assert parse_args(["--vllm-python", str(python), "--k", "5", "2", "3", "2"]).k == [2, 3, 5]
    with pytest.raises(SpecHeadsError, match="--k"):
        parse_args(["--vllm-python", str(python), "--k", "3", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--vllm-python", str(python), "--peers", "medusa"])


def test_dflash_runs_up_to_its_block_and_says_why_not_beyond(tmp_path):
    """A DFlash head drafts at most block_size - 1 tokens: larger K are not run (and say why), smaller
    K run with a note that vLLM's block is then shorter than the trained one."""
    head = tmp_path / "head"
    head.mkdir()
    head.joinpath("config.json").write_text(json.dumps({"family": "dflash", "head": {"block_size": 5}}))
    assert compare.draft_limit("dflash", head) == 4 and compare.draft_limit("eagle3", head) is None
    ks = [2, 3, 4, 5, 6]
    assert compare.chain_lengths("dflash", ks, 4) == [2, 3, 4]
    assert compare.chain_lengths("eagle3", ks) == ks and compare.chain_lengths("medusa", ks) == [6]
    assert list(compare.skipped_chains("dflash", ks, 4)) == [5, 6]
    assert compare.regime_note("dflash", 4, 4) is None
    assert "K=2 < block_size - 1 = 4" in compare.regime_note("dflash", 2, 4)
    exports = {"dflash": tmp_path / "d", "dflash-speculators": tmp_path / "s", "eagle3": tmp_path / "e"}
    runs = {r["name"]: r["speculative_config"] for r in compare.vllm_runs(exports, [], ks, {"dflash": 4})}
    assert "dflash-k4" in runs and "dflash-k5" not in runs and "dflash-speculators-k5" not in runs
    assert "eagle3-k6" in runs
    speculators = {"method": "dflash", "model": str(tmp_path / "s"), "num_speculative_tokens": 3}
    assert runs["dflash-speculators-k3"] == speculators
    notes, skipped = compare.annotations(list(exports), 5, ks, {"dflash": 4, "eagle3": None})
    assert notes == {} and set(skipped) == {"dflash-k5", "dflash-speculators-k5"}
    assert "K=5 > 4: a dflash head drafts at most 4 tokens (its trained block)" in skipped["dflash-k5"]
    notes, skipped = compare.annotations(list(exports), 2, ks, {"dflash": 4, "eagle3": None})
    assert set(notes) == {"dflash-k2", "dflash-speculators-k2"} and skipped == {}


def test_peagle_runs_up_to_its_trained_positions(tmp_path):
    """A P-EAGLE head fills parallel_depths positions: infer.py refuses a deeper chain, so a larger K
    is listed as not run rather than crashing the comparison after vLLM's pass."""
    head = tmp_path / "head"
    head.mkdir()
    head.joinpath("config.json").write_text(json.dumps({"family": "peagle", "head": {"parallel_depths": 4}}))
    assert compare.draft_limit("peagle", head) == 4
    assert compare.chain_lengths("peagle", [3, 7], 4) == [3]
    why = compare.skipped_chains("peagle", [3, 7], 4)
    assert list(why) == [7] and "the positions it was trained to fill" in why[7]
    assert compare.regime_note("peagle", 3, 4) is None


def test_table_lists_runs_not_made_and_row_notes():
    vllm, infer = _results()
    rows = [{**r, "note": "off the training regime" if r["run"] == "eagle3" else None} for r in table_rows(vllm, infer)]
    table = format_table(rows, k=8, batch=8, skipped={"dflash": "K=8 > block_size - 1 = 7"})
    assert "| dflash | not run | - |" in table
    assert "- dflash: not run: K=8 > block_size - 1 = 7" in table
    assert "- eagle3: off the training regime" in table
    assert format_table(rows[:1], k=3, batch=8).count("\n") == 3  # no notes: header, rule, one row


def test_every_format_runs_every_k_at_any_batch(tmp_path):
    """Several K in one run (K = 2..8) and any --batch, for every format: each export gets one run per
    K it can draft (Medusa: the largest), named NAME-kK."""
    python = tmp_path / "python"
    python.touch()
    args = parse_args(["--vllm-python", str(python), "--k", *map(str, range(2, 9)), "--batch", "1"])
    assert args.k == list(range(2, 9)) and args.batch == 1
    exports = {fmt: tmp_path / fmt for fmt in compare.FORMATS}
    runs = {r["name"] for r in compare.vllm_runs(exports, [], args.k, {"dflash": 7})}
    for fmt, (family, _, _) in compare.FORMATS.items():
        expected = {8} if family == "medusa" else set(range(2, 8 if family == "dflash" else 9))
        assert {k for k in range(2, 9) if f"{fmt}-k{k}" in runs} == expected, fmt


def test_heads_trained_elsewhere_run_as_they_are_in_vllm(tmp_path):
    """--given NAME=DIR: a speculators eagle3 directory goes to vLLM unexported, at every K; a name
    that is taken, a missing directory or another kind of head is one line."""
    python = tmp_path / "python"
    python.touch()
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    args = parse_args(["--vllm-python", str(python), "--k", "2", "3", "--given", f"peer={peer}"])
    assert args.given == {"peer": peer.resolve()}
    runs = {r["name"]: r["speculative_config"] for r in compare.vllm_runs({}, [], args.k, given=args.given)}
    assert runs["peer-k2"] == {"method": "eagle3", "model": str(peer.resolve()), "num_speculative_tokens": 2}
    assert runs["peer-k3"]["num_speculative_tokens"] == 3 and "plain" in runs
    for bad, why in [
        (f"eagle3={peer}", "new NAME"),
        (f"medusa={peer}", "new NAME"),
        (str(peer), "NAME=DIR"),
        (f"x={tmp_path / 'none'}", "does not exist"),
    ]:
        with pytest.raises(SpecHeadsError, match=why):
            parse_args(["--vllm-python", str(python), "--given", bad])
    (peer / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
    with pytest.raises(SpecHeadsError, match="eagle3 head is expected"):
        parse_args(["--vllm-python", str(python), "--given", f"peer={peer}"])
