"""tree=auto's dynamic trees: one full growth per position must predict what the real drafter of
every smaller and floored dynamic tree drafts and accepts there."""

import dataclasses
import math

import pytest
from conftest import along_answer, quick_head, tree_accepts  # noqa: E402  (the quick overfitting helper)

from specheads.bench.dynamic_trees import Growth, accepted_within, dynamic_choice, grow_along
from specheads.decode.baselines import PlainDrafter
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import DynamicTreeSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def drafted_at_each_position(target, head, full, start, spec):
    """(accepted, tree size, levels drafted) of the real drafter at each answer position, fed one
    true token at a time as grow_along feeds its own: the plain walk down the drafted tree."""

    def drafted(drafter, r):
        tokens, layout = drafter.draft(full[r], r, spec.depth)
        accepted = tree_accepts(tokens, layout, full[r + 1 : r + 1 + spec.depth])
        return accepted, layout.size, max(drafter.table.depths)

    return along_answer(make_drafter(head, spec), target, full, start, drafted)


def ignoring_depth(g: Growth) -> Growth:
    """A wrong model: ranks counted over every drafted node, deeper ones included."""
    return dataclasses.replace(g, depths=tuple(1 for _ in g.depths))


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_one_growth_predicts_every_smaller_and_floored_dynamic_tree(family, tiny_target, sequences):
    head = quick_head(tiny_target, family, sequences, steps=25)
    prompt = sequences[3:4, :8]
    plain = speculative_generate(tiny_target, PlainDrafter(), prompt, SamplingConfig(max_new_tokens=24))
    full = prompt[0].tolist() + plain.output_ids
    seen = {"floor cut levels": 0, "nodes cut acceptance": 0, "accepted": 0}
    wrong = 0
    grown = grow_along(tiny_target, head, full, 8, (2, 3), depth=3)
    for top_k, growths in grown.items():
        assert len(growths) == len(full) - 8 - 1
        # floors around the head's own path probabilities, so that some steps stop early
        top = sorted(math.exp(g.scores[0]) for g in growths)
        for depth in (1, 2, 3):
            for gate in (0.0, top[len(top) // 4], top[len(top) // 2] ** 2):
                for nodes in (1, 2, 4, 7):
                    real = drafted_at_each_position(
                        tiny_target, head, full, 8, DynamicTreeSpec(depth, top_k, nodes, gate)
                    )
                    predicted = [g.accepted(depth, gate, nodes) for g in growths]
                    assert predicted == real, (top_k, depth, gate, nodes)
                    wrong += [ignoring_depth(g).accepted(depth, gate, nodes) for g in growths] != real
                    seen["floor cut levels"] += sum(lv < depth for _, _, lv in real)
                    seen["accepted"] += sum(a > 0 for a, _, _ in real)
                    seen["nodes cut acceptance"] += sum(
                        a < g.accepted(depth, gate, 99)[0] for (a, _, _), g in zip(real, growths)
                    )
    assert min(seen.values()) > 0, seen  # every rule was exercised
    assert wrong > 0  # and the comparison tells a wrong model apart


def test_accepted_within_stops_at_the_first_rank_outside_the_cut():
    assert [accepted_within((0, 2, 1), n) for n in (0, 1, 2, 3)] == [0, 1, 1, 3]


def test_dynamic_choice_prices_each_setting_by_its_nodes_and_levels_along_the_loops_steps():
    # positions of one top_k: nodes in rank order with their depths and path log-probs; two answers,
    # [a, e, e] and [b, e], e a position where the head drafted nothing (a step there accepts none
    # and verifies the root alone)
    a = Growth(depths=(1, 2, 1), scores=(math.log(0.8), math.log(0.5), math.log(0.1)), truth=(0, 1))
    b = Growth(depths=(1, 1, 2), scores=(math.log(0.4), math.log(0.3), math.log(0.1)), truth=(1,))
    e = Growth(depths=(), scores=(), truth=())
    verify_s = [0.0, 1.0, 1.1, 1.2, 1.3]
    draft_s = {2: {1: 0.1, 2: 0.2}}
    rows = dynamic_choice(
        {2: [a, e, e, b, e]}, verify_s, draft_s, max_depth=2, nodes=(1, 3), gates=(0.0, 0.35), lengths=[3, 2]
    )
    row = {(r["depth"], r["nodes"], r["min_path_prob"]): r for r in rows}
    # depth 2, 3 nodes, no floor: a accepts 2 (ranks 0, 1), the whole of its answer; b accepts 1,
    # the whole of its own; both draft 2 levels: 5 tokens in 2 steps
    assert row[2, 3, 0.0]["tau"] == pytest.approx(5 / 2)
    assert row[2, 3, 0.0]["tokens_per_s"] == pytest.approx(5 / (2 * (1.3 + 0.2)))
    # floor 0.35: a keeps 0.8 and 0.5 (accepts 2, drafts 2 levels); b keeps 0.4 only, so its true
    # node (0.3) is gone, yet its 0.4 reaches the floor, so level 2 is still drafted; b accepting
    # nothing, the loop steps at the e after it too
    assert row[2, 3, 0.35]["tau"] == pytest.approx(5 / 3)
    assert row[2, 3, 0.35]["tokens_per_s"] == pytest.approx(5 / ((1.2 + 0.2) + (1.1 + 0.2) + (1.0 + 0.1)))
    # depth 1, 1 node: a accepts 1 (then a step at the second e), b none (its true node ranks
    # second; then a step at its e); one level each: 4 steps (per position it was 5 positions)
    assert row[1, 1, 0.0]["tau"] == pytest.approx(5 / 4)
    assert row[1, 1, 0.0]["tokens_per_s"] == pytest.approx(5 / (2 * (1.1 + 0.1) + 2 * (1.0 + 0.1)))
