"""DSpark: the Markov bias against its plain formula (and a slot's dependence on the token before
it), the training forward against drafting each block alone, the confidence target against the
acceptance rate 1 - TV written out (speculators'; not the cumulative greedy acceptance), the loss
against a plain weighted sum, training, lossless speculative decoding (confidence stops included),
save/load, and the settings refused."""

import copy
import json

import pytest
import torch
from conftest import (
    POLICIES,
    assert_other_numbers,
    assert_same_numbers,
    batch_rows,
    head_states,
    hf_greedy,
    overfit,
    quick_head,
)

import specheads.heads.dflash as dflash
import specheads.heads.dspark as dspark
from specheads.config.infer import TreeConfig
from specheads.config.train import HeadConfig
from specheads.decode.drafters import MarkovBlockDrafter, make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import DynamicTreeSpec, tree_policy_for
from specheads.decode.tree import full_paths, static_tree
from specheads.errors import SpecHeadsError
from specheads.heads import build_head, load_head, save_head
from specheads.heads.base import shifted
from specheads.heads.spec import HeadSpec, default_layer_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def dspark_head(target, batch, **overrides):
    torch.manual_seed(0)
    cfg = HeadConfig(family="dspark", **{"block_size": 5, "markov_rank": 8, **overrides})
    head = build_head(cfg, target, train_rows=batch_rows(batch)).eval()
    with torch.no_grad():  # off the initialisation (markov_w2 starts at zero), so a wrong bias cannot hide
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def plain_bias(head, prev, h):
    """The Markov head written out: markov_w2 @ markov_w1[prev], gated by sigmoid(gate_proj([h; e]))."""
    m = head.markov_head
    e = m.markov_w1.weight[prev]
    if head.spec.markov_head_type == "gated":
        e = torch.sigmoid(torch.cat([h, e], dim=-1) @ m.gate_proj.weight.T + m.gate_proj.bias) * e
    return e @ m.markov_w2.weight.T


def drafted_alone(head, input_ids, features, start, anchor, depth=None):
    """The block anchored at `anchor` drafted as inference drafts it: a fresh context cache fed the
    document's rows start..anchor, then one block (heads/dspark.py DraftBlock)."""
    ids = shifted(input_ids, 1)[:, start : anchor + 1]
    depth = depth or head.max_draft_depth(head.spec)
    return head.draft_block(ids, features[:, start : anchor + 1], head.new_cache(), depth)


# -- the Markov bias -----------------------------------------------------------------------------


def check_markov_bias(head, batch, states):
    """Slot d's logits are the block's DFlash logits plus the bias of the token before it, so they
    change with that token."""
    feats = head.input_features(states)
    with torch.no_grad():
        block = drafted_alone(head, batch["input_ids"][:1], feats[:1], 0, 20)
        base = head.draft_logits(block.h)
        for d in range(1, len(block.h) + 1):
            a, b = block.logits([d], [7])[0], block.logits([d], [11])[0]
            assert_other_numbers(a, b)  # another previous token, other logits
            assert_same_numbers(a, base[d - 1] + plain_bias(head, torch.tensor(7), block.h[d - 1]))
            assert_same_numbers(b, base[d - 1] + plain_bias(head, torch.tensor(11), block.h[d - 1]))


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_a_slots_logits_take_the_bias_of_the_token_before_it(head_type, tiny_target, toy_batch, monkeypatch):
    head = dspark_head(tiny_target, toy_batch, markov_head_type=head_type)
    states = head_states(tiny_target, head, toy_batch)
    check_markov_bias(head, toy_batch, states)
    # the check has power: with the bias dropped (DFlash's independent slots) it fails
    monkeypatch.setattr(dspark.MarkovHead, "forward", lambda self, prev, h: torch.zeros(()))
    with pytest.raises(AssertionError):
        check_markov_bias(head, toy_batch, states)


