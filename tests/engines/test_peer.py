"""engines/peer.py: the peer trainer's data is our trainer's rows, order and states.

Always run (no vLLM needed): the schedule against the rows the Trainer itself fetches at each step,
the hidden states against a transformers forward, the data directory as speculators reads it. With
the `engines` marker and vLLM's virtualenv: the peer trains on it here (engines/peer_train.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
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
_spec = importlib.util.spec_from_file_location("engines_peer", ROOT / "engines" / "peer.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)

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
    assert plan == {"train_rows": len(train_rows), "batches": schedule}

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


def test_a_head_older_than_its_data_is_refused_not_compared(tmp_path, monkeypatch, capsys):
    """Data written again (other settings) under heads kept from before: one line, nothing trained."""
    python = tmp_path / "python"
    python.touch()
    monkeypatch.setattr(peer, "VLLM_PYTHON", python)
    seed_dir = tmp_path / "out" / "seed-0"
    record = {"training": {"steps": 100, "seed": 0, "batch_size": 2, "lr": 5e-4}}  # ours: these settings
    for head in (seed_dir / "peer" / "0", seed_dir / "ours" / "head"):
        head.mkdir(parents=True)
        (head / "config.json").write_text(json.dumps(record))
        os.utime(head / "config.json", (1e9, 1e9))  # both older than the data: only the peer's is stale

    def rewritten(args, seed, out):  # once: then kept, as for a second run of the same settings
        (out / "data").mkdir(exist_ok=True)
        if not (out / "data" / "summary.json").exists():
            (out / "data" / "summary.json").write_text("{}")
        return {"rows": 1, "train_rows": 1}

    monkeypatch.setattr(peer, "peer_data", rewritten)
    monkeypatch.setattr(peer, "run_logged", lambda *a, **k: pytest.fail("nothing is trained"))
    with pytest.raises(SystemExit) as exited:
        peer.main(["--seeds", "0", "--vllm-k", "0", "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert "was trained before its data was written again" in capsys.readouterr().err
    later = time.time() + 10  # past the clock's tick
    os.utime(seed_dir / "peer" / "0" / "config.json", (later, later))  # a newer peer head is compared
    monkeypatch.setattr(peer, "run_logged", lambda *a, **k: None)
    assert peer.main(["--seeds", "0", "--vllm-k", "0", "--out", str(tmp_path / "out")]) == 0
    with pytest.raises(SystemExit):  # ours, kept from another budget
        peer.main(["--steps", "50", "--seeds", "0", "--vllm-k", "0", "--out", str(tmp_path / "out")])
    assert "ours/head was trained with other settings" in capsys.readouterr().err


def test_a_replay_is_reused_only_for_the_same_heads_answer_length_and_newer_weights(tmp_path):
    heads = {}
    for name in ("ours", "peer"):
        heads[name] = tmp_path / name
        heads[name].mkdir()
        (heads[name] / "model.safetensors").write_bytes(b"x")
    report = tmp_path / "replay-mt.replay.json"
    entry = {n: {"head": str(h), "chain_tau": {"3": 1.5}} for n, h in heads.items()}
    report.write_text(json.dumps({"max_new_tokens": 64, "heads": entry}))
    os.utime(report, (time.time() + 5, time.time() + 5))
    assert peer.replayed(report, heads, 64) == entry
    assert peer.replayed(report, heads, 128) is None
    assert peer.replayed(report, {**heads, "other": tmp_path}, 64) is None
    os.utime(heads["peer"] / "model.safetensors", (time.time() + 10, time.time() + 10))  # retrained since
    assert peer.replayed(report, heads, 64) is None
    assert peer.replayed(tmp_path / "none.json", heads, 64) is None


def test_a_difference_is_listed_until_ours_is_given_the_peers_choice():
    assert peer.unmatched([]) == [why for _, why in peer.UNMATCHED]
    left = peer.unmatched(["head.loss_positions=all", "head.freeze_lm_head=true", "data.max_length=256"])
    assert len(left) == 3 and not any(u.startswith(("loss:", "LM head:")) for u in left)


def test_vllms_counters_are_read_for_both_heads_and_kept_until_a_head_changes(tmp_path, monkeypatch):
    """compare.py runs ours exported and the peer's as given, once: a rerun reads its report until a
    head's weights are newer; each head's row is the one compare.py wrote under its name."""
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


def test_a_recipe_trains_ours_only_and_is_replayed_beside_the_peers_kept_report(tmp_path, monkeypatch, capsys):
    """--recipe: ours trains with the matched settings plus the recipe's overrides; the peer's head of
    the comparison is not trained again and its kept replay report is reused, as are the target's
    answers; only ours is replayed. Without a peer head of these settings, or with ours kept from
    other overrides: one line, exit 2."""
    python = tmp_path / "python"
    python.touch()
    monkeypatch.setattr(peer, "VLLM_PYTHON", python)
    out = tmp_path / "out"
    argv = ["--steps", "7", "--seeds", "0", "--vllm-k", "0", "--questions", str(tmp_path / "sb.jsonl")]
    argv += ["--out", str(out), "--recipe", "fast", "train.lr=0.004"]
    monkeypatch.setattr(peer, "run_logged", lambda *a, **k: pytest.fail("nothing runs without the peer's head"))
    with pytest.raises(SystemExit) as exited:
        peer.main(argv)
    assert exited.value.code == 2 and "no peer head of these settings" in capsys.readouterr().err

    args = SimpleNamespace(steps=7, batch_size=2, lr=5e-4, warmup=10, data_seed=0, eval_rows=8, overrides=[])
    base = out / "seed-0"
    (base / "peer" / "0").mkdir(parents=True)
    (base / "peer" / "0" / "model.safetensors").write_bytes(b"x")
    (base / "peer" / "0" / "config.json").write_text("{}")
    (base / "data").mkdir()
    (base / "data" / "summary.json").write_text(json.dumps({"settings": peer.data_settings(args, 0), "data": {}}))
    (base / "replay-sb.greedy.jsonl").write_text('{"answers": 1}\n')

    def scores(tau, qa):
        trees = {"5": tau, "16": tau}
        return {"chain_tau": {"3": tau}, "best_tree_tau": trees, "per_category": {"qa": {"chain_3_tau": qa}}}

    kept_report = {"head": str(base / "peer" / "0"), **scores(1.25, 1.20)}
    report = base / "replay-sb.replay.json"
    report.write_text(json.dumps({"max_new_tokens": 128, "heads": {"0": kept_report}}))
    os.utime(report, (time.time() + 5, time.time() + 5))
    trained, replayed = [], []

    def fake_run(what, cmd, log, env=None):
        assert what == "train.py"
        trained.append(cmd)
        head = Path(cmd[2].removeprefix("output_dir=")) / "head"
        head.mkdir(parents=True)
        (head / "config.json").write_text("{}")

    def fake_replay(heads, questions, where, max_new_tokens):
        replayed.append((dict(heads), (where / "replay-sb.greedy.jsonl").read_text()))
        return {"ours": scores(1.40, 1.30)}

    monkeypatch.setattr(peer, "run_logged", fake_run)
    monkeypatch.setattr(peer, "replay", fake_replay)
    assert peer.main(argv) == 0
    (cmd,) = trained
    recipe = out / "recipes" / "fast" / "seed-0"
    assert cmd[2] == f"output_dir={recipe / 'ours'}" and cmd[3:] == [*peer.our_overrides(args, 0), "train.lr=0.004"]
    assert replayed == [({"ours": recipe / "ours" / "head"}, '{"answers": 1}\n')]  # the peer's report was kept
    table = (out / "recipes" / "fast" / "peer.md").read_text()
    assert table.startswith("ours: the recipe `fast`, the matched settings and train.lr=0.004")
    assert "| sb | qa | 1 | 1.300 | 1.200 | 1.083 | yes |" in table
    assert peer.main(argv) == 0 and len(trained) == 1  # kept: not trained again
    argv[-1] = "train.lr=0.003"
    with pytest.raises(SystemExit):
        peer.main(argv)
    assert "ours/head was trained with other settings" in capsys.readouterr().err
