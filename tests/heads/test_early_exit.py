"""The early-exit head (Kangaroo): an adapter over the target's layer-L states, read by its LM head.

Training lowers its loss; a fresh head is the target's own logit lens at layer L (with L = every
layer, the target itself); its training-time logits are what it drafts along a path (compared
with the real drafter on the target's cache, and failing for a head whose teacher forcing is one
position off); it saves and loads through the head directory like its siblings, and its config
is refused in one line where it cannot hold. With head.draft_vocab it drafts over the training
answers' most frequent tokens, reading only their rows of the LM head: its logits are the full
ones at those ids, and they follow a reload of other maps. Its loss reads the LM head at the
counted positions only, and equals (with its gradients) the loss over every position, masked."""

import json

import pytest
import torch
from conftest import assert_same_numbers, head_states, loss_and_lm_head_rows, overfit

from specheads.bench.replay import rank_vectors
from specheads.config.train import HeadConfig
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.tree import static_tree
from specheads.errors import SpecHeadsError
from specheads.export.exporter import check_servable
from specheads.heads import build_head, load_head, save_head
from specheads.heads.base import shifted
from specheads.heads.io import warm_start
from specheads.heads.vocab import count_assistant_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def early_exit(target, exit_layer=None, **fields):
    torch.manual_seed(0)
    return build_head(HeadConfig(family="early_exit", exit_layer=exit_layer, **fields), target)


def batch_of(sequences):
    return {
        "input_ids": sequences,
        "attention_mask": torch.ones_like(sequences),
        "loss_mask": torch.ones_like(sequences),
    }


def test_spec_reads_the_layer_it_exits_at_and_refuses_what_cannot_hold(tiny_target):
    head = early_exit(tiny_target)
    assert head.spec.exit_layer == 1 and head.target_layer_ids() == [1]  # a quarter of 6 layers
    assert head.training_states() == ([1], True) and not head.reads_final
    assert early_exit(tiny_target, 4, layer_ids=[4]).spec.layer_ids == [4]
    for bad in (dict(exit_layer=0), dict(exit_layer=7), dict(exit_layer=3, layer_ids=[2])):
        with pytest.raises(SpecHeadsError, match="exit_layer") as err:
            early_exit(tiny_target, **bad)
        assert "\n" not in str(err.value)
    with pytest.raises(SpecHeadsError, match="early_exit head drafts with infer.py only"):
        check_servable("early_exit")  # no serving engine loads it


@pytest.mark.parametrize("adapter_mlp", [False, True])
def test_a_fresh_head_is_the_targets_logit_lens(tiny_target, sequences, adapter_mlp):
    """The adapter starts as the identity and its norm as the target's final norm: at L = every
    layer the draft's logits are the target's own."""
    head = early_exit(tiny_target, 6, adapter_mlp=adapter_mlp)
    batch = batch_of(sequences[:2])
    states = head_states(tiny_target, head, batch)
    out = head.adapted(batch, states)
    assert_same_numbers(head.full_logits(out), head.target_logits(states["final"]))
    torch.testing.assert_close(head.draft_logits(out), head.full_logits(out), rtol=0, atol=0)
    params = sum(p.numel() for p in head.parameters())
    h = tiny_target.info.hidden_size
    attention = 2 * h * 64 + 2 * h * 32  # q, o: 4 heads x 16; k, v: 2 kv heads x 16
    assert params == attention + 2 * h + (h + 3 * h * 128 if adapter_mlp else 0)


def test_training_a_few_steps_lowers_the_loss(tiny_target, sequences):
    head = early_exit(tiny_target, 3).train()
    batch = batch_of(sequences[:4])
    losses, metrics = overfit(head, batch, head_states(tiny_target, head, batch), steps=8, lr=3e-2)
    assert losses[-1] < losses[0] - 0.3 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert metrics.keys() == {"loss_0", "acc_0"}


