"""train.on_policy (specheads/train/on_policy.py): Draft-OPD for EAGLE-3. The states trained on are
the head's own drafts from the positions where verification rejected it, the teacher there is the
frozen target, the rejection positions are speculative_generate's, a run with the stage trains a
head that decodes losslessly, and a run without it trains bit for bit as before. Each check is shown
failing on a wrong variant."""

import copy
import json

import pytest
import torch
from conftest import assert_other_numbers, assert_same_numbers, head_states, hf_greedy, quick_head, write_conversations
from test_run import tiny_job

from specheads.config.train import HeadConfig, OnPolicyConfig, TrainConfig, TrainJobConfig
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.errors import SpecHeadsError
from specheads.heads.io import load_head
from specheads.heads.objectives import LOSS_FNS, position_loss
from specheads.train import on_policy as op
from specheads.train import run
from specheads.train.state_source import OnlineStates

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3  # draft_steps: one more than the quick head's ttt_steps (its rollout chain), so the unroll goes past training


@pytest.fixture(scope="module")
def head(tiny_target, sequences):
    """An EAGLE-3 head overfitted a little on the target's greedy text: some drafts accepted, many rejected."""
    return quick_head(tiny_target, "eagle3", sequences, steps=30)


@pytest.fixture(scope="module")
def rollouts(head, tiny_target, sequences):
    """Greedy rollouts of 32 tokens from three 8-token prompts."""
    cfg = SamplingConfig(max_new_tokens=32)
    return [op.rollout(head, tiny_target, sequences[i, :8].tolist(), cfg) for i in range(3)]


def drafted_span(row):
    """(r, k): the row's first drafted position and how many tokens the head drafted there."""
    mask = row["loss_mask"]
    return mask.index(1), sum(mask)