def test_tree_nodes_get_the_children_of_their_own_token(tiny_target):
    """Every node of a drafted tree gets the top children of its depth's slot biased by its own
    token (the root's by the bonus token): siblings' children differ, as a chain's would."""
    head = quick_head(tiny_target, "dspark")
    with torch.no_grad():
        for p in head.markov_head.parameters():
            p.add_(0.5 * torch.randn_like(p))
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), tiny_target.capture(head.target_layer_ids(), final=head.reads_final) as store:
        root = int(tiny_target.model(prompt).logits[0, -1].argmax())
    states, length = dict(store), prompt.shape[1]
    drafter = make_drafter(head, static_tree(full_paths(3, 2)))
    assert isinstance(drafter, MarkovBlockDrafter)
    drafter.start(prompt, states, root)
    with torch.no_grad():
        tokens, layout = drafter.draft(root, length, max_depth=9)
        ids = torch.cat([prompt[:, 1:], torch.tensor([[root]])], dim=1)
        h = head.block_states(ids, head.input_features(states), head.new_cache())[0]  # slot 0 drafts depth 1
    assert layout.size == 15
    seen = set()
    for node in range(layout.size):
        if layout.children[node]:
            depth = len(layout.path_to(node))  # its children's depth
            logits = head.draft_logits(h[depth - 1]) + plain_bias(head, torch.tensor(tokens[node]), h[depth - 1])
            children = [tokens[c] for c in layout.children[node]]
            assert children == torch.topk(logits, 2).indices.tolist(), node
            seen.add((depth, tuple(children)))
    assert len(seen) > 3  # the bias made siblings' children differ


# -- the training forward is what drafting computes ----------------------------------------------

ANCHORS = [torch.tensor([0, 3, 7, 10, 15, 18]), torch.tensor([2, 7, 17])]
DOC0 = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])  # row 0: two documents; row 1: padding


@pytest.mark.parametrize("sample_from_anchor", [True, False])
@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_training_forward_equals_drafting_each_block_alone(head_type, sample_from_anchor, tiny_target, toy_batch):
    """Train = draft: at every drafting slot of the packed training forward, the logits (biased by
    the data's token before it) and the confidence are what drafting that block alone gives with
    that token as the one drafted before."""
    head = dspark_head(tiny_target, toy_batch, markov_head_type=head_type, sample_from_anchor=sample_from_anchor)
    assert head.max_draft_depth(head.spec) == (5 if sample_from_anchor else 4)
    states = head_states(tiny_target, head, toy_batch)
    ids = toy_batch["input_ids"][:, :24]
    feats = head.input_features({k: v[:, :24] for k, v in states.items()})
    slot0 = 0 if sample_from_anchor else 1
    checked = 0
    with torch.no_grad():
        h, anchor, slot, doc = head.packed_hidden(ids, feats, ANCHORS, DOC0)
        for r in range(anchor.shape[0]):
            for n in range(anchor.shape[1]):
                if doc[r, n] < 0 or slot[r, n] < slot0:
                    continue
                t, d = int(anchor[r, n]), int(slot[r, n]) - slot0 + 1  # drafts token t+1+d after token t+d
                start = int((DOC0[r] == doc[r, n]).nonzero()[0])
                prev = ids[r, min(t + d, 23)]
                alone = drafted_alone(head, ids[r : r + 1], feats[r : r + 1], start, t)
                assert_same_numbers(head.slot_logits(h[r, n], prev), alone.logits([d], [int(prev)])[0])
                assert_same_numbers(
                    torch.sigmoid(head.confidence_logits(h[r, n], prev)), alone.confidence([d], [int(prev)])[0]
                )
                checked += 1
    assert checked == sum(len(a) for a in ANCHORS) * head.max_draft_depth(head.spec)


# -- the loss ------------------------------------------------------------------------------------


@pytest.fixture
def drawn(monkeypatch) -> list:
    """Every anchor tensor the head draws, in order (the real sampler, recorded)."""
    record, sample = [], dflash.sample_block_anchors
    monkeypatch.setattr(dflash, "sample_block_anchors", lambda *a: record.append(sample(*a)) or record[-1])
    return record


def plain_targets(head, target, batch, states, anchors):
    """Per (row, anchor, depth) of every draft inside its row: (its logits drafted alone after the
    data's token before it, its confidence logit, its acceptance rate sum_v min(q_v, p_v) against
    the target's own distribution p for that token, the cumulative greedy acceptance: 1 where it and
    every draft before it in its block are the target's greedy tokens, and whether it alone is)."""
    feats = head.input_features(states)
    ids = batch["input_ids"]
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        target_logits = target.model(ids, attention_mask=batch["attention_mask"]).logits.float()  # token p+1
    greedy = target_logits.argmax(-1)
    out = {}
    for r, row in enumerate(anchors):
        for t in row.tolist():
            block = drafted_alone(head, ids[r : r + 1], feats[r : r + 1], 0, t)
            accepted = True
            for d in range(1, head.max_draft_depth(head.spec) + 1):
                if t + 1 + d >= ids.shape[1] or not valid[r, t + 1 + d]:
                    break
                prev = int(ids[r, t + d])
                logits = block.logits([d], [prev])[0]
                hit = int(logits.argmax()) == int(greedy[r, t + d])
                accepted = accepted and hit
                q, p = torch.softmax(logits.float(), -1), torch.softmax(target_logits[r, t + d], -1)
                rate = float(sum(min(a, b) for a, b in zip(q.tolist(), p.tolist())))
                confidence = head.confidence_logits(block.h[d - 1], torch.tensor(prev))
                out[r, t, d] = logits, confidence, rate, float(accepted), hit
    return out