def one_position_off(head):
    """A wrong variant: teacher forcing one position off (depth d read d - 1 positions on)."""

    def forced(input_ids, states, depth):
        logits = head.draft_logits(head.adapted({"input_ids": input_ids}, states))
        return [shifted(logits, d - 1) for d in range(1, depth + 1)]

    return forced


def check_ranks_predict_the_loop(target, head, prompt):
    """Two implementations agree: the calibration's teacher-forced ranks (head.teacher_forced_logits
    over one target forward) predict what the real drafter, running the target's first layers on its
    cache, gets accepted at every step (tests/bench/test_calibrate.py's check for the other families)."""
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    tree = {tuple(p) for p in paths}
    res = speculative_generate(
        target, make_drafter(head, static_tree(paths)), prompt, SamplingConfig(max_new_tokens=32)
    )
    full = prompt[0].tolist() + res.output_ids
    vectors = rank_vectors(target, head, full, prompt.shape[1], depth=3)
    offset, checked = 0, 0
    for accepted, depth, emitted in zip(res.accepted_drafts, res.tree_depths, res.accept_lengths):
        if depth == 3:  # trees pruned near max_new_tokens are skipped
            v = vectors[offset]
            assert accepted == max([m for m in range(1, len(v) + 1) if v[:m] in tree], default=0)
            checked += 1
        offset += emitted
    assert checked >= 3 and max(res.accepted_drafts) >= 2


def test_teacher_forcing_is_what_the_drafter_drafts(tiny_target, sequences, monkeypatch):
    head = early_exit(tiny_target, 5).eval()  # the logit lens at layer 5 of 6: often the target's token
    prompt = sequences[2:3, :8]
    check_ranks_predict_the_loop(tiny_target, head, prompt)
    monkeypatch.setattr(head, "teacher_forced_logits", one_position_off(head))
    with pytest.raises(AssertionError):
        check_ranks_predict_the_loop(tiny_target, head, prompt)


def perturbed(head, scale=0.05):
    """The head with every weight moved off its initial value (no zero or identity left)."""
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn_like(p))
    return head


def test_save_and_load_round_trip(tiny_target, sequences, tmp_path):
    head = perturbed(early_exit(tiny_target, 3, adapter_mlp=True)).eval()
    path = save_head(head, tmp_path / "head")
    config = json.loads((path / "config.json").read_text())
    assert config["family"] == "early_exit" and config["layer_ids"] == [3]
    assert (config["head"]["exit_layer"], config["head"]["adapter_mlp"]) == (3, True)
    assert config["reads"] == {"layer_ids": [3], "final_post_norm": False}
    back = load_head(path, tiny_target)
    assert back.spec == head.spec
    mine, theirs = head.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    batch = batch_of(sequences[:2])
    states = head_states(tiny_target, head, batch)
    torch.testing.assert_close(
        back.draft_logits(back.adapted(batch, states)), head.draft_logits(head.adapted(batch, states)), rtol=0, atol=0
    )


def answer_rows(sequences):
    return [{"input_ids": s.tolist(), "loss_mask": [1] * len(s)} for s in sequences]