def check_own_drafts(head, target, rows):
    """Every drafted token of a row is the head's own top-1 at that state: its unrolled chain from
    the root r - 1 (fed the drafted tokens before it and its own outputs) argmaxes to it."""
    for row in rows:
        r, k = drafted_span(row)
        ids = torch.tensor([row["input_ids"]])
        states = head_states(target, head, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        logits = head.teacher_forced_logits(ids, states, k)
        for j in range(k):
            assert int(head.draft_to_target(logits[j][0, r - 2].argmax())) == row["input_ids"][r + j], (r, j)


def test_the_states_trained_on_are_the_heads_own_drafts(head, tiny_target, rollouts, monkeypatch):
    rows = [row for ro in rollouts for row in op.replay_rows(head, tiny_target, ro, STEPS)]
    assert len(rows) > 10 and all(drafted_span(row)[1] == STEPS for row in rows)
    check_own_drafts(head, tiny_target, rows)
    # the case is one where head and target disagree: the target's own continuation of a prefix is
    # not the head's draft from there
    greedy = [hf_greedy(tiny_target, torch.tensor([row["input_ids"][: drafted_span(row)[0]]]), STEPS) for row in rows]
    assert sum(g != row["input_ids"][-STEPS:] for g, row in zip(greedy, rows)) > len(rows) // 2

    def target_tokens(head, target, sequence, positions, steps):  # the wrong variant: the target's tokens
        return [hf_greedy(target, torch.tensor([list(sequence[:r])]), steps) for r in positions]

    monkeypatch.setattr(op, "replay_drafts", target_tokens)
    wrong = [row for ro in rollouts for row in op.replay_rows(head, tiny_target, ro, STEPS)]
    with pytest.raises(AssertionError):
        check_own_drafts(head, tiny_target, wrong)


def row_states(head, target, ids):
    return head_states(target, head, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_the_teacher_is_the_frozen_target_at_the_replayed_states(head, tiny_target, rollouts, loss_fn):
    """Batched and padded, each replayed step's teacher logits are a plain target forward's over the
    row (prefix + the head's drafted tokens) at r - 1 + j, the student's are the head's draft there,
    and the loss is head.loss_fn between them; a teacher read off the target's own continuation
    (the rollout's tokens) is not it."""
    head = copy.deepcopy(head).attach(tiny_target)
    head.spec.loss_fn = loss_fn
    pairs = [(row, ro.sequence) for ro in rollouts for row in op.replay_rows(head, tiny_target, ro, STEPS)][:12]
    rows = [row for row, _ in pairs]
    source = OnlineStates(tiny_target, {"x": rows}, tiny_target.tokenizer.pad_token_id)
    source.require(*head.training_states())
    batch, states = source.fetch("x", range(len(rows)))
    assert len(set(len(row["input_ids"]) for row in rows)) > 1  # padding is exercised
    spans = [drafted_span(row) for row in rows]
    alone = [torch.tensor([row["input_ids"]]) for row in rows]
    plain = [tiny_target.model(input_ids=ids).logits[0].float() for ids in alone]
    drafts = [head.teacher_forced_logits(ids, row_states(head, tiny_target, ids), STEPS) for ids in alone]
    expected_loss = 0.0
    for j, (b, t, h, teacher) in enumerate(op.replayed_steps(head, batch, states)):
        assert b.tolist() == list(range(len(rows))) and t.tolist() == [r - 2 for r, _ in spans]
        assert_same_numbers(teacher, torch.stack([plain[i][r - 1 + j] for i, (r, _) in enumerate(spans)]))
        assert_same_numbers(
            head.draft_logits(h), torch.stack([drafts[i][j][0, r - 2] for i, (r, _) in enumerate(spans)])
        )
        p = torch.softmax(teacher[:, head.t2d], -1)
        per = position_loss(loss_fn, p, torch.log_softmax(head.draft_logits(h), -1), head.spec.lk_eta)
        keep = head.t2d[teacher.argmax(-1)]
        expected_loss += head.spec.ttt_decay**j * float((per * keep).sum().detach() / keep.sum().clamp(min=1))
        if j >= 1:  # the wrong teacher: the target on its own rollout, not on the head's drafts
            wrong = [
                tiny_target.model(input_ids=torch.tensor([seq[: r + j]])).logits[0, -1]
                for (r, _), (_, seq) in zip(spans, pairs)
            ]
            assert_other_numbers(teacher, torch.stack(wrong).float())
    loss, _ = op.replay_loss(head, batch, states)
    assert_same_numbers(loss, torch.tensor(expected_loss))


def rejections_from_statistics(prompt_len, res):
    """Where speculative_generate's own statistics say a chain draft was rejected: in forward i the
    root sits at prompt_len + k - 1 (k tokens emitted before it), accepted_drafts[i] of its
    tree_depths[i] drafts were accepted, and the next one (when there is one, and the target's token
    there was emitted) was rejected."""
    k, out = 1, []
    for emitted, accepted, depth in zip(res.accept_lengths, res.accepted_drafts, res.tree_depths):
        if accepted < depth and k + accepted < len(res.output_ids):
            out.append(prompt_len + k + accepted)
        k += emitted
    return out


def check_rejections(head, target, prompts, temperature):
    for seed, prompt in enumerate(prompts):
        cfg = SamplingConfig(max_new_tokens=32, temperature=temperature)
        ro = op.rollout(head, target, prompt, cfg, torch.Generator().manual_seed(seed))
        res = speculative_generate(
            target,
            op.chain_drafter(head, head.spec.ttt_steps),
            torch.tensor([prompt]),
            cfg,
            generator=torch.Generator().manual_seed(seed),
        )
        assert ro.result.output_ids == res.output_ids
        if temperature == 0:  # lossless: the target's own greedy text
            assert res.output_ids == hf_greedy(target, torch.tensor([prompt]), 32)
        expected = rejections_from_statistics(len(prompt), res)
        assert ro.rejections() == expected and len(expected) > 3
        seq = ro.sequence
        for v in ro.verifications:  # before the rejection the drafts are the text, there they are not
            if v.rejection is not None:
                assert v.drafted[: v.accepted] == seq[v.root + 1 : v.rejection]
                assert v.drafted[v.accepted] != seq[v.rejection]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_rejection_positions_are_where_speculative_generate_rejects(
    head, tiny_target, sequences, temperature, monkeypatch
):
    prompts = [sequences[i, :8].tolist() for i in range(3)]
    check_rejections(head, tiny_target, prompts, temperature)
    # the wrong variant: the last accepted position taken for the rejected one
    monkeypatch.setattr(
        op.Verification, "rejection", property(lambda v: v.root + v.accepted if v.accepted < len(v.drafted) else None)
    )
    with pytest.raises(AssertionError):
        check_rejections(head, tiny_target, prompts[:1], temperature)


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def weights_digest(head_dir):
    return json.loads((head_dir / "config.json").read_text())["training"]["trained_weights_sha256"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("opd") / "chats.jsonl", n=16)


def test_a_run_with_the_stage_trains_logs_its_share_and_decodes_losslessly(data, tmp_path, tiny_target, capsys):
    o = OnPolicyConfig(enabled=True, mix=0.5, refresh_every=2, rollouts=2, max_new_tokens=16, draft_steps=STEPS)
    head_dir = run.train(tiny_job(data, tmp_path / "run", max_steps=3, log_every=1, on_policy=o))
    assert "on-policy rollouts (step 2)" in capsys.readouterr().err  # refreshed with the head of step 2
    logged = losses(tmp_path / "run")
    assert [m["train/on_policy_share"] for m in logged] == [0.5] * 3
    assert [m["train/on_policy_row_share"] for m in logged] == [0.5] * 3  # batch_size replayed rows beside batch_size
    for m in logged:
        assert m["train/on_policy_loss"] > 0 and m["train/on_policy_cached_rows"] > 0
        assert 0 <= m["train/rollout_acceptance"] <= 1 and m["train/rollout_tau"] >= 1
        assert m["train/loss"] == pytest.approx(0.5 * m["train/supervised_loss"] + 0.5 * m["train/on_policy_loss"])
    trained = load_head(head_dir, tiny_target)
    for prompt in ([1, 2, 3, 4, 5, 6], [70, 71, 72, 73]):
        ids = torch.tensor([prompt])
        out = speculative_generate(tiny_target, op.chain_drafter(trained, 4), ids, SamplingConfig(max_new_tokens=24))
        assert out.output_ids == hf_greedy(tiny_target, ids, 24)


def test_without_the_stage_a_run_trains_bit_for_bit_as_before(data, tmp_path):
    """enabled=false, whatever the other knobs say, is the run without the block: the same losses and
    the same weights; the stage turned on changes them (so the comparison can fail)."""
    knobs = dict(mix=0.9, refresh_every=1, rollouts=3, max_new_tokens=8, temperature=0.7, draft_steps=2)
    runs = {
        "default": {},
        "disabled": {"on_policy": OnPolicyConfig(enabled=False, **knobs)},
        "enabled": {"on_policy": OnPolicyConfig(enabled=True, **knobs)},
    }
    got = {}
    for name, extra in runs.items():
        head_dir = run.train(tiny_job(data, tmp_path / name, max_steps=3, log_every=1, **extra))
        got[name] = ([m["train/loss"] for m in losses(tmp_path / name)], weights_digest(head_dir))
    assert got["disabled"] == got["default"]
    assert "train/on_policy_share" not in losses(tmp_path / "disabled")[0]
    assert got["enabled"][0] != got["default"][0] and got["enabled"][1] != got["default"][1]


def test_bad_settings_are_refused_in_one_line_before_anything_loads():
    def job(family="eagle3", **o):
        return TrainJobConfig(
            head=HeadConfig(family=family), train=TrainConfig(on_policy=OnPolicyConfig(enabled=True, **o))
        )

    for cfg, match in [
        (job(family="peagle"), "trains head=eagle3 only, got head=peagle"),
        (job(mix=1.5), r"mix must be in \[0, 1\]"),
        (job(refresh_every=0), "refresh_every must be >= 1"),
        (job(temperature=-1.0), "temperature must be >= 0"),
        (job(draft_steps=0), "draft_steps must be >= 1"),
    ]:
        with pytest.raises(SpecHeadsError, match=match):
            run.train(cfg)
    op.check_settings(TrainJobConfig(head=HeadConfig(family="peagle")))  # off: nothing is checked