def plain_loss(head, target, batch, states, anchors):
    """DFlash's decayed cross-entropy (over the sum of the weights) plus alpha x the decayed soft
    binary cross-entropy of the confidence against the acceptance rate over the NUMBER of trained
    slots (speculators' _masked_decayed_mean), block by block through the inference path."""
    ids, mask = batch["input_ids"], batch["loss_mask"].bool() & batch["attention_mask"].bool()
    ce = bce = weights = 0.0
    count = 0
    for (r, t, d), (logits, confidence, rate, _, _) in plain_targets(head, target, batch, states, anchors).items():
        if mask[r, t + 1 + d]:
            w = torch.exp(torch.tensor(-(d - 1) / head.spec.dflash_gamma))
            ce = ce + w * torch.nn.functional.cross_entropy(logits, ids[r, t + 1 + d])
            c = torch.sigmoid(confidence)
            bce = bce - w * (rate * torch.log(c) + (1 - rate) * torch.log(1 - c))
            weights = weights + w
            count += 1
    return ce / weights + head.spec.confidence_head_alpha * bce / count


def test_loss_is_the_decayed_cross_entropy_plus_the_confidence_bce(tiny_target, toy_batch, drawn):
    head = dspark_head(tiny_target, toy_batch, anchors_per_sequence=4, confidence_head_alpha=0.7)
    states = head_states(tiny_target, head, toy_batch)
    torch.manual_seed(3)
    with torch.no_grad():
        loss, metrics = head.loss(toy_batch, states)
        expected = plain_loss(head, tiny_target, toy_batch, states, drawn)
    assert_same_numbers(loss, expected)
    depths = {f"{m}_{d}" for m in ("loss", "acc") for d in range(5)}
    assert set(metrics) == depths | {"confidence_loss", "confidence_error"}
    # the confidence term is in it: at another weight the plain sum no longer matches
    head.spec.confidence_head_alpha = 0.0
    with torch.no_grad():
        assert_other_numbers(plain_loss(head, tiny_target, toy_batch, states, drawn), loss)


def test_confidence_target_is_the_acceptance_rate(tiny_target, sequences, drawn):
    """Trained a little on the target's own text, every trained slot's target is the overlap of its
    draft distribution with the target's, sum_v min(q_v, p_v), written out; not the block's
    cumulative greedy acceptance, which is 0 after a miss where the slot's own rate is high."""
    batch = {
        "input_ids": sequences,
        "attention_mask": torch.ones_like(sequences),
        "loss_mask": torch.ones_like(sequences),
    }
    head = dspark_head(tiny_target, batch, anchors_per_sequence=12).train()
    states = head_states(tiny_target, head, batch)
    torch.manual_seed(0)
    overfit(head, batch, states, steps=12)
    head.eval()
    drawn.clear()
    torch.manual_seed(5)
    with torch.no_grad():
        blocks = head.training_blocks(batch, states)
        ids, kept = batch["input_ids"], blocks.kept
        logits = head.slot_logits(blocks.h[kept], ids.gather(1, blocks.where - 1)[kept])
        got = head.acceptance_rate(blocks, logits, states)
        plain = plain_targets(head, tiny_target, batch, states, drawn)
    rows = torch.arange(len(ids))[:, None].expand_as(blocks.where)[kept]
    keys = list(zip(rows.tolist(), blocks.anchor[kept].tolist(), blocks.depth[kept].tolist()))
    assert sorted(keys) == sorted(plain)
    assert_same_numbers(got, torch.tensor([plain[k][2] for k in keys]))
    assert not got.requires_grad
    # the check has power: the cumulative greedy target (speculators' is not) is far from it, and
    # the targets are soft
    cumulative = torch.tensor([plain[k][3] for k in keys])
    assert_other_numbers(got, cumulative)
    # no function of the cumulative target gives it: a slot after a miss (cumulative 0) outranks one
    # whose block is right so far (cumulative 1)
    after_miss = max(plain[k][2] for k in keys if plain[k][3] == 0)
    assert after_miss > min(plain[k][2] for k in keys if plain[k][3] == 1) and after_miss > 0.3
    assert bool(((got > 0.05) & (got < 0.95)).any())
    # the loss reads it: a head whose target were the cumulative one gives another confidence loss
    torch.manual_seed(5)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    with torch.no_grad():
        _, metrics = head.loss(batch, states)
        confidence = head.confidence_logits(blocks.h[kept], ids.gather(1, blocks.where - 1)[kept])
        weight = head.depth_weight(blocks.depth[kept])
        expected = float((bce(confidence, got, reduction="none") * weight).sum() / len(got))
        wrong = float((bce(confidence, cumulative, reduction="none") * weight).sum() / len(got))
    assert metrics["confidence_loss"] == pytest.approx(expected, rel=1e-4)
    assert metrics["confidence_loss"] != pytest.approx(wrong, rel=1e-2)


