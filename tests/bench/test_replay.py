"""bench.mode=replay: the replayed count of target forwards must be the real loop's, for chains and
trees, and the command must write its report and reuse the target's answers."""

import io
import json
import random
import shutil

import pytest
import torch
from conftest import fails_for_some_seed, quick_head, write_questions
from test_infer import CONF, run_infer

from specheads.bench.replay import (
    MISS,
    Replay,
    acceptance_per_depth,
    accepted_length,
    outside_draft_vocab,
    rank_vectors,
    replay,
    tau,
    trained,
    training_curves,
)
from specheads.bench.runner import output_paths
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.tree import chain_paths, static_tree

pytestmark = pytest.mark.usefixtures("one_thread")

TREES = {
    "chain-1": chain_paths(1),
    "chain-3": chain_paths(3),
    "wide": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]],
}


def test_accepted_length_is_the_longest_prefix_in_the_tree():
    tree = frozenset(tuple(p) for p in TREES["wide"])
    assert accepted_length((0, 0, 0, 0, 0), tree, cap=9) == 4
    assert accepted_length((0, 0, 0, 0, 0), tree, cap=2) == 2  # the loop's depth limit near max_new_tokens
    assert accepted_length((0, 1, 0), tree, cap=9) == 2
    assert accepted_length((1, 1), tree, cap=9) == 1
    assert accepted_length((3, 0), tree, cap=9) == 0
    assert accepted_length((0, MISS), tree, cap=9) == 1
    assert accepted_length((), tree, cap=9) == 0


def test_replay_walks_from_each_bonus_token():
    # roots 0..5 of a 7-token answer; from root 0 two drafts are right, then the bonus token 3 roots
    vectors = [(0, 0, 1), (5,), (5,), (0, 0, 0), (9,), (9,), ()]
    r = replay(vectors[:6], chain_paths(3), answer_len=7, max_new_tokens=100)
    assert r == Replay(forwards=2, tokens=6, accepted=(2, 3))  # root 0 -> 3, whose 3 drafts end the answer
    assert tau([r]) == 3.0
    assert acceptance_per_depth([r], 3) == [1.0, 1.0, 0.5]
    with pytest.raises(ValueError):
        replay(vectors[:2], chain_paths(3), answer_len=7, max_new_tokens=100)


@pytest.fixture(scope="module")
def heads(tiny_target, sequences):
    return {family: quick_head(tiny_target, family, sequences, steps=60) for family in ("eagle3", "medusa", "hydra")}


def loop_and_replay(target, head, prompt, paths, max_new_tokens, replay_fn):
    res = speculative_generate(
        target, make_drafter(head, static_tree(paths)), prompt, SamplingConfig(max_new_tokens=max_new_tokens)
    )
    depth = max(len(p) for p in paths)
    vectors = rank_vectors(target, head, prompt[0].tolist() + res.output_ids, prompt.shape[1], depth)
    return res, replay_fn(vectors, paths, len(res.output_ids), max_new_tokens)


def check_against_the_loop(target, heads, sequences, replay_fn, seed):
    """One random (head, prompt, tree, token limit): the replay counts the loop's forwards and steps."""
    rng = random.Random(seed)
    family = rng.choice(sorted(heads))
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
    if seed % 2:  # half the prompts start on the text the heads were fitted on: long accepted runs
        prompt = sequences[seed % 8 : seed % 8 + 1, :8]
    name = rng.choice(sorted(TREES))
    n = rng.choice([9, 16, 31])
    res, r = loop_and_replay(target, heads[family], prompt, TREES[name], n, replay_fn)
    where = f"{family} {name} max_new_tokens={n} seed={seed}"
    assert r.forwards == res.target_forwards, where
    assert list(r.accepted) == res.accepted_drafts, where
    assert r.tokens == len(res.output_ids) - 1, where
    return sum(res.accepted_drafts)


def test_replay_counts_what_the_loop_does(tiny_target, heads, sequences):
    """Two implementations agree on 24 random cases, and the check can fail (a walk that restarts
    at the last accepted draft instead of the bonus token; one that ignores the depth limit)."""
    accepted = [check_against_the_loop(tiny_target, heads, sequences, replay, seed) for seed in range(24)]
    assert sum(a > 0 for a in accepted) >= 8  # most cases accepted drafts: the walk was exercised

    def no_bonus(vectors, paths, answer_len, max_new_tokens):
        tree, i, acc = frozenset(tuple(p) for p in paths), 0, []
        while i < answer_len - 1:
            k = accepted_length(vectors[i], tree, max_new_tokens)
            acc.append(k)
            i += max(k, 1)
        return Replay(len(acc), answer_len - 1, tuple(acc))

    def no_cap(vectors, paths, answer_len, max_new_tokens):
        return replay(vectors, paths, answer_len, max_new_tokens=10**6)

    check = lambda variant, seed: check_against_the_loop(tiny_target, heads, sequences, variant, seed)  # noqa: E731
    assert fails_for_some_seed(check, no_bonus, range(24))
    assert fails_for_some_seed(check, no_cap, range(24))


