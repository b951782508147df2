"""The early-exit drafter (Kangaroo): each drafted node runs the target's first L layers on the
target's own KV cache, then the head's adapter. Lossless like every drafter: greedy output equals the
target's own greedy output token for token with drafts accepted, under every tree policy and through
the hybrid drafter; sampled tokens follow the target's distribution with drafts accepted and
rejected. At every draft each node's layer-L state equals the target's own state for the node's
sequence (a full forward): shown failing for a drafter whose nodes sit one position off the reused
keys and values, and the loop shown failing for one that leaves its drafted keys and values in the
target's cache."""

import pytest
import torch
from conftest import POLICIES, assert_first_two_tokens_follow, hf_greedy, leaves_one_drafted_entry
from test_generate import accepts_any_draft_in_support, first_two_probs, first_two_samples

from specheads.config.train import HeadConfig
from specheads.decode.drafters import EarlyExitDrafter, make_drafter, make_hybrid_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import HybridPolicy
from specheads.decode.target_layers import crop_layers
from specheads.decode.tree import static_tree
from specheads.heads import build_head

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def early_exit(target, exit_layer):
    """A fresh head: the identity adapter, so it drafts the target's logit lens at layer L (at
    L = every layer, the target's own ranks; at 5 of 6, often the target's token)."""
    torch.manual_seed(0)
    return build_head(HeadConfig(family="early_exit", exit_layer=exit_layer), target).eval()


class PositionsOffByOne(EarlyExitDrafter):
    """Wrong: every drafted node one position on from the committed keys and values it reuses."""

    def node_positions(self, prefix_len, depths):
        return [p + 1 for p in super().node_positions(prefix_len, depths)]


LeavesItsDrafts = leaves_one_drafted_entry(EarlyExitDrafter)


class Checked(EarlyExitDrafter):
    """After every draft, each node's layer-L state against the target's full forward over the
    committed sequence and the node's path (the drafter's own `exit_states`)."""

    def start(self, prompt_ids, states, root):
        super().start(prompt_ids, states, root)
        self.seq = prompt_ids[0].tolist() + [root]
        self.checked = 0

    def advance(self, states, tokens, bonus):
        super().advance(states, tokens, bonus)
        self.seq += list(tokens[1:]) + [bonus]

    def draft(self, root, prefix_len, max_depth):
        tokens, layout = super().draft(root, prefix_len, max_depth)
        target, layer = self.head.frozen_target, self.head.exit_layer
        for node, state in self.exit_states.items():
            path = [self.table.tokens[i] for i in path_to(self.table, node)]
            with torch.no_grad(), target.capture([layer]) as store:
                target.model.get_decoder()(torch.tensor([self.seq[:-1] + path]))
            ref = store[layer][0, -1]
            assert (state - ref).norm() <= 1e-5 * ref.norm(), (node, path)
            self.checked += 1
        return tokens, layout


def checked(base):
    return type(f"Checked{base.__name__}", (Checked, base), {})


def path_to(table, node):
    path = [node]
    while table.parents[path[-1]] >= 0:
        path.append(table.parents[path[-1]])
    return path[::-1]


REFERENCE: dict = {}  # (target, n) -> the target's own greedy continuation of PROMPT


def check_greedy(target, drafter, n=24):
    if (id(target), n) not in REFERENCE:
        REFERENCE[id(target), n] = hf_greedy(target, PROMPT, n)
    res = speculative_generate(target, drafter, PROMPT, SamplingConfig(max_new_tokens=n))
    assert res.output_ids == REFERENCE[id(target), n]
    return res


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_output_is_the_targets_with_drafts_accepted(policy, tiny_target):
    """At L = every layer the drafts are the target's own ranks: a static tree's top-1 path is
    always accepted; at L = 5 of 6 often."""
    for exit_layer in (6, 5):
        res = check_greedy(tiny_target, make_drafter(early_exit(tiny_target, exit_layer), POLICIES[policy]))
        assert sum(res.accepted_drafts) > 0, (exit_layer, res.accepted_drafts)
        if exit_layer == 6 and policy in ("chain", "wide", "medusa-like"):
            assert res.accepted_drafts == res.tree_depths, res.accepted_drafts


@pytest.mark.parametrize("policy", ["chain", "wide", "dynamic"])
def test_a_draft_vocabulary_drafts_its_tokens_only(policy, tiny_target):
    """head.draft_vocab over the reference answer's own tokens: at L = every layer the draft is the
    target's top-1 among them, so drafts are accepted; each drafted token is in the vocabulary,
    and the output is the target's."""
    n = 24
    check_greedy(tiny_target, make_drafter(early_exit(tiny_target, 6), POLICIES[policy]), n)
    answer = PROMPT[0].tolist() + REFERENCE[id(tiny_target), n]
    rows = [{"input_ids": answer, "loss_mask": [1] * len(answer)}]
    torch.manual_seed(0)
    head = build_head(
        HeadConfig(family="early_exit", exit_layer=6, draft_vocab=True, draft_vocab_size=32), tiny_target, rows
    )
    drafter = make_drafter(head.eval(), POLICIES[policy])
    drafted = []
    real = drafter.draft

    def draft(*args, **kwargs):
        tokens, layout = real(*args, **kwargs)
        drafted.extend(tokens[1:])
        return tokens, layout

    drafter.draft = draft
    res = check_greedy(tiny_target, drafter, n)
    assert sum(res.accepted_drafts) > 5 and drafted
    assert all(head.t2d[t] for t in drafted)


