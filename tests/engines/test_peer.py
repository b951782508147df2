"""engines/peer.py: the peer trainer's data is our trainer's rows, order and states.

Always run (no vLLM needed): the schedule against the rows the Trainer itself fetches at each step,
the hidden states against a transformers forward, the data directory as speculators reads it, each
kept result reused only for the settings that made it, the split ratio's arithmetic (speculators'
int(rows x ratio)) over many row counts and the refusal of a split cut elsewhere. With the `engines`
marker and vLLM's virtualenv: speculators' own entry point, through engines/peer_train.py, on a data
directory peer.py wrote, yields our schedule step by step (tests/engines/peer_sampler.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_other_numbers, assert_same_numbers, write_conversations

from specheads.config.model import ModelConfig
from specheads.config.train import DataConfig, HeadConfig, TrainConfig, TrainJobConfig, WandbConfig
from specheads.train.run import head_and_states
from specheads.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"engines_{name}", ROOT / "engines" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer, peer_train = load("peer"), load("peer_train")
from compare import root_cause  # noqa: E402  (engines/, on the path once peer.py is loaded)

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = [1, 3, 5]  # the tiny target's stand-ins for 2, 15, 27


def job(data, out, **train):
    return TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family="eagle3", layer_ids=LAYERS, draft_vocab_size=96, ttt_steps=2),
        data=DataConfig(path=str(data), max_length=64, eval_fraction=0.25, pack=True),
        train=TrainConfig(**{"lr": 1e-3, "warmup_steps": 1, "batch_size": 2, "max_steps": 4, **train}),
        wandb=WandbConfig(mode="disabled"),
        output_dir=str(out),
    )


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_schedule_is_what_the_trainer_reads_at_each_step(world, tiny_target, tmp_path, grad_accum):
    """Each step's conversations, in order, are those the Trainer fetches (packed rows unpacked)."""
    data = write_conversations(tmp_path / "chats.jsonl", n=40)
    cfg = job(data, tmp_path / "run", grad_accum=grad_accum)
    head, source = head_and_states(cfg, tiny_target, world)
    trainer = Trainer(cfg, head, source, world, tmp_path / "run")
    fetched, fetch_packed = [], source.fetch_packed

    def recording(split, packs):
        fetched.append([i for pack in packs for i in pack])
        return fetch_packed(split, packs)

    source.fetch_packed = recording
    read = []
    for _ in range(cfg.train.max_steps):
        trainer.train_step()
        read.append([i for micro in fetched for i in micro])
        fetched.clear()
    schedule = peer.step_schedule(cfg, source.rows("train"))
    assert schedule == read
    assert len({i for step in schedule for i in step}) > len(schedule[0])  # steps read other rows


