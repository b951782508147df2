"""DFlash2: the in-block convolution against its per-element formula (never across blocks, never a
later slot), the selector's scores against theirs and their say over the drafted token, the
training forward against drafting each block alone, the loss against a plain weighted sum,
training, lossless speculative decoding, save/load, and the settings refused."""

import ast
import json
from pathlib import Path

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
from specheads.config.infer import TreeConfig
from specheads.config.train import HeadConfig
from specheads.decode.drafters import MarkovBlockDrafter, make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import tree_policy_for
from specheads.decode.tree import full_paths, static_tree
from specheads.errors import SpecHeadsError
from specheads.heads import build_head, load_head, save_head
from specheads.heads.base import shifted
from specheads.heads.dflash2 import GroupedConv
from specheads.heads.spec import HeadSpec

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"block_size": 5, "conv_kernel_size": 3, "selector_rank": 8, "selector_top_k": 6}


def dflash2_head(target, batch, **overrides):
    torch.manual_seed(0)
    cfg = HeadConfig(family="dflash2", **{**SMALL, **overrides})
    head = build_head(cfg, target, train_rows=batch_rows(batch)).eval()
    with torch.no_grad():  # off the initialisation (identity convolutions, a silent selector)
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
        head.candidate_selector.hidden_projection.weight.normal_(0, 0.5)
    return head


def drafted_alone(head, input_ids, features, start, anchor, depth=None):
    """The block anchored at `anchor` drafted as inference drafts it: a fresh context cache fed the
    document's rows start..anchor, then one block (heads/dflash2.py SelectorBlock)."""
    ids = shifted(input_ids, 1)[:, start : anchor + 1]
    depth = depth or head.max_draft_depth(head.spec)
    return head.draft_block(ids, features[:, start : anchor + 1], head.new_cache(), depth)


# -- the convolution -----------------------------------------------------------------------------


def random_conv(seed, block_size=4, taps=3):
    torch.manual_seed(seed)
    conv = GroupedConv(hidden_size=64, taps=taps, group_size=16, block_size=block_size)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.2)
    return conv


def plain_conv(conv, x, delta, side):
    """vLLM's formula element by element: out[i, ch] = sum_j [slot(i) >= j] (base[side, j, ch] +
    delta[i, j, ch // group_size]) x[i - j, ch], slot(i) = i % block_size."""
    b, n, h = x.shape
    out = torch.zeros_like(x)
    for r in range(b):
        for i in range(n):
            for j in range(conv.taps):
                if i % conv.block_size >= j:
                    weight = conv.base_kernel[side, j] + delta[r, i, j].repeat_interleave(conv.group_size)
                    out[r, i] += weight * x[r, i - j]
    return out


def test_convolution_is_the_per_element_formula():
    conv = random_conv(0)
    x = torch.randn(2, 12, 64)
    with torch.no_grad():
        y, delta = conv.prepare(x)
        projected = conv.kernel_projection(x).view(2, 12, 2, conv.taps, conv.num_groups)
        assert_same_numbers(y, plain_conv(conv, x, projected[:, :, 0], 0))
        assert torch.equal(delta, projected[:, :, 1])
        z = torch.randn(2, 12, 64)
        assert_same_numbers(conv.finish(z, delta), plain_conv(conv, z, delta, 1))
    # more taps than slots: the extra taps reach before slot 0 and add nothing
    wide = random_conv(1, block_size=2, taps=4)
    with torch.no_grad():
        y, _ = wide.prepare(x)
        assert_same_numbers(y, plain_conv(wide, x, wide.kernel_projection(x).view(2, 12, 2, 4, 4)[:, :, 0], 0))