def test_a_draft_vocabulary_reads_its_rows_of_the_lm_head(tiny_target, sequences, tmp_path):
    rows = answer_rows(sequences)
    cfg = HeadConfig(family="early_exit", exit_layer=3, draft_vocab=True, draft_vocab_size=64)
    torch.manual_seed(0)
    head = perturbed(build_head(cfg, tiny_target, train_rows=rows)).eval()
    vocab = tiny_target.info.vocab_size
    assert head.spec.draft_vocab_size == 64 and head.t2d.shape == (vocab,) and int(head.t2d.sum()) == 64
    used = head.draft_to_target(torch.arange(64))
    counts = count_assistant_tokens(rows, vocab)
    outside = counts.clone()
    outside[used] = -1
    assert counts[used].min() >= outside.max()  # the most frequent answer tokens
    batch = batch_of(sequences[:2])
    states = head_states(tiny_target, head, batch)
    out = head.adapted(batch, states)
    torch.testing.assert_close(head.draft_logits(out), head.full_logits(out)[..., used], rtol=0, atol=0)
    # saved and loaded with its maps; the rows drafted from follow the loaded maps, not the cached ones
    back = load_head(save_head(head, tmp_path / "head"), tiny_target)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    other = torch.sort(torch.randperm(vocab)[:64]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[other] = True
    head.set_vocab(other - torch.arange(64), t2d)
    torch.testing.assert_close(head.draft_logits(out), head.full_logits(out)[..., other], rtol=0, atol=0)
    # the training loss is the full distribution's, and the head without a draft vocabulary has no maps
    assert "d2t" not in early_exit(tiny_target, 3).state_dict()
    assert_same_numbers(head.loss(batch, states)[0], early_exit_loss(head, batch, states))


def early_exit_loss(head, batch, states):
    """The soft cross-entropy over every token, written out plainly."""
    p = torch.softmax(head.target_logits(states["final"]), dim=-1)[:, :-1]
    logq = torch.log_softmax(head.full_logits(head.adapted(batch, states)), dim=-1)[:, :-1]
    return -(p * logq).sum(-1).mean()


def test_a_head_without_a_draft_vocabulary_continues_into_one(tiny_target, sequences, tmp_path):
    """train.init_from: an early-exit head gains maps chosen from the new run's data (its drafted rows
    are the target's own), its weights carried over."""
    source = perturbed(early_exit(tiny_target, 3)).eval()
    path = save_head(source, tmp_path / "full")
    cfg = HeadConfig(family="early_exit", exit_layer=3, draft_vocab=True, draft_vocab_size=64)
    head = build_head(cfg, tiny_target, train_rows=answer_rows(sequences))
    maps = head.d2t.clone(), head.t2d.clone()
    warm_start(head, path, tiny_target)
    assert torch.equal(head.d2t, maps[0]) and torch.equal(head.t2d, maps[1])
    theirs = source.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in head.state_dict().items() if k not in ("d2t", "t2d"))


def every_position_loss(head, batch, states):
    """The plain implementation: the soft cross-entropy at every position, masked afterwards."""
    target_p = torch.softmax(head.target_logits(states["final"]), dim=-1)
    logq = torch.log_softmax(head.full_logits(head.adapted(batch, states)), dim=-1)
    mask = head._counted(batch, 0)
    return -((target_p * logq).sum(-1) * mask).sum() / mask.sum().clamp(min=1)


def test_the_loss_reads_the_lm_head_at_counted_positions_only(tiny_target, sequences):
    """The loss and its gradients equal the plain every-position loss, masked, while the LM head
    sees only the counted rows; a mask shifted by one position (a wrong variant) gives another loss."""
    head = early_exit(tiny_target, 3).train()
    with torch.no_grad():  # a trained-looking adapter: the fresh one adds nothing to the stream
        head.layer.self_attn.o_proj.weight.normal_(0, 0.05)
    batch = batch_of(sequences[:4])
    batch["loss_mask"][:, : sequences.shape[1] // 3] = 0  # prompts: not counted
    states = head_states(tiny_target, head, batch)
    loss, _, rows = loss_and_lm_head_rows(head, batch, states)
    counted = int(head._counted(batch, 0).sum())
    assert rows == [counted, counted] and counted < sequences[:4].numel()
    grads = torch.autograd.grad(loss, [head.layer.self_attn.o_proj.weight, head.norm.weight])
    plain = every_position_loss(head, batch, states)
    assert_same_numbers(loss, plain)
    for ours, theirs in zip(grads, torch.autograd.grad(plain, [head.layer.self_attn.o_proj.weight, head.norm.weight])):
        assert_same_numbers(ours, theirs)
    shifted_batch = {**batch, "loss_mask": batch["loss_mask"].roll(1, dims=1)}
    assert not torch.isclose(every_position_loss(head, shifted_batch, states), loss)