def transformers_states(target, ids, layers):
    """[T, n + 1, H] from transformers itself: hidden_states[k] enters layer k; the last layer's
    output before the final norm is the norm's input."""
    model = target.model
    seen = {}
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: seen.setdefault("last", args[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([*(out.hidden_states[k][0] for k in layers), seen["last"][0]], dim=1)


def test_the_peers_hidden_states_are_the_targets_forward(tiny_target, monkeypatch):
    monkeypatch.setattr(peer, "LAYERS", LAYERS)
    ids = list(range(30, 70))
    ours = peer.peer_states(tiny_target, ids)
    assert ours.shape == (len(ids), 4, tiny_target.info.hidden_size)
    assert_same_numbers(ours, transformers_states(tiny_target, ids, LAYERS))
    # one layer off, or the final state after the norm, is another tensor: the check can fail
    assert_other_numbers(ours, transformers_states(tiny_target, ids, [k + 1 for k in LAYERS]))
    with torch.no_grad():
        after_norm = tiny_target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert_other_numbers(ours[:, 3], after_norm)


def comparison_rows(world, tiny_target, tmp_path, monkeypatch, eval_rows: int):
    """(train rows, held-out rows, schedule, head) of a small comparison on the tiny target."""
    monkeypatch.setattr(peer, "LAYERS", LAYERS)
    cfg = job(write_conversations(tmp_path / "chats.jsonl", n=40), tmp_path / "run")
    head, source = head_and_states(cfg, tiny_target, world)
    train_rows = source.rows("train")
    return train_rows, list(source.rows("eval"))[:eval_rows], peer.step_schedule(cfg, train_rows), head


def test_the_data_directory_is_what_speculators_reads(world, tiny_target, tmp_path, monkeypatch):
    """The Arrow rows are our rows (train first, then the held-out ones), every scheduled and held-out
    conversation has its states file, the vocabulary maps are the head's."""
    from datasets import load_from_disk
    from safetensors.torch import load_file, save_file

    train_rows, eval_rows, schedule, head = comparison_rows(world, tiny_target, tmp_path, monkeypatch, 3)
    summary = peer.write_peer_data(tmp_path / "data", tiny_target, train_rows, eval_rows, schedule, head)
    arrow = load_from_disk(str(tmp_path / "data"))
    assert arrow.format["type"] == "torch"  # as speculators reads it
    arrow = arrow.with_format(None)
    assert len(arrow) == len(train_rows) + 3 == summary["rows"]
    for i, row in enumerate([*train_rows, *eval_rows]):
        assert arrow[i]["input_ids"] == list(row["input_ids"]) and arrow[i]["loss_mask"] == list(row["loss_mask"])
        assert arrow[i]["seq_len"] == len(row["input_ids"])
    written = {int(p.stem[3:]) for p in (tmp_path / "data" / "hidden_states").glob("hs_*.safetensors")}
    assert written == {i for step in schedule for i in step} | set(range(len(train_rows), len(train_rows) + 3))
    first = schedule[0][0]
    states = load_file(str(tmp_path / "data" / "hidden_states" / f"hs_{first}.safetensors"))
    assert states["token_ids"].tolist() == list(train_rows[first]["input_ids"])
    assert_same_numbers(states["hidden_states"], peer.peer_states(tiny_target, list(train_rows[first]["input_ids"])))
    import numpy as np

    assert np.array_equal(np.load(tmp_path / "data" / "d2t.npy"), head.d2t.numpy())
    assert np.array_equal(np.load(tmp_path / "data" / "t2d.npy"), head.t2d.numpy())
    plan = json.loads((tmp_path / "data" / "schedule.json").read_text())
    assert plan == {"train_rows": len(train_rows), "rows": len(train_rows) + 3, "batches": schedule}

    # an interrupted run resumes: whole files of the same tokens are kept, a cut or foreign one redone
    states_dir = tmp_path / "data" / "hidden_states"
    cut, other = sorted(written)[:2]
    (states_dir / f"hs_{cut}.safetensors").write_bytes((states_dir / f"hs_{cut}.safetensors").read_bytes()[:100])
    foreign = {"hidden_states": torch.zeros(1, 4, 8), "token_ids": torch.tensor([7])}
    save_file(foreign, str(states_dir / f"hs_{other}.safetensors"))
    kept = {p.name: p.stat().st_mtime_ns for p in states_dir.iterdir() if int(p.stem[3:]) not in (cut, other)}
    calls = []
    real = peer.peer_states
    monkeypatch.setattr(peer, "peer_states", lambda t, ids: calls.append(ids) or real(t, ids))
    peer.write_peer_data(tmp_path / "data", tiny_target, train_rows, eval_rows, schedule, head)
    assert sorted(map(tuple, calls)) == sorted(tuple(train_or_eval(train_rows, eval_rows, i)) for i in (cut, other))
    assert {p.name: p.stat().st_mtime_ns for p in states_dir.iterdir() if p.name in kept} == kept
    for i in (cut, other):
        redone = load_file(str(states_dir / f"hs_{i}.safetensors"))
        assert redone["token_ids"].tolist() == train_or_eval(train_rows, eval_rows, i)


def test_another_seeds_hidden_states_are_linked_not_written_again(world, tiny_target, tmp_path, monkeypatch):
    """A second seed on the same rows writes no states: each file is the first seed's (one inode);
    a file of other tokens there is not taken."""
    from safetensors.torch import save_file

    train_rows, eval_rows, schedule, head = comparison_rows(world, tiny_target, tmp_path, monkeypatch, 2)
    first = tmp_path / "seed-0" / "data"
    peer.write_peer_data(first, tiny_target, train_rows, eval_rows, schedule, head)
    files = sorted((first / "hidden_states").glob("hs_*.safetensors"))
    foreign = files[0]
    save_file({"hidden_states": torch.zeros(1, 4, 8), "token_ids": torch.tensor([7])}, str(foreign))
    calls = []
    real = peer.peer_states
    monkeypatch.setattr(peer, "peer_states", lambda t, ids: calls.append(ids) or real(t, ids))
    second = tmp_path / "seed-1" / "data"
    shared = [first / "hidden_states"]
    peer.write_peer_data(second, tiny_target, train_rows, eval_rows, schedule, head, shared=shared)
    assert len(calls) == 1  # only the conversation whose first-seed file holds other tokens
    for f in files:
        twin = second / "hidden_states" / f.name
        assert twin.samefile(f) == (f != foreign)
        assert peer.states_written(twin, train_or_eval(train_rows, eval_rows, int(f.stem[3:])))


def train_or_eval(train_rows, eval_rows, i: int) -> list[int]:
    return list([*train_rows, *eval_rows][i]["input_ids"])


def test_the_report_tables_and_plots_every_head_seed_and_question_set(tmp_path):
    def head(base):
        return {
            "chain_tau": {str(k): base + 0.01 * k for k in range(1, 9)},
            "best_tree_tau": {"5": base + 0.2, "16": base + 0.3},
            "per_category": {"qa": {"chain_3_tau": base + 0.03}},
        }

    results = {
        "unmatched": peer.unmatched([]),
        "steps": 10,
        "runs": {str(seed): {"replay": {"mt": {"ours": head(1.2 + seed / 10), "peer": head(1.1)}}} for seed in (0, 1)},
    }
    row = {
        "identical": [8, 8],
        "vllm_acceptance": {"mean_acceptance_length": 1.98, "per_position": [0.58, 0.26, 0.14]},
        "infer_acceptance": {"mean_acceptance_length": 1.95, "per_position": [0.57, 0.25, 0.13]},
        "agree": True,
    }
    kept = {**row, "vllm_acceptance": {**row["vllm_acceptance"], "kept_acceptance_length": 1.96}}
    results["runs"]["1"]["vllm"] = {"ours": kept, "peer": row}
    peer.write_report(results, tmp_path)
    table = (tmp_path / "peer.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| mt |") and "| qa |" not in line]
    assert len(rows) == 4 and "| mt | 1 | ours | 1.310 |" in table and "| 1.400 | 1.500 |" in table
    assert all(why in table for _, why in peer.UNMATCHED)
    assert "| 1 | peer | 1.98 | 0.58 0.26 0.14 | 1.95 | 8/8 |" in table and "| 0 | ours | 1.98" not in table
    # parity: ours 1.23 and 1.33 (mean 1.28, spread 0.10) against the peer's 1.13; vLLM with one seed
    assert "| mt chain 3 | 2 | 1.280 | 1.130 | 0.100 | 1.133 | yes |" in table
    assert "| 1 | ours | 1.98 (1.96 kept) |" in table
    assert "| vLLM acceptance length | 1 | 1.960 | 1.980 | 0.000 | 0.990 | no |" in table
    assert "| mt | qa | 2 | 1.280 | 1.130 | 1.133 | yes |" in table and "mt: ahead by 5% in 1 of 1 categories" in table
    assert json.loads((tmp_path / "peer.json").read_text()) == results
    assert (tmp_path / "peer.png").stat().st_size > 0 and (tmp_path / "peer_categories.png").stat().st_size > 0


def test_parity_allows_the_peer_ahead_by_no_more_than_the_spread_of_our_seeds():
    def run(ours, theirs, kept=None):
        accepted = {"mean_acceptance_length": 9.0, "kept_acceptance_length": kept}
        vllm = {"ours": {"vllm_acceptance": accepted}, "peer": {"vllm_acceptance": accepted}} if kept else {}
        heads = {"ours": {"chain_tau": {"3": ours}}, "peer": {"chain_tau": {"3": theirs}}}
        return {"replay": {"mt": heads}, "vllm": vllm}

    close = peer.parity({"runs": {"0": run(1.40, 1.45, kept=1.5), "1": run(1.46, 1.45, kept=1.5)}})
    assert [(r["measure"], r["holds"]) for r in close] == [("mt chain 3", True), ("vLLM acceptance length", True)]
    assert close[0]["spread"] == pytest.approx(0.06) and close[1]["ours"] == 1.5  # kept, not counted (9.0)
    behind = peer.parity({"runs": {"0": run(1.40, 1.48), "1": run(1.42, 1.47)}})
    assert [r["holds"] for r in behind] == [False]  # 1.41 < 1.475 - 0.02
    assert peer.parity({"runs": {"0": run(1.2, 1.1)}})[0] == {
        "measure": "mt chain 3", "seeds": 1, "ours": 1.2, "peer": 1.1, "spread": 0.0, "holds": True
    }  # fmt: skip


def test_a_category_counts_as_ahead_only_when_ours_leads_by_five_percent():
    def run(ours, theirs):  # {category: chain-3 tau}
        per = {n: {"per_category": {c: {"chain_3_tau": t} for c, t in taus.items()}} for n, taus in
               (("ours", ours), ("peer", theirs))}  # fmt: skip
        return {"replay": {"sb": per}}

    rows = peer.per_category(
        {"runs": {"0": run({"qa": 1.30, "rag": 1.20}, {"qa": 1.20, "rag": 1.20}),
                  "1": run({"qa": 1.24, "rag": 1.30}, {"qa": 1.22, "rag": 1.20})}}
    )  # fmt: skip
    by = {r["category"]: r for r in rows}
    # qa: 1.27 against 1.21, +4.96%: not ahead; rag: 1.25 against 1.20, +4.2%: not ahead
    assert by["qa"]["ours"] == pytest.approx(1.27) and by["qa"]["peer"] == pytest.approx(1.21)
    assert not by["qa"]["ahead"] and not by["rag"]["ahead"] and by["qa"]["seeds"] == 2
    assert peer.per_category({"runs": {"0": run({"qa": 1.271}, {"qa": 1.21})}})[0]["ahead"]  # +5.04%
    assert peer.per_category({"runs": {"0": {"replay": {"mt": {"ours": {}, "peer": {}}}}}}) == []


@pytest.mark.parametrize("concurrent", [False, True])
def test_ours_trains_beside_the_peer_only_when_asked_and_its_failure_is_one_line(
    tmp_path, monkeypatch, capsys, concurrent
):
    """--concurrent: train.py runs while the peer's data is written and the peer trains (each on half
    the cores), and the comparison waits for it; without it, ours has finished before the peer starts."""
    import threading

    from specheads.errors import SpecHeadsError

    events, peer_started = [], threading.Event()
    python = tmp_path / "python"
    python.touch()
    monkeypatch.setattr(peer, "VLLM_PYTHON", python)
    monkeypatch.setattr(
        peer, "peer_data", lambda args, seed, out: events.append("data") or {"rows": 1, "train_rows": 1}
    )
    monkeypatch.setattr(peer, "peer_command", lambda *a: ["peer"])

    def fake_run(what, cmd, log, env=None):
        if what == "train.py":
            if concurrent:  # still running when the peer starts: both at once
                assert peer_started.wait(timeout=30)
            assert env.get("OMP_NUM_THREADS") == (str(max(1, os.cpu_count() // 2)) if concurrent else None)
            if fail:
                raise SpecHeadsError("train.py failed (boom); log: x")
            (log.parent / "ours" / "head").mkdir(parents=True)
            (log.parent / "ours" / "head" / "config.json").write_text("{}")
            events.append("ours")
        else:
            peer_started.set()
            events.append("peer")
            (log.parent / "peer" / "0").mkdir(parents=True)
            (log.parent / "peer" / "0" / "config.json").write_text("{}")

    monkeypatch.setattr(peer, "run_logged", fake_run)
    threads = torch.get_num_threads()
    try:
        fail = False
        argv = ["--steps", "2", "--seeds", "0", "--vllm-k", "0", "--out", str(tmp_path / "ok")]
        argv += ["--concurrent"] if concurrent else []
        assert peer.main(argv) == 0
        assert events == (["data", "peer", "ours"] if concurrent else ["ours", "data", "peer"])
        assert json.loads((tmp_path / "ok" / "peer.json").read_text())["runs"]["0"]["heads"]["peer"].endswith("0")
        fail, events[:] = True, []
        peer_started.clear()
        argv[argv.index("--out") + 1] = str(tmp_path / "bad")
        with pytest.raises(SystemExit) as exited:
            peer.main(argv)
        assert exited.value.code == 2 and ("peer" in events) == concurrent
        assert capsys.readouterr().err.strip().splitlines()[-1] == "error: train.py failed (boom); log: x"
        assert not (tmp_path / "bad" / "peer.json").exists()
    finally:
        torch.set_num_threads(threads)


class FakeRuns:
    """run_logged for the comparison's four kinds of run, each writing what the real one writes (a
    head, a report) at a clock that only moves forward, and counting what ran; prepare() too."""

    def __init__(self, monkeypatch, tmp_path):
        self.ran, self.tick = [], time.time() + 1000
        python = tmp_path / "python"
        python.touch()
        monkeypatch.setattr(peer, "VLLM_PYTHON", python)
        monkeypatch.setattr(peer, "run_logged", self.run)
        monkeypatch.setattr(peer, "prepare", self.prepare)

    def written(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.tick += 10
        os.utime(path, (self.tick, self.tick))

    def prepare(self, args, seed, out):
        self.ran.append("data")
        self.written(out / "data" / "schedule.json", "{}")
        return {"rows": 108, "train_rows": 100, "states_written": 1, "tokens": 1, "verifier": "v", "max_length": 512}

    def run(self, what, cmd, log, env=None):
        self.ran.append(what)
        value = {c.split("=", 1)[0]: c.split("=", 1)[1] for c in map(str, cmd) if "=" in c}
        if what == "train.py":
            self.written(Path(value["output_dir"]) / "head" / "model.safetensors", "x")
            self.written(Path(value["output_dir"]) / "head" / "config.json", "{}")
        elif what == "the peer's training":
            self.written(Path(cmd[cmd.index("--save-path") + 1]) / "0" / "model.safetensors", "x")
            self.written(Path(cmd[cmd.index("--save-path") + 1]) / "0" / "config.json", "{}")
        elif what == "replay":
            heads = [value["head"], *value["bench.heads"].strip("[]").split(",")]
            scores = {"chain_tau": {str(k): 1.0 + k / 10 for k in range(1, 9)}, "best_tree_tau": {"5": 1.5, "16": 1.6}}
            report = {"max_new_tokens": int(value["bench.max_new_tokens"]),
                      "heads": {Path(h).name: {"head": h, **scores} for h in heads if h}}  # fmt: skip
            self.written(Path(value["bench.output"].removesuffix(".jsonl") + ".replay.json"), json.dumps(report))
        else:
            accepted = {"mean_acceptance_length": 1.5, "per_position": [0.3, 0.1, 0.1]}
            row = {"identical": [8, 8], "vllm_acceptance": accepted, "infer_acceptance": accepted, "agree": True}
            rows = [{"run": run, **row} for run in ("eagle3", "peer")]
            self.written(Path(cmd[cmd.index("--out") + 1]) / "engines.json", json.dumps({"rows": rows}))

    def again(self, argv) -> list[str]:
        """What a run of peer.py with these arguments made again."""
        self.ran.clear()
        assert peer.main(argv) == 0
        return sorted(self.ran)


def test_a_kept_result_is_reused_only_when_every_setting_that_made_it_is_the_same(tmp_path, monkeypatch):
    """Each of ours' head, the peer's data and head, the replay and vLLM's run is made again exactly
    when one of its own settings changed (or what it was made from is newer), and only then."""
    runs = FakeRuns(monkeypatch, tmp_path)
    questions = tmp_path / "mt.jsonl"
    questions.write_text('{"question_id": 1}\n')
    base = ["--steps", "7", "--seeds", "0", "--questions", str(questions), "--out", str(tmp_path / "out")]
    trainers = ["engines/compare.py", "replay", "the peer's training", "train.py"]
    everything = sorted(["data", *trainers])
    assert runs.again(base) == everything
    assert runs.again(base) == []
    made_from = ["data", *trainers]  # ours, and the peer's data, head, and what reads both heads
    for changed in (["--warmup", "5"], ["--lr", "0.001"], ["--steps", "8"], ["head.ttt_decay=0.7"]):
        assert runs.again([*base, *changed]) == sorted(made_from), changed
        assert runs.again([*base, *changed]) == [], changed
    the_peer = sorted(["data", "the peer's training", "replay", "engines/compare.py"])
    assert runs.again([*base, "head.ttt_decay=0.7", "--eval-rows", "4"]) == the_peer  # ours: not its setting
    assert runs.again([*base, "head.ttt_decay=0.7", "--eval-rows", "4", "--vllm-k", "2"]) == ["engines/compare.py"]
    argv = [*base, "head.ttt_decay=0.7", "--eval-rows", "4", "--vllm-k", "2"]
    assert runs.again([*argv, "--max-new-tokens", "32"]) == ["replay"]
    questions.write_text('{"question_id": 2}\n')  # the same file name, other questions
    assert runs.again([*argv, "--max-new-tokens", "32"]) == ["replay"]
    assert runs.again([*argv, "--max-new-tokens", "32", "--vllm-k", "0"]) == []
    out = tmp_path / "out" / "seed-0"
    runs.tick += 10
    os.utime(out / "data" / "summary.json", (runs.tick, runs.tick))  # data newer than the peer's head
    argv += ["--max-new-tokens", "32"]
    assert runs.again(argv) == sorted(["the peer's training", "replay", "engines/compare.py"])
    assert runs.again([*argv, "--seeds", "0", "1"]) == everything  # seed 1's; seed 0's kept
    args = SimpleNamespace(steps=7, batch_size=2, lr=5e-4, warmup=10, data_seed=0, overrides=["head.ttt_decay=0.7"])
    assert json.loads((out / "ours" / "settings.json").read_text()) == peer.our_overrides(args, 0)


def test_a_result_made_again_starts_from_nothing(tmp_path, monkeypatch):
    """Both trainers resume from what they find in their directory: a head made again is trained in an
    emptied one; a run that fails leaves no record, so the next run makes it again."""
    runs = FakeRuns(monkeypatch, tmp_path)
    argv = ["--steps", "7", "--seeds", "0", "--vllm-k", "0", "--out", str(tmp_path / "out")]
    runs.again(argv)
    out = tmp_path / "out" / "seed-0"
    for leftover in (out / "ours" / "checkpoints" / "step-3", out / "peer" / "checkpoint"):
        leftover.mkdir(parents=True)
    real = runs.run

    def failing_peer(what, cmd, log, env=None):
        if what == "the peer's training":
            assert not (out / "peer").exists()
            raise peer.SpecHeadsError("the peer's training failed (boom); log: x")
        assert what != "train.py" or not (out / "ours").exists()
        real(what, cmd, log, env)

    monkeypatch.setattr(peer, "run_logged", failing_peer)
    with pytest.raises(SystemExit):
        peer.main([*argv, "--warmup", "3"])
    assert not (out / "peer" / "settings.json").exists() and (out / "ours" / "settings.json").is_file()
    monkeypatch.setattr(peer, "run_logged", runs.run)
    assert runs.again([*argv, "--warmup", "3"]) == ["the peer's training"]


def test_a_replay_is_reused_only_for_the_same_heads_questions_answer_length_and_newer_weights(tmp_path):
    heads = {}
    for name in ("ours", "peer"):
        heads[name] = tmp_path / name
        heads[name].mkdir()
        (heads[name] / "model.safetensors").write_bytes(b"x")
    questions = tmp_path / "mt.jsonl"
    questions.write_text('{"question_id": 1}\n')
    stem = tmp_path / "replay-mt"
    entry = {n: {"head": str(h), "chain_tau": {"3": 1.5}} for n, h in heads.items()}
    Path(f"{stem}.replay.json").write_text(json.dumps({"max_new_tokens": 64, "heads": entry}))
    settings = peer.replay_settings(questions, 64)
    assert peer.replayed(stem, heads, settings) is None  # no record of what made it
    Path(f"{stem}.settings.json").write_text(json.dumps(settings))
    os.utime(f"{stem}.replay.json", (time.time() + 5, time.time() + 5))
    assert peer.replayed(stem, heads, settings) == entry
    assert peer.replayed(stem, {"peer": heads["peer"]}, settings) == {"peer": entry["peer"]}
    assert peer.replayed(stem, heads, peer.replay_settings(questions, 128)) is None
    assert peer.replayed(stem, {**heads, "other": tmp_path}, settings) is None
    questions.write_text('{"question_id": 2}\n')
    assert peer.replayed(stem, heads, peer.replay_settings(questions, 64)) is None
    os.utime(heads["peer"] / "model.safetensors", (time.time() + 10, time.time() + 10))  # retrained since
    assert peer.replayed(stem, heads, settings) is None
    assert peer.replayed(tmp_path / "none", heads, settings) is None


def test_a_difference_is_listed_until_ours_is_given_the_peers_choice():
    assert peer.unmatched([]) == [why for _, why in peer.UNMATCHED]
    left = peer.unmatched(["head.loss_positions=all", "head.freeze_lm_head=true", "data.max_length=256"])
    assert len(left) == 3 and not any(u.startswith(("loss:", "LM head:")) for u in left)


def test_vllms_counters_are_read_for_both_heads_and_kept_until_a_head_or_k_changes(tmp_path, monkeypatch):
    """compare.py runs ours exported and the peer's as given, once: a rerun reads its report until a
    head's weights are newer or K is another; each head's row is the one compare.py wrote under its name."""
    heads = {}
    for name in ("ours", "peer"):
        heads[name] = tmp_path / name
        heads[name].mkdir()
        (heads[name] / "model.safetensors").write_bytes(b"x")
    calls = []

    def fake_run(what, cmd, log, env=None):
        calls.append(cmd)
        rows = [{"run": "plain"}, {"run": "eagle3", "agree": True}, {"run": "peer", "agree": False}]
        (tmp_path / "vllm").mkdir(exist_ok=True)
        (tmp_path / "vllm" / "engines.json").write_text(json.dumps({"rows": rows}))

    monkeypatch.setattr(peer, "run_logged", fake_run)
    got = peer.vllm_acceptance(heads, tmp_path / "vllm", 3)
    assert got["ours"]["agree"] is True and got["peer"]["agree"] is False
    cmd = calls[0]
    assert cmd[cmd.index("--k") + 1] == "3" and cmd[cmd.index("--eagle3-head") + 1] == str(heads["ours"])
    assert cmd[cmd.index("--given") + 1] == f"peer={heads['peer']}" and cmd[cmd.index("--formats") + 1] == "eagle3"
    peer.vllm_acceptance(heads, tmp_path / "vllm", 3)
    assert len(calls) == 1
    os.utime(heads["ours"] / "model.safetensors", (time.time() + 10, time.time() + 10))
    peer.vllm_acceptance(heads, tmp_path / "vllm", 3)
    assert len(calls) == 2
    os.utime(tmp_path / "vllm" / "engines.json", (time.time() + 20, time.time() + 20))
    peer.vllm_acceptance(heads, tmp_path / "vllm", 2)  # another K: run again, not K=3's counters
    assert len(calls) == 3 and calls[2][calls[2].index("--k") + 1] == "2"


def test_a_recipe_trains_ours_only_and_is_replayed_beside_the_peers_kept_report(tmp_path, monkeypatch, capsys):
    """--recipe: ours trains with the matched settings plus the recipe's overrides; the peer's head of
    the comparison is not trained again and its kept replay report is reused, as are the target's
    answers; only ours is replayed. Without a peer head of these settings: one line, exit 2; ours
    kept from other overrides is trained again."""
    runs = FakeRuns(monkeypatch, tmp_path)
    out, questions = tmp_path / "out", tmp_path / "sb.jsonl"
    questions.write_text('{"question_id": 1}\n')
    argv = ["--steps", "7", "--seeds", "0", "--vllm-k", "0", "--questions", str(questions), "--out", str(out)]
    recipe = [*argv, "--recipe", "fast", "train.lr=0.004"]
    with pytest.raises(SystemExit) as exited:
        peer.main(recipe)
    assert exited.value.code == 2 and "no peer head of these settings" in capsys.readouterr().err
    assert runs.ran == []
    runs.again(argv)  # the comparison: the peer's head, its data and its replay report
    with pytest.raises(SystemExit):  # the peer's head of other settings (another warm-up)
        peer.main([*argv, "--warmup", "3", "--recipe", "fast", "train.lr=0.004"])
    assert "no peer head of these settings" in capsys.readouterr().err

    base = out / "seed-0"
    (base / "replay-sb.greedy.jsonl").write_text('{"answers": 1}\n')

    def scores(tau, qa):
        trees = {"5": tau, "16": tau}
        return {"chain_tau": {"3": tau}, "best_tree_tau": trees, "per_category": {"qa": {"chain_3_tau": qa}}}

    kept_report = {"head": str(base / "peer" / "0"), **scores(1.25, 1.20)}
    runs.written(base / "replay-sb.replay.json", json.dumps({"max_new_tokens": 128, "heads": {"0": kept_report}}))
    trained, replayed = [], []

    def training(what, cmd, log, env=None):
        assert what == "train.py"
        trained.append(cmd)
        runs.run(what, cmd, log, env)

    def fake_replay(heads, questions, where, max_new_tokens):
        replayed.append((dict(heads), (where / "replay-sb.greedy.jsonl").read_text()))
        return {"ours": scores(1.40, 1.30)}

    monkeypatch.setattr(peer, "run_logged", training)
    monkeypatch.setattr(peer, "replay", fake_replay)
    assert peer.main(recipe) == 0
    (cmd,) = trained
    seed_dir = out / "recipes" / "fast" / "seed-0"
    args = SimpleNamespace(steps=7, batch_size=2, lr=5e-4, warmup=10, data_seed=0, eval_rows=8, overrides=[])
    assert cmd[2] == f"output_dir={seed_dir / 'ours'}" and cmd[3:] == [*peer.our_overrides(args, 0), "train.lr=0.004"]
    assert replayed == [({"ours": seed_dir / "ours" / "head"}, '{"answers": 1}\n')]  # the peer's report was kept
    table = (out / "recipes" / "fast" / "peer.md").read_text()
    assert table.startswith("ours: the recipe `fast`, the matched settings and train.lr=0.004")
    assert "| sb | qa | 1 | 1.300 | 1.200 | 1.083 | yes |" in table
    assert peer.main(recipe) == 0 and len(trained) == 1  # kept: not trained again
    recipe[-1] = "train.lr=0.003"
    assert peer.main(recipe) == 0 and len(trained) == 2  # ours of other overrides: trained again
    assert trained[1][-1] == "train.lr=0.003"


def speculators_cut(rows: int, ratio: str) -> int:
    """Where speculators 0.9.0 splits a data set of `rows` (speculators.train.data.ArrowDataset), the
    ratio as its command line gives it."""
    return int(rows * float(ratio))


def command_ratio(train_rows: int, rows: int) -> str:
    args = SimpleNamespace(batch_size=2, lr=5e-4, warmup=10)
    data = {"train_rows": train_rows, "rows": rows, "verifier": "v", "max_length": 512}
    cmd = peer.peer_command(args, 0, Path("out"), data)
    return cmd[cmd.index("--train-data-ratio") + 1]


def test_the_ratio_cuts_speculators_split_at_our_training_rows_for_every_row_count():
    for held_out in (1, 2, 3, 8, 100):
        for train in range(1, 20_001):
            ratio = repr(peer.split_ratio(train, train + held_out))
            assert speculators_cut(train + held_out, ratio) == train, (train, held_out)
            assert 0 < float(ratio) < 1  # speculators' own bounds
    for train in (2**31 - 1, 10**12 + 7, 2**50 - 9):
        assert speculators_cut(train + 8, repr(peer.split_ratio(train, train + 8))) == train
    assert speculators_cut(1008, command_ratio(1000, 1008)) == 1000  # the command's own text


def test_the_old_twelve_decimal_ratio_fell_a_row_short_for_about_half_the_counts():
    assert speculators_cut(1008, f"{1000 / 1008:.12f}") == 999
    short = sum(speculators_cut(t + 8, f"{t / (t + 8):.12f}") != t for t in range(1, 20_001))
    assert 0.3 < short / 20_000 < 0.7


def test_a_split_without_held_out_rows_is_refused():
    from specheads.errors import SpecHeadsError

    for train, rows in ((8, 8), (0, 8), (9, 8)):
        with pytest.raises(SpecHeadsError, match="training rows and held-out ones"):
            peer.split_ratio(train, rows)


class Split:
    """speculators' ArrowDataset as peer_train.py reads it: where the split starts, how many rows."""

    def __init__(self, start: int, rows: int):
        self.start_file_idx, self.rows = start, rows

    def __len__(self):
        return self.rows


def test_the_sampler_takes_our_schedule_for_the_training_split_and_refuses_any_other_cut():
    assert peer_train.is_training_split(Split(0, 1000), 1000, 1008) is True
    assert peer_train.is_training_split(Split(1000, 8), 1000, 1008) is False
    for wrong in (Split(0, 999), Split(999, 9), Split(0, 1001), Split(0, 8)):
        with pytest.raises(peer_train.SplitError) as refused:
            peer_train.is_training_split(wrong, 1000, 1008)
        assert "\n" not in str(refused.value) and "does not cut at 1000" in str(refused.value)


def short_by_old_ratio(train_rows: int) -> int:
    """A held-out count at which the old ratio (train / rows to 12 decimals) cut a row short."""
    old = [
        e for e in range(1, 9) if speculators_cut(train_rows + e, f"{train_rows / (train_rows + e):.12f}") < train_rows
    ]
    return old[0]


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_speculators_sampler_yields_our_schedule_step_by_step(world, tiny_target, tmp_path, monkeypatch):
    """peer.py's data directory and command, run by speculators' entry point through peer_train.py:
    the training split is our training rows, its loader yields the schedule's conversations at every
    step (and loads their states), as many steps as the schedule; the held-out rows stay apart."""
    monkeypatch.setattr(peer, "LAYERS", LAYERS)
    cfg = job(write_conversations(tmp_path / "chats.jsonl", n=24), tmp_path / "run")
    head, source = head_and_states(cfg, tiny_target, world)
    train_rows = source.rows("train")
    eval_rows = list(source.rows("eval"))[: short_by_old_ratio(len(train_rows))]  # where the old ratio failed
    schedule = peer.step_schedule(cfg, train_rows)
    summary = peer.write_peer_data(tmp_path / "data", tiny_target, train_rows, eval_rows, schedule, head)
    tiny_target.model.save_pretrained(tmp_path / "verifier")  # as peer.prepare writes it
    tiny_target.tokenizer.save_pretrained(tmp_path / "verifier")
    data = {**summary, "verifier": str(tmp_path / "verifier"), "max_length": cfg.data.max_length}
    args = SimpleNamespace(batch_size=cfg.train.batch_size, lr=cfg.train.lr, warmup=cfg.train.warmup_steps)
    cmd = peer.peer_command(args, 0, tmp_path, data)
    cmd[cmd.index("--draft-vocab-size") + 1] = str(cfg.head.draft_vocab_size)
    done, got = run_probe(cmd, tmp_path / "read.json")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [*train_rows, *eval_rows]
    assert (got["train"]["start"], got["train"]["rows"]) == (0, len(train_rows))
    assert (got["val"]["start"], got["val"]["rows"]) == (len(train_rows), len(eval_rows))
    assert got["train"]["steps"] == len(schedule) == cfg.train.max_steps
    for step, (batch, tokens, ours) in enumerate(zip(got["train"]["batches"], got["train"]["tokens"], schedule)):
        assert batch == ours, f"step {step}"
        packed = [t for i in ours for t in list(rows[i]["input_ids"])[1:]]  # eagle3's shift: each row's first
        assert tokens == packed + [0] * (len(tokens) - len(packed)), f"step {step}"
    assert len(got["train"]["batches"]) == len(schedule)
    assert sorted(i for b in got["val"]["batches"] for i in b) == list(range(len(train_rows), len(rows)))

    # the old ratio, to 12 decimals: its training split is a row short, refused before any step
    cmd[cmd.index("--train-data-ratio") + 1] = f"{len(train_rows) / len(rows):.12f}"
    done, got = run_probe(cmd, tmp_path / "old.json")
    assert done.returncode != 0 and got is None
    why = root_cause(done.stderr.splitlines())  # the peer's failure as run_logged's one line names it
    assert why == (
        f"SplitError: speculators' split holds rows 0-{len(train_rows) - 1} of {len(rows)}, not the schedule's "
        f"0-{len(train_rows)} or {len(train_rows)}-{len(rows)}: --train-data-ratio does not cut at {len(train_rows)}"
    )


def run_probe(cmd: list[str], out: Path):
    """peer_sampler.py on this peer command: (the finished process, what it read or None)."""
    probe = [str(VLLM_PYTHON), str(Path(__file__).with_name("peer_sampler.py")), str(out), *cmd[2:]]
    # not a rank of the test's world of one (its LOCAL_RANK makes speculators ask for an accelerator)
    world_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")
    env = {k: v for k, v in os.environ.items() if k not in world_vars}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    done = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, env=env)
    return done, json.loads(out.read_text()) if out.is_file() else None