def check_reads_its_block_up_to_itself(conv, seed):
    """Changing slot k of block m changes the outputs of block m's slots k, k+1, ... only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 12, 64, generator=g)
    m, k = int(torch.randint(0, 3, (), generator=g)), int(torch.randint(0, 4, (), generator=g))
    other = x.clone()
    other[0, 4 * m + k] += torch.randn(64, generator=g)
    with torch.no_grad():
        (a, da), (b, db) = conv.prepare(x), conv.prepare(other)
        a, b = conv.finish(a, da), conv.finish(b, db)
    changed = (a - b).abs().amax(-1)[0] > 0
    reach = torch.zeros(12, dtype=torch.bool)
    reach[4 * m + k : 4 * m + 4] = True
    assert not changed[~reach].any(), (m, k, changed)
    assert changed[4 * m + k], (m, k)


def one_block_per_row(conv):
    """A wrong convolution: the whole row one block, so slots read the block before theirs."""
    conv.block_size = 12
    return conv


def reads_later_slots(conv):
    """A wrong convolution: mirrored inside each block, so slots read the ones after them."""
    right = conv.convolve
    conv.convolve = lambda x, delta, base: right(x.flip(1), delta.flip(1), base).flip(1)
    return conv


def test_convolution_never_mixes_blocks_nor_reads_a_later_slot():
    for seed in range(12):
        check_reads_its_block_up_to_itself(random_conv(seed), seed)
    # the check has power: a convolution across blocks, or one reading later slots, fails it
    for wrong in (one_block_per_row, reads_later_slots):
        failed = False
        for seed in range(12):
            try:
                check_reads_its_block_up_to_itself(wrong(random_conv(seed)), seed)
            except AssertionError:
                failed = True
                break
        assert failed, wrong.__name__


# vLLM's own model file (its CPU fallbacks of the convolution and the selector's scores are plain torch)
VLLM_DFLASH2 = sorted(
    Path(__file__)
    .resolve()
    .parents[2]
    .glob(".venv-vllm/lib/python*/site-packages/vllm/model_executor/models/qwen3_dflash2.py")
)


def vllm_functions(*names):
    """The top-level functions `names` of vLLM's qwen3_dflash2.py, defined without importing vLLM."""
    tree = ast.parse(VLLM_DFLASH2[0].read_text())
    scope = {"torch": torch, "F": torch.nn.functional}
    chosen = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    exec(compile(ast.Module(chosen, []), str(VLLM_DFLASH2[0]), "exec"), scope)
    return [scope[n] for n in names]


