"""The walk every calibration scorer takes: the positions the greedy loop steps at."""

import random

import pytest

from specheads.bench.walk import answer_lengths, walk, walked_tau


def loop_roots(n_tokens: int, accepted_at) -> list[int]:
    """A plain greedy loop over an answer of n_tokens tokens: the prefill emits token 0; each step
    is rooted at the last token emitted, emits the drafts it accepts and the target's own token,
    and nothing is emitted past the answer's last token (EOS or max_new_tokens). Returns the roots
    of its steps, as answer token indices."""
    emitted, roots = min(n_tokens, 1), []
    while emitted < n_tokens:
        root = emitted - 1
        roots.append(root)
        emitted = min(emitted + accepted_at(root) + 1, n_tokens)
    return roots


def check_walk(seed, walker=walk):
    rng = random.Random(seed)
    tokens = [rng.choice([0, 1, 2, rng.randint(3, 30)]) for _ in range(rng.randint(1, 5))]
    lengths = [max(n - 1, 0) for n in tokens]
    # runs of long acceptance, as copied text has, and acceptance past the answer's end
    accepted = [rng.choice([0, 0, 1, 2, rng.randint(3, 40)]) for _ in range(sum(lengths))]
    expected, start = [], 0
    for n, positions in zip(tokens, lengths):
        expected += [start + r for r in loop_roots(n, lambda root, s=start: accepted[s + root])]
        start += positions
    assert walker(lengths, accepted) == expected, (tokens, accepted)


@pytest.mark.parametrize("seed", range(200))
def test_walk_visits_the_roots_of_a_plain_greedy_loop(seed):
    check_walk(seed)


def test_the_walk_check_fails_for_every_position_counted():
    """The check can fail: counting every position as a step (the scorers before) is caught."""

    def every_position(lengths, accepted):
        return list(range(sum(lengths)))

    with pytest.raises(AssertionError):
        for seed in range(20):
            check_walk(seed, every_position)


def test_walk_edge_cases():
    assert walk([], []) == [] and walk([0, 0], []) == []
    assert walk([1], [5]) == [0]  # an answer of 2 tokens: one step, whatever it accepts
    assert walk([0, 1, 0], [0]) == [0]
    assert walk([4], [3, 9, 9, 9]) == [0]  # the first step accepts the whole answer
    assert walk([4], [1, 9, 0, 0]) == [0, 2, 3]
    assert walk([2, 3], [0, 0, 1, 9, 9]) == [0, 1, 2, 4]  # the second answer starts at its own position 0
    # a function of the position: called once per step, in order
    calls = []
    assert walk([3, 2], lambda i: calls.append(i) or 1) == [0, 2, 3] and calls == [0, 2, 3]
    with pytest.raises(ValueError):
        walk([3], [0, 0])


def test_walked_tau_and_answer_lengths():
    assert walked_tau([3, 4], 2) == 3.5 and walked_tau([0], 0) == 1.0
    # an answer of n tokens has n - 1 positions (rank_vectors'), an empty one none
    assert answer_lengths([[1, 2], [3], [4]], [[1, 2, 5, 6, 7], [3, 9], [4]]) == [2, 0, 0]