def test_training_lowers_the_loss(tiny_target, sequences):
    batch = {
        "input_ids": sequences,
        "attention_mask": torch.ones_like(sequences),
        "loss_mask": torch.ones_like(sequences),
    }
    head = dspark_head(tiny_target, batch, anchors_per_sequence=8).train()
    states = head_states(tiny_target, head, batch)
    torch.manual_seed(1)
    with torch.no_grad():
        _, first = head.loss(batch, states)
    losses, last = overfit(head, batch, states, steps=20)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses
    assert last["confidence_loss"] < first["confidence_loss"], (first, last)


# -- decoding ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_target, sequences):
    return quick_head(tiny_target, "dspark", sequences, steps=60)


@pytest.mark.parametrize("trained_steps", [0, 60])
def test_greedy_speculative_output_is_the_targets_own(trained_steps, tiny_target, sequences, trained):
    head = trained if trained_steps else quick_head(tiny_target, "dspark")
    prompts = [sequences[1:2, :8], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])]
    refs = [hf_greedy(tiny_target, prompt, 24) for prompt in prompts]
    policies = {**POLICIES, "default": tree_policy_for(head, TreeConfig())}  # what infer.py drafts
    for name, policy in policies.items():
        drafter = make_drafter(head, policy)
        for prompt, ref in zip(prompts, refs):
            res = speculative_generate(tiny_target, drafter, prompt, SamplingConfig(max_new_tokens=24))
            assert res.output_ids == ref, (trained_steps, name)
            assert res.tree_sizes[0] > 1
    if trained_steps:
        res = speculative_generate(
            tiny_target, make_drafter(head, POLICIES["chain"]), sequences[1:2, :8], SamplingConfig(max_new_tokens=32)
        )
        assert res.tau > 1.5, res.accept_lengths


def test_a_confidence_stop_cuts_blocks_and_stays_lossless(tiny_target, sequences, trained):
    """With a threshold the drafter stops each block at the first depth whose predicted cumulative
    acceptance (the product of the slots' predicted rates) along the top-1 chain is below it: trees
    get cut (on a prompt unlike the training text, where the head is less sure), the output never
    changes."""
    head = copy.deepcopy(trained).attach(tiny_target)
    prompts = [sequences[2:3, :8], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])]
    refs = [hf_greedy(tiny_target, prompt, 32) for prompt in prompts]
    config = SamplingConfig(max_new_tokens=32)
    full = speculative_generate(tiny_target, make_drafter(head, POLICIES["chain"]), prompts[1], config)
    for threshold in (0.5, 0.9):
        head.spec.confidence_threshold = threshold
        for policy in (POLICIES["chain"], DynamicTreeSpec(depth=4, top_k=3, total_tokens=12)):
            for prompt, ref in zip(prompts, refs):
                res = speculative_generate(tiny_target, make_drafter(head, policy), prompt, config)
                assert res.output_ids == ref, (threshold, policy)
    chain = speculative_generate(tiny_target, make_drafter(head, POLICIES["chain"]), prompts[1], config)
    assert sum(chain.tree_sizes) < sum(full.tree_sizes), (chain.tree_sizes, full.tree_sizes)
    # the stop rule itself: the depth before the first one under the threshold along the top-1 chain
    prompt = prompts[1]
    states = head_states(tiny_target, head, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)})
    with torch.no_grad():
        block = drafted_alone(head, prompt, head.input_features(states), 0, 6, depth=4)
        root = int(prompt[0, 7])
        chain_tokens, _ = block.chain(root)
        rates = [float(block.confidence([d], [([root] + chain_tokens)[d - 1]])[0]) for d in range(1, 5)]
        survival = [float(torch.tensor(rates[:d]).prod()) for d in range(1, 5)]  # the product along the chain
        # between depth 2's product and both its slots' own rates: there the product stops at depth 1,
        # each slot's rate alone would not (the check has power)
        between = (survival[1] + min(rates[:2])) / 2
        for threshold in (between, 0.3, 0.5, 0.85, 0.9):
            head.spec.confidence_threshold = threshold
            below = [d for d in range(1, 5) if survival[d - 1] < threshold]
            assert block.stop_depth(root) == (below[0] - 1 if below else 4), (threshold, rates)
        head.spec.confidence_threshold = between
        assert block.stop_depth(root) == 1 and min(rates[:2]) >= between, (rates, survival)