@pytest.mark.skipif(not VLLM_DFLASH2, reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_convolution_and_selector_compute_what_vllms_code_computes(tiny_target, toy_batch):
    grouped_conv, score_edges = vllm_functions("_grouped_conv", "_score_edges")
    conv = random_conv(0, block_size=5)
    x, z = torch.randn(1, 15, 64), torch.randn(1, 15, 64)
    with torch.no_grad():
        y, delta = conv.prepare(x)
        coefficients = conv.kernel_projection(x[0]).reshape(15, 2, conv.taps, conv.num_groups)  # vLLM's prepare
        args = (5, conv.num_groups, conv.group_size, conv.taps)
        assert_same_numbers(y[0], grouped_conv(x[0], coefficients[:, 0], conv.base_kernel[0], *args))
        assert_same_numbers(
            conv.finish(z, delta)[0], grouped_conv(z[0], coefficients[:, 1], conv.base_kernel[1], *args)
        )
    # the selector: vLLM scores every candidate of slot l after every candidate of slot l - 1 (the
    # anchor's token before slot 0) and walks the block; ours after the token drafted before
    head = dflash2_head(tiny_target, toy_batch)
    s = head.candidate_selector
    states = head_states(tiny_target, head, toy_batch)
    with torch.no_grad():
        block = drafted_alone(head, toy_batch["input_ids"][:1], head.input_features(states)[:1], 0, 20)
        unary, candidates = torch.topk(block.unary, head.spec.selector_top_k)
        anchor = toy_batch["input_ids"][:1, 21]
        theirs = score_edges(
            s.predecessor_codebook,
            s.successor_codebook,
            candidates[None],
            unary[None],
            s.hidden_projection(block.h)[None],
            anchor,
            head.spec.selector_top_k,
        )[0]  # [slots, previous candidate, candidate]
        for d in range(1, len(block.h) + 1):
            previous = [int(anchor)] if d == 1 else candidates[d - 2].tolist()
            for p, prev in enumerate(previous):
                ours_candidates, ours = block.rerank([d], [prev])
                assert torch.equal(ours_candidates[0], candidates[d - 1])
                assert_same_numbers(ours[0], theirs[d - 1, p])
        # vLLM's greedy walk (its selector kernel at temperature 0) drafts our chain
        index, walk = 0, []
        for d in range(len(block.h)):
            index = int(theirs[d, index].argmax())
            walk.append(int(candidates[d, index]))
        assert walk == block.chain(int(anchor))[0]


# -- the selector --------------------------------------------------------------------------------


@torch.no_grad()
def plain_scores(head, unary, h, prev):
    """The top-k of the unary logits and each one's score, candidate by candidate."""
    s = head.candidate_selector
    values, candidates = torch.topk(unary, head.spec.selector_top_k)
    projected = s.hidden_projection.weight @ h
    scores = [
        float(values[j]) + float((s.predecessor_codebook[prev] * projected * s.successor_codebook[c]).sum())
        for j, c in enumerate(candidates.tolist())
    ]
    return candidates, torch.tensor(scores)


def test_selector_scores_are_the_plain_formula(tiny_target, toy_batch):
    head = dflash2_head(tiny_target, toy_batch)
    states = head_states(tiny_target, head, toy_batch)
    with torch.no_grad():
        block = drafted_alone(head, toy_batch["input_ids"][:1], head.input_features(states)[:1], 0, 20)
        for d in range(1, 5):
            for prev in (7, 11):
                candidates, scores = block.rerank([d], [prev])
                plain_candidates, plain = plain_scores(head, block.unary[d - 1], block.h[d - 1], prev)
                assert torch.equal(candidates[0], plain_candidates)
                assert_same_numbers(scores[0], plain)
                logits = block.logits([d], [prev])[0]  # vLLM's draft logits: the scores, -inf elsewhere
                assert torch.equal(logits[candidates[0]], scores[0])
                assert torch.isinf(logits).sum() == logits.numel() - head.spec.selector_top_k
            assert_other_numbers(block.rerank([d], [7])[1], block.rerank([d], [11])[1])


def test_the_selector_changes_the_drafted_token_when_its_scores_say_so(tiny_target, toy_batch):
    head = dflash2_head(tiny_target, toy_batch)
    s = head.candidate_selector
    states = head_states(tiny_target, head, toy_batch)
    ids = toy_batch["input_ids"][:1]
    root = int(ids[0, 21])
    with torch.no_grad():
        s.hidden_projection.weight.zero_()  # silent: the LM head's own order, its top-1 drafted
        block = drafted_alone(head, ids, head.input_features(states)[:1], 0, 20)
        top = torch.topk(block.unary[0], head.spec.selector_top_k).indices
        assert block.chain(root)[0][0] == int(top[0])
        # the scores favour the third candidate after the root: it is drafted instead
        h = block.h[0]
        s.hidden_projection.weight[0] = h / h.dot(h)  # (W h)[0] = 1
        s.predecessor_codebook.zero_()
        s.successor_codebook.zero_()
        s.predecessor_codebook[root, 0] = 10.0
        s.successor_codebook[top[2], 0] = 10.0
        tokens, logits = block.chain(root)
        assert tokens[0] == int(top[2]) != int(top[0])
        assert int(logits[0].argmax()) == int(top[2])
        # after another token the predecessor's row is zero: the LM head's top-1 again
        assert block.chain((root + 1) % 320)[0][0] == int(top[0])


def test_tree_nodes_get_their_slots_candidates_in_the_selectors_order(tiny_target):
    """A node's children are the top-ranked candidates of its depth's slot after the node's own
    token (the root's after the bonus token): siblings' children differ where the scores do."""
    head = quick_head(tiny_target, "dflash2")
    with torch.no_grad():
        head.candidate_selector.hidden_projection.weight.normal_(0, 2.0)
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
        h = head.block_states(ids, head.input_features(states), head.new_cache())[0]  # slot d drafts depth d
    assert layout.size == 15
    seen = set()
    for node in range(layout.size):
        if layout.children[node]:
            depth = len(layout.path_to(node))  # its children's depth
            candidates, scores = plain_scores(head, head.draft_logits(h[depth]), h[depth], tokens[node])
            children = [tokens[c] for c in layout.children[node]]
            assert children == candidates[scores.argsort(descending=True)[:2]].tolist(), node
            seen.add((depth, tuple(children)))
    assert len(seen) > 3  # the selector made siblings' children differ


# -- the training forward is what drafting computes ----------------------------------------------

ANCHORS = [torch.tensor([0, 3, 7, 10, 15, 18]), torch.tensor([2, 7, 17])]
DOC0 = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])  # row 0: two documents; row 1: padding


