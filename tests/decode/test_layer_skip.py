"""The layer-skip drafter (Draft & Verify): the target drafts with some decoder layers skipped, on
its own KV cache. Lossless like every drafter: greedy output equals the target's own greedy output
token for token with drafts accepted, under every tree policy; sampled tokens follow the target's
distribution with drafts accepted and rejected. Every node's logits equal a plain reduced forward
(the kept layers only, each reading the full model's keys and values for the committed prefix).
Shown failing for a drafter that skips layers by changing the target and forgets to restore them
before verification, and for one that leaves its drafted keys and values in the cache."""

import pytest
import torch
from conftest import POLICIES, assert_first_two_tokens_follow, hf_greedy, leaves_one_drafted_entry
from test_generate import accepts_any_draft_in_support, first_two_probs, first_two_samples

from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.kv import new_cache
from specheads.decode.layer_skip import LayerSkipDrafter, check_skipped, kept_layers
from specheads.decode.target_layers import run_layers
from specheads.decode.tree import static_tree
from specheads.errors import SpecHeadsError

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
SKIP = (5,)  # the last of the tiny target's six layers (its random layers agree least when others go)


class PassThrough(torch.nn.Module):
    """A decoder layer that hands its input on: what a naive skip puts in the skipped layer's place."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class SkipsInPlace(LayerSkipDrafter):
    """Wrong: skips by swapping the skipped layers out of the target for its drafts and never puts
    them back, so that the target verifies with them skipped too."""

    def draft(self, root, prefix_len, max_depth):
        for i in self.skipped:
            if not isinstance(self.target.layers[i], PassThrough):
                self.originals = {**getattr(self, "originals", {}), i: self.target.layers[i]}
                self.target.layers[i] = PassThrough()
        return super().draft(root, prefix_len, max_depth)

    def restore(self):
        for i, layer in getattr(self, "originals", {}).items():
            self.target.layers[i] = layer


LeavesItsDrafts = leaves_one_drafted_entry(LayerSkipDrafter)


REFERENCE: dict = {}


def check_greedy(target, drafter, n=24):
    if n not in REFERENCE:
        REFERENCE[n] = hf_greedy(target, PROMPT, n)
    res = speculative_generate(target, drafter, PROMPT, SamplingConfig(max_new_tokens=n))
    assert res.output_ids == REFERENCE[n]
    return res


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_output_is_the_targets_with_drafts_accepted(policy, tiny_target):
    res = check_greedy(tiny_target, LayerSkipDrafter(tiny_target, SKIP, POLICIES[policy]))
    assert sum(res.accepted_drafts) >= 5, res.accepted_drafts


def recording(drafter: LayerSkipDrafter, drafted: list[int]) -> LayerSkipDrafter:
    """The drafter, with every token it drafts (roots left out) appended to `drafted`."""
    draft = drafter.draft

    def draft_and_record(root, prefix_len, max_depth):
        tokens, layout = draft(root, prefix_len, max_depth)
        drafted.extend(tokens[1:])
        return tokens, layout

    drafter.draft = draft_and_record
    return drafter


def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(tiny_target):
    """Over a draft vocabulary without the answer's most frequent token: greedy output is still the
    target's, drafts are accepted, and that token is never drafted; over every token it is."""
    answer = hf_greedy(tiny_target, PROMPT, 24)
    common = max(set(answer), key=answer.count)
    vocab = [i for i in range(tiny_target.lm_head.weight.shape[0]) if i != common]
    drafted: list[int] = []
    res = check_greedy(tiny_target, recording(LayerSkipDrafter(tiny_target, SKIP, POLICIES["wide"], vocab), drafted))
    assert sum(res.accepted_drafts) >= 5 and drafted and common not in drafted
    everything: list[int] = []
    check_greedy(tiny_target, recording(LayerSkipDrafter(tiny_target, SKIP, POLICIES["wide"]), everything))
    assert common in everything  # the check above can fail
    with pytest.raises(SpecHeadsError, match="draft vocabulary"):
        LayerSkipDrafter(tiny_target, SKIP, POLICIES["wide"], [0, 10**6])