def test_outside_draft_vocab_is_the_share_of_next_tokens_the_head_cannot_draft(tiny_target, heads):
    assert outside_draft_vocab([(MISS,), (0, MISS), (), (2,)]) == pytest.approx(1 / 3)  # () roots nothing
    assert outside_draft_vocab([]) == 0.0
    head = heads["eagle3"]  # a draft vocabulary of 200 of the target's tokens
    drafts = set(head.draft_to_target(torch.arange(head.d2t.shape[0])).tolist())
    ids = torch.randint(0, tiny_target.info.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    vectors = rank_vectors(tiny_target, head, ids, answer_start=6, depth=3)
    plain = [ids[t + 2] not in drafts for t in range(5, len(ids) - 2)]  # each root's next token
    assert 0 < sum(plain) < len(plain) and outside_draft_vocab(vectors) == pytest.approx(sum(plain) / len(plain))


def test_infer_replay_writes_the_report_and_reuses_answers(head_dir, tmp_path):
    questions = tmp_path / "question.jsonl"
    write_questions(questions, ["Tell me about cats.", "Count to five."], ("writing", "math"), later_turns=("More.",))
    out = tmp_path / "bench" / "out.jsonl"
    checkpoint = tmp_path / "checkpoint"  # the same run's head again: two points along its training
    shutil.copytree(head_dir, checkpoint)
    args = [
        f"head={head_dir}",
        f"bench.heads=[{checkpoint}]",
        f"bench.questions={questions}",
        f"bench.output={out}",
        "bench.mode=replay",
        "bench.turns=all",
        "bench.max_new_tokens=12",
        "tree=static",
        "tree.paths=[[0],[1],[0,0]]",
    ]
    proc = run_infer(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.with_name("out.replay.json").read_text())
    assert report["answers"] == 4 and report["turns"] == "all"
    label, _ = report["heads"]
    r = report["heads"][label]
    assert r["trained"]["steps"] > 0 and r["trained"] == report["heads"]["checkpoint"]["trained"]
    # the same weights as a bench.heads entry draft as the session's head does (precision, kernels)
    assert report["heads"]["checkpoint"]["head_dtype"] == r["head_dtype"]
    assert report["heads"]["checkpoint"]["chain_tau"] == r["chain_tau"]
    assert report["heads"]["checkpoint"]["best_tree_tau"] == r["best_tree_tau"]
    assert out.with_name("out.replay_training.png").is_file()
    assert set(r["chain_tau"]) == {str(k) for k in range(1, 9)} and r["tree"]["nodes"] == 3
    assert set(r["per_category"]) == {"writing", "math"}
    assert all(0 <= c["outside_draft_vocab"] <= 1 for c in r["per_category"].values())
    assert all(1.0 <= t <= 12 for t in r["chain_tau"].values())
    assert out.with_name("out.replay.png").is_file() and not out.exists()  # no timed rows were written
    answers = [json.loads(line) for line in output_paths(out)["answers"].read_text().splitlines()]
    assert [a["turn"] for a in answers] == [1, 2, 1, 2]
    # the second run reads the answers back: nothing is generated, the same report comes out
    from specheads.bench import replay as replay_module
    from specheads.bench.session import load_session
    from specheads.config.infer import BenchConfig, InferJobConfig, TreeConfig

    settings = InferJobConfig(
        head_path=str(head_dir),
        tree=TreeConfig(kind="static", paths=[[0], [1], [0, 0]]),
        bench=BenchConfig(mode="replay", questions=str(questions), output=str(out), turns="all", max_new_tokens=12),
    )
    session = load_session(settings, CONF)
    calls = []
    original = replay_module.speculative_generate
    replay_module.speculative_generate = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        again = replay_module.run_replay(settings, session, out=io.StringIO())
    finally:
        replay_module.speculative_generate = original
    assert calls == [] and again["heads"][label]["chain_tau"] == r["chain_tau"]
    # a run on fewer questions keeps the answers it did not ask in the file
    settings.bench.limit = 1
    assert replay_module.run_replay(settings, session, out=io.StringIO())["answers"] == 2
    assert len(output_paths(out)["answers"].read_text().splitlines()) == 4


def test_training_curves_group_checkpoints_by_their_run():
    def head(steps, chain, tree, command="train.py a", batch=4):
        record = {"steps": steps, "batch_size": batch, "grad_accum": 2, "world_size": 1, "command": command}
        return {"chain_tau": {"3": chain}, "best_tree_tau": {"5": tree}, "trained": trained(record)}

    heads = {
        "step-800": head(800, 1.4, 1.6),
        "run-a": head(1200, 1.5, 1.7),
        "step-400": head(400, 1.3, 1.5),
        "other": head(100, 1.2, 1.3, command="train.py b", batch=8),
        "exported": {"chain_tau": {"3": 1.1}, "best_tree_tau": {"5": 1.2}},  # no training record
    }
    assert training_curves(heads) == {
        "run-a": [(3200, 1.3, 1.5), (6400, 1.4, 1.6), (9600, 1.5, 1.7)],
        "other": [(1600, 1.2, 1.3)],
    }


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["bench.mode=fast"], "bench.mode must be one of"),
        (["bench.mode=replay", "temperature=0.7"], "greedy"),
    ],
)
def test_replay_settings_are_checked(tmp_path, overrides, message):
    questions = write_questions(tmp_path / "q.jsonl", ["hi"])
    proc = run_infer("head=/tmp", f"bench.questions={questions}", *overrides)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1]