def check_training_forward(head, ids, feats):
    """At every drafting slot of the packed training forward, the candidates and scores after the
    data's token before it are what drafting that block alone gives after that token."""
    checked = 0
    with torch.no_grad():
        h, anchor, slot, doc = head.packed_hidden(ids, feats, ANCHORS, DOC0)
        for r in range(anchor.shape[0]):
            for n in range(anchor.shape[1]):
                if doc[r, n] < 0 or slot[r, n] < 1:
                    continue
                t, d = int(anchor[r, n]), int(slot[r, n])  # drafts token t+1+d after token t+d
                start = int((DOC0[r] == doc[r, n]).nonzero()[0])
                prev = ids[r, min(t + d, 23)]
                alone = drafted_alone(head, ids[r : r + 1], feats[r : r + 1], start, t)
                candidates, scores = head.rerank(head.draft_logits(h[r, n]), h[r, n], prev)
                alone_candidates, alone_scores = alone.rerank([d], [int(prev)])
                assert torch.equal(candidates, alone_candidates[0])
                assert_same_numbers(scores, alone_scores[0])
                checked += 1
    assert checked == sum(len(a) for a in ANCHORS) * head.max_draft_depth(head.spec)


def test_training_forward_equals_drafting_each_block_alone(tiny_target, toy_batch, monkeypatch):
    head = dflash2_head(tiny_target, toy_batch)
    states = head_states(tiny_target, head, toy_batch)
    ids = toy_batch["input_ids"][:, :24]
    feats = head.input_features({k: v[:, :24] for k, v in states.items()})
    check_training_forward(head, ids, feats)
    # the check has power: a convolution over the whole packed row (across blocks) fails it
    right = GroupedConv.convolve

    def across_blocks(self, x, delta, base):
        size, self.block_size = self.block_size, x.shape[1]
        try:
            return right(self, x, delta, base)
        finally:
            self.block_size = size

    monkeypatch.setattr(GroupedConv, "convolve", across_blocks)
    with pytest.raises(AssertionError):
        check_training_forward(head, ids, feats)


# -- the loss ------------------------------------------------------------------------------------


@pytest.fixture
def drawn(monkeypatch) -> list:
    """Every anchor tensor the head draws, in order (the real sampler, recorded)."""
    record, sample = [], dflash.sample_block_anchors
    monkeypatch.setattr(dflash, "sample_block_anchors", lambda *a: record.append(sample(*a)) or record[-1])
    return record


def plain_loss(head, batch, states, anchors):
    """DFlash's decayed cross-entropy of the unary logits, plus selector_loss_weight x the decayed
    cross-entropy of the selector's scores over the candidates holding the label, block by block
    through the inference path."""
    feats = head.input_features(states)
    ids, mask = batch["input_ids"], batch["loss_mask"].bool() & batch["attention_mask"].bool()
    ce = weights = selector = selector_weights = 0.0
    for r, row in enumerate(anchors):
        for t in row.tolist():
            block = drafted_alone(head, ids[r : r + 1], feats[r : r + 1], 0, t)
            for d in range(1, head.spec.block_size):
                if t + 1 + d >= ids.shape[1] or not mask[r, t + 1 + d]:
                    continue
                label, prev = int(ids[r, t + 1 + d]), int(ids[r, t + d])
                w = torch.exp(torch.tensor(-(d - 1) / head.spec.dflash_gamma))
                ce = ce + w * torch.nn.functional.cross_entropy(block.unary[d - 1], torch.tensor(label))
                weights = weights + w
                candidates, scores = plain_scores(head, block.unary[d - 1], block.h[d - 1], prev)
                if label in candidates.tolist():
                    j = candidates.tolist().index(label)
                    selector = selector - w * torch.log_softmax(scores, dim=-1)[j]
                    selector_weights = selector_weights + w
    return ce / weights + head.spec.selector_loss_weight * selector / selector_weights


def test_loss_is_the_decayed_cross_entropy_plus_the_selectors(tiny_target, toy_batch, drawn):
    head = dflash2_head(tiny_target, toy_batch, anchors_per_sequence=4, selector_loss_weight=0.7, selector_top_k=40)
    states = head_states(tiny_target, head, toy_batch)
    torch.manual_seed(3)
    with torch.no_grad():
        loss, metrics = head.loss(toy_batch, states)
        expected = plain_loss(head, toy_batch, states, drawn)
    assert_same_numbers(loss, expected)
    depths = {f"{m}_{d}" for m in ("loss", "acc") for d in range(4)}
    assert set(metrics) == depths | {"selector_loss", "selector_coverage", "selector_acc"}
    assert 0 < metrics["selector_coverage"] < 1  # some labels among the candidates, some not
    # the selector's term is in it: at another weight the plain sum no longer matches
    head.spec.selector_loss_weight = 0.0
    with torch.no_grad():
        assert_other_numbers(plain_loss(head, toy_batch, states, drawn), loss)


