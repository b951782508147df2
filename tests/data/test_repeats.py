"""Repeated n-grams inside an answer, against a plain count."""

import random

from specheads.data.repeats import answer_repeat_rate, repeated_ngrams


def plain_repeats(ids, n):
    """Each n-gram compared with every earlier one."""
    grams = [ids[i : i + n] for i in range(len(ids) - n + 1)]
    return sum(any(grams[j] == grams[i] for j in range(i)) for i in range(len(grams))), len(grams)


def test_repeated_ngrams_match_a_plain_count():
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        for n in (1, 2, 4):
            assert repeated_ngrams(ids, n) == plain_repeats(ids, n)
    assert repeated_ngrams([1, 2, 3, 4] * 5) == (13, 17)  # a loop: every 4-gram after the first cycle
    assert repeated_ngrams(list(range(20))) == (0, 17)


def test_answer_repeat_rate_reads_the_trained_tokens_only():
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9]  # a looping prompt is not the answer's doing
    answer = [1, 2, 3, 4] * 5
    row = {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}
    assert answer_repeat_rate(row) == 13 / 17
    row = {"input_ids": prompt + list(range(20)), "loss_mask": [0] * len(prompt) + [1] * 20}
    assert answer_repeat_rate(row) == 0.0
    assert answer_repeat_rate({"input_ids": [1, 2], "loss_mask": [1, 1]}) == 0.0