def test_each_nodes_logits_are_the_reduced_stacks(tiny_target):
    """A tree with siblings and grandchildren: every node's draft logits against a plain forward of
    the kept layers over the node's path, on a copy of the full model's cache of the prefix."""
    drafter = LayerSkipDrafter(tiny_target, SKIP, POLICIES["wide"])
    cache = new_cache(tiny_target.model)
    drafter.bind_target_cache(cache)
    with torch.no_grad():
        out = tiny_target.model(PROMPT, cache=cache, use_cache=True)
        root = int(out.logits[0, -1].argmax())
        tokens, layout = drafter.draft(root, PROMPT.shape[1], 4)
        table = drafter.table
        assert layout.size == len(tokens) > 4 and cache.get_seq_length() == PROMPT.shape[1]
        for node in range(1, layout.size):
            path = [node]
            while layout.parents[path[-1]] > 0:
                path.append(layout.parents[path[-1]])
            path = [0] + path[::-1]
            ids = torch.tensor([[tokens[i] for i in path]])
            own = new_cache(tiny_target.model)
            tiny_target.model(PROMPT, cache=own, use_cache=True)
            positions = torch.arange(PROMPT.shape[1], PROMPT.shape[1] + len(path))
            states = run_layers(tiny_target, drafter.layers, tiny_target.embed_tokens(ids), positions, own)
            logp = torch.log_softmax(drafter.logits(states)[0, -2].float(), dim=-1)
            # the node's score is its parent's plus its own log-probability under the reduced stack
            parent = layout.parents[node]
            assert table.scores[node] - table.scores[parent] == pytest.approx(float(logp[tokens[node]]), abs=1e-4)


@pytest.mark.parametrize("wrong", [SkipsInPlace, LeavesItsDrafts])
def test_a_drafter_that_does_not_restore_the_target_fails(wrong, tiny_target):
    """Verified with its layers still skipped, the tokens the loop commits before it stops are not
    the target's, and the next draft refuses (the skipped layers' cache fell behind); verified with
    a drafted entry left in the cache, the first verification fails on it."""
    drafter, emitted = wrong(tiny_target, SKIP, POLICIES["chain"]), []
    reference = hf_greedy(tiny_target, PROMPT, 24)
    try:
        with pytest.raises((AssertionError, RuntimeError)):
            cfg = SamplingConfig(max_new_tokens=24)
            res = speculative_generate(tiny_target, drafter, PROMPT, cfg, on_step=lambda ids, _: emitted.extend(ids))
            assert res.output_ids == reference
    finally:
        if isinstance(drafter, SkipsInPlace):
            drafter.restore()
    if isinstance(drafter, SkipsInPlace):
        assert emitted != reference[: len(emitted)], emitted
    check_greedy(tiny_target, LayerSkipDrafter(tiny_target, SKIP, POLICIES["chain"]))  # the target is whole again


def test_sampled_tokens_follow_the_target_distribution(tiny_target, monkeypatch):
    """The first two sampled tokens (the second decided by a tree verification) against the
    target's joint distribution, drafts both accepted and rejected; a rule that accepts every draft
    in the target's support fails the same check."""
    drafter = LayerSkipDrafter(tiny_target, SKIP, static_tree([[0], [1], [2]]))
    temperature, top_p, n = 0.7, 0.9, 200
    p1, p2 = first_two_probs(tiny_target, PROMPT, temperature, top_p)
    counts, accepted = first_two_samples(tiny_target, drafter, PROMPT, n, temperature, top_p)
    assert accepted[0] > n * 0.1 and accepted[1] > n * 0.3, accepted
    assert_first_two_tokens_follow(counts, p1, p2, n)
    import specheads.decode.generate as generate

    monkeypatch.setattr(generate, "speculative_accept", accepts_any_draft_in_support)
    n = 80
    counts, _ = first_two_samples(tiny_target, drafter, PROMPT, n, temperature, top_p)
    with pytest.raises(AssertionError):
        assert_first_two_tokens_follow(counts, p1, p2, n)


def test_skipped_layers_are_checked():
    assert check_skipped(6, [3, 1, 3]) == (1, 3)
    assert kept_layers(6, [1, 3]) == [0, 2, 4, 5]
    with pytest.raises(SpecHeadsError, match=r"\[6\] are not decoder layers"):
        check_skipped(6, [6])
    with pytest.raises(SpecHeadsError, match="keep at least one"):
        check_skipped(2, [0, 1])
    with pytest.raises(SpecHeadsError, match="indices"):
        check_skipped(6, ["x"])


def test_drafting_needs_the_targets_cache_at_the_committed_length(tiny_target):
    drafter = LayerSkipDrafter(tiny_target, SKIP, POLICIES["chain"])
    with pytest.raises(RuntimeError, match="bind_target_cache"):
        drafter.draft(5, 8, 4)
    cache = new_cache(tiny_target.model)
    drafter.bind_target_cache(cache)
    with torch.no_grad():
        tiny_target.model(PROMPT, cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.draft(5, PROMPT.shape[1] + 1, 4)