def test_training_lowers_the_loss(tiny_target, sequences):
    batch = {
        "input_ids": sequences,
        "attention_mask": torch.ones_like(sequences),
        "loss_mask": torch.ones_like(sequences),
    }
    head = dflash2_head(tiny_target, batch, anchors_per_sequence=8).train()
    states = head_states(tiny_target, head, batch)
    torch.manual_seed(1)
    with torch.no_grad():
        _, first = head.loss(batch, states)
    losses, last = overfit(head, batch, states, steps=20)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses
    assert last["selector_loss"] < first["selector_loss"], (first, last)
    assert last["selector_acc"] > first["selector_acc"], (first, last)


# -- decoding ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_target, sequences):
    return quick_head(tiny_target, "dflash2", sequences, steps=60)


@pytest.mark.parametrize("trained_steps", [0, 60])
def test_greedy_speculative_output_is_the_targets_own(trained_steps, tiny_target, sequences, trained):
    head = trained if trained_steps else quick_head(tiny_target, "dflash2")
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


def test_save_load_gives_identical_drafts(tiny_target, toy_batch, tmp_path):
    head = dflash2_head(tiny_target, toy_batch, conv_group_size=8, selector_loss_weight=0.5)
    save_head(head, tmp_path / "head", training={"steps": 0})
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["family"] == "dflash2"
    saved = config["head"]
    assert {k: saved[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 3,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 6,
    }
    assert saved["selector_loss_weight"] == 0.5 and "markov_rank" not in saved and "ttt_steps" not in saved
    loaded = load_head(tmp_path / "head", tiny_target)
    assert sorted(loaded.state_dict()) == sorted(head.state_dict())
    names = {n for n in head.state_dict() if "conv" in n or n.startswith("candidate_selector.")}
    assert names == {
        *(
            f"layers.{i}.{c}.{p}"
            for i in range(2)
            for c in ("attention_conv", "mlp_conv")
            for p in ("base_kernel", "kernel_projection.weight")
        ),
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    }
    assert head.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 3 * 64 // 8, 64)
    states = head_states(tiny_target, head, toy_batch)
    with torch.no_grad():
        a = drafted_alone(head, toy_batch["input_ids"][:1], head.input_features(states)[:1], 0, 20)
        b = drafted_alone(loaded, toy_batch["input_ids"][:1], loaded.input_features(states)[:1], 0, 20)
        assert torch.equal(a.logits([1, 2, 3], [5, 6, 7]), b.logits([1, 2, 3], [5, 6, 7]))
        assert a.chain(5)[0] == b.chain(5)[0]


# -- spec ----------------------------------------------------------------------------------------


def test_spec_defaults_and_bad_settings_are_one_line(tiny_target):
    spec = HeadSpec.from_config(HeadConfig(family="dflash2"), tiny_target.info)
    assert spec.layer_ids == [2, 4] and spec.eval_depth == 7
    assert (spec.conv_kernel_size, spec.conv_group_size, spec.selector_rank, spec.selector_top_k) == (2, 16, 256, 16)
    assert "selector_rank" not in HeadSpec.from_config(HeadConfig(family="dflash"), tiny_target.info).to_dict()
    for fields, line in [
        ({"conv_kernel_size": 0}, "head.conv_kernel_size must be >= 1"),
        ({"conv_group_size": 24}, "head.conv_group_size must divide the target's hidden size 64"),
        ({"conv_group_size": 0}, "head.conv_group_size must divide the target's hidden size 64"),
        ({"selector_top_k": 0}, "head.selector_top_k must be >= 1"),
        ({"selector_top_k": 321}, "head.selector_top_k must be at most the vocabulary size 320"),
        ({"selector_rank": 0}, "head.selector_rank must be >= 1"),
        ({"selector_loss_weight": -1.0}, "head.selector_loss_weight must be >= 0"),
        ({"block_size": 1}, "head.block_size must be >= 2"),
    ]:
        with pytest.raises(SpecHeadsError, match=line) as caught:
            HeadSpec.from_config(HeadConfig(family="dflash2", **fields), tiny_target.info)
        assert "\n" not in str(caught.value), fields