def test_each_nodes_layer_state_is_the_targets_own(tiny_target):
    """A tree with siblings (sharing a position) and grandchildren, step after step: every node's
    layer-L state equals the full forward's, and the output the target's."""
    drafter = checked(EarlyExitDrafter)(early_exit(tiny_target, 5), POLICIES["wide"])
    res = check_greedy(tiny_target, drafter, n=12)
    assert drafter.checked >= 10 and sum(res.accepted_drafts) > 0


def test_greedy_output_through_the_hybrid_drafter(tiny_target):
    """Steps drafted by the text alone leave the adapter's positions queued (the target's cache is
    the loop's): the next head step catches up on all of them."""
    head = early_exit(tiny_target, 5)
    policy = HybridPolicy(head=POLICIES["chain"], ngram_nodes=2, text_alone=4, alone_ngram=1)
    drafter = make_hybrid_drafter(head, policy)
    prompt = torch.tensor([[7, 8, 9, 7, 8, 9, 7, 8]])
    res = speculative_generate(tiny_target, drafter, prompt, SamplingConfig(max_new_tokens=24))
    assert res.output_ids == hf_greedy(tiny_target, prompt, 24)
    assert sum(res.accepted_drafts) > 0


@pytest.mark.parametrize("wrong", [PositionsOffByOne, LeavesItsDrafts])
def test_a_drafter_off_by_one_position_fails(wrong, tiny_target):
    """The layer-L check (positions off) or the loop itself (a stale entry in the verified cache) fails."""
    with pytest.raises((AssertionError, RuntimeError)):
        check_greedy(tiny_target, checked(wrong)(early_exit(tiny_target, 5), POLICIES["wide"]), n=12)


def test_sampled_tokens_follow_the_target_distribution(tiny_target, monkeypatch):
    """The first two sampled tokens (the second decided by a tree verification) against the
    target's joint distribution, drafts both accepted and rejected; a rule that accepts every draft
    in the target's support fails the same check."""
    # one level of three: the second token is the tree verification's, accepted draft or not
    drafter = make_drafter(early_exit(tiny_target, 6), static_tree([[0], [1], [2]]))
    temperature, top_p, n = 0.7, 0.9, 200
    p1, p2 = first_two_probs(tiny_target, PROMPT, temperature, top_p)
    counts, accepted = first_two_samples(tiny_target, drafter, PROMPT, n, temperature, top_p)
    assert accepted[0] > n * 0.1 and accepted[1] > n * 0.3, accepted
    assert_first_two_tokens_follow(counts, p1, p2, n)
    import specheads.decode.generate as generate

    monkeypatch.setattr(generate, "speculative_accept", accepts_any_draft_in_support)
    n = 80  # enough to reject it by far
    counts, _ = first_two_samples(tiny_target, drafter, PROMPT, n, temperature, top_p)
    with pytest.raises(AssertionError):
        assert_first_two_tokens_follow(counts, p1, p2, n)


class Recording(EarlyExitDrafter):
    """Keeps the full table of every draft as deep as its policy, by its committed length."""

    def draft(self, root, prefix_len, max_depth):
        out = super().draft(root, prefix_len, max_depth)
        if max_depth >= self.policy.depth:  # not cut by the loop's token limit
            self.tables = {**getattr(self, "tables", {}), prefix_len: self.table}
        return out


def test_calibration_grows_the_trees_the_loop_drafts(tiny_target, monkeypatch):
    """tree=auto's dynamic trees (bench/dynamic_trees.grow_along) draft along the answer on views of
    one forward's cache: at every position the loop drafted, the same growth (node depths, path
    scores, the true path's ranks). A view one entry too long is refused (the drafter's guard)."""
    from specheads.bench import dynamic_trees
    from specheads.bench.dynamic_trees import grow_along, growth_of
    from specheads.decode.kv import cache_prefix
    from specheads.decode.policy import DynamicTreeSpec

    head = early_exit(tiny_target, 5)
    spec = DynamicTreeSpec(3, 3, total_tokens=1)
    drafter = Recording(head, spec)
    res = speculative_generate(tiny_target, drafter, PROMPT, SamplingConfig(max_new_tokens=12))
    full = PROMPT[0].tolist() + res.output_ids
    start = PROMPT.shape[1]
    grown = grow_along(tiny_target, head, full, start, (3,), depth=3)[3]
    assert len(drafter.tables) >= 5
    for prefix_len, table in drafter.tables.items():
        mine, theirs = growth_of(table, full[prefix_len + 1 : prefix_len + 4]), grown[prefix_len - start]
        assert mine.depths == theirs.depths and mine.truth == theirs.truth
        assert mine.scores == pytest.approx(theirs.scores, abs=1e-4)
    monkeypatch.setattr(dynamic_trees, "cache_prefix", lambda cache, n: cache_prefix(cache, n + 1))
    with pytest.raises(RuntimeError, match="out of step"):
        grow_along(tiny_target, head, full, start, (3,), depth=3)


def test_drafting_needs_the_targets_cache_at_the_committed_length(tiny_target):
    drafter = make_drafter(early_exit(tiny_target, 3), POLICIES["chain"])
    with pytest.raises(RuntimeError, match="bind_target_cache"):
        drafter.draft(5, 8, 4)
    from specheads.decode.kv import new_cache

    cache = new_cache(tiny_target.model)
    with torch.no_grad(), tiny_target.capture(drafter.layer_ids) as store:
        tiny_target.model(PROMPT, cache=cache, use_cache=True)
    drafter.bind_target_cache(cache)
    drafter.start(PROMPT, dict(store), 5)
    tokens, layout = drafter.draft(5, PROMPT.shape[1], 4)
    assert len(tokens) == 5 and all(layer.get_seq_length() == PROMPT.shape[1] for layer in cache.layers)
    crop_layers(cache, [0], PROMPT.shape[1] - 1)
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.draft(5, PROMPT.shape[1], 4)