def test_save_load_gives_identical_drafts(tiny_target, toy_batch, tmp_path):
    head = dspark_head(tiny_target, toy_batch, markov_head_type="gated", confidence_threshold=0.25)
    save_head(head, tmp_path / "head", training={"steps": 0})
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["family"] == "dspark"
    saved = config["head"]
    assert (saved["markov_rank"], saved["markov_head_type"], saved["confidence_threshold"]) == (8, "gated", 0.25)
    assert saved["sample_from_anchor"] is True and "ttt_steps" not in saved
    loaded = load_head(tmp_path / "head", tiny_target)
    assert sorted(loaded.state_dict()) == sorted(head.state_dict())
    names = {n for n in head.state_dict() if n.startswith(("markov_head.", "confidence_head."))}
    assert names == {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "markov_head.gate_proj.weight",
        "markov_head.gate_proj.bias",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    states = head_states(tiny_target, head, toy_batch)
    with torch.no_grad():
        a = drafted_alone(head, toy_batch["input_ids"][:1], head.input_features(states)[:1], 0, 20)
        b = drafted_alone(loaded, toy_batch["input_ids"][:1], loaded.input_features(states)[:1], 0, 20)
        assert torch.equal(a.logits([1, 2, 3], [5, 6, 7]), b.logits([1, 2, 3], [5, 6, 7]))
        assert torch.equal(a.confidence([1, 2], [5, 6]), b.confidence([1, 2], [5, 6]))
        assert a.stop_depth(5) == b.stop_depth(5)


# -- spec ----------------------------------------------------------------------------------------


def test_spec_defaults_and_bad_settings_are_one_line(tiny_target):
    spec = HeadSpec.from_config(HeadConfig(family="dspark"), tiny_target.info)
    assert spec.layer_ids == default_layer_ids("dflash", tiny_target.info.num_layers, 2) == [2, 4]
    assert (spec.eval_depth, spec.markov_rank, spec.markov_head_type) == (8, 256, "vanilla")  # slot 0 drafts too
    assert HeadSpec.from_config(HeadConfig(family="dspark", sample_from_anchor=False), tiny_target.info).eval_depth == 7
    assert "markov_rank" not in HeadSpec.from_config(HeadConfig(family="dflash"), tiny_target.info).to_dict()
    for fields, line in [
        ({"markov_rank": 0}, "head.markov_rank must be >= 1"),
        ({"markov_head_type": "low_rank"}, "head.markov_head_type must be vanilla or gated, got 'low_rank'"),
        ({"markov_head_type": "rnn"}, "head.markov_head_type must be vanilla or gated, got 'rnn'"),
        ({"confidence_head_alpha": -1.0}, "head.confidence_head_alpha must be >= 0"),
        ({"confidence_threshold": 1.0}, r"head.confidence_threshold must be in \[0, 1\)"),
        ({"confidence_threshold": 0.5, "enable_confidence_head": False}, "needs the confidence head"),
        ({"block_size": 1}, "head.block_size must be >= 2"),
    ]:
        with pytest.raises(SpecHeadsError, match=line) as caught:
            HeadSpec.from_config(HeadConfig(family="dspark", **fields), tiny_target.info)
        assert "\n" not in str(caught.value), fields


def test_without_a_confidence_head_it_drafts_whole_blocks(tiny_target, toy_batch):
    head = dspark_head(tiny_target, toy_batch, enable_confidence_head=False)
    assert head.confidence_head is None and not any(n.startswith("confidence") for n in head.state_dict())
    states = head_states(tiny_target, head, toy_batch)
    torch.manual_seed(0)
    with torch.no_grad():
        _, metrics = head.loss(toy_batch, states)
        block = drafted_alone(head, toy_batch["input_ids"][:1], head.input_features(states)[:1], 0, 20)
    assert "confidence_loss" not in metrics and block.stop_depth(3) == 5
