"""The suffix index: its continuations against a plain search over the same text, its bounded history."""

import random

import pytest
from conftest import fails_for_some_seed

from specheads.decode.suffix import REQUEST, SuffixIndex, TextDraft


def plain_draft(request, history, max_match, max_depth):
    """The scored continuations written plainly: the longest suffix of `request` (n <= max_match)
    that occurs earlier in it or anywhere in an earlier answer with a token after it; every such
    occurrence's continuation (cut at max_depth) counts once for each of its prefixes; a path's score
    is its count over the occurrences. Returns (n, {path: score})."""
    docs = [(request, len(request) - 1)] + [(h, len(h)) for h in history]  # (text, ends before)
    for n in range(min(max_match, len(request)), 0, -1):
        pattern = request[-n:]
        conts = []
        for text, limit in docs:
            for end in range(n - 1, len(text)):
                if end < limit and end + 1 < len(text) and text[end - n + 1 : end + 1] == pattern:
                    conts.append(text[end + 1 : end + 1 + max_depth])
        if conts:
            counts = {}
            for c in conts:
                for m in range(1, len(c) + 1):
                    counts[tuple(c[:m])] = counts.get(tuple(c[:m]), 0) + 1
            return n, {p: k / len(conts) for p, k in counts.items()}
    return 0, {}


def random_case(seed):
    rng = random.Random(seed)
    vocab = rng.randint(2, 5)
    history = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(0, 3))]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    answer = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
    return rng, history, prompt, answer


def indexed(history, prompt, answer, max_match, make=SuffixIndex):
    index = make(max_match=max_match, history_tokens=10_000, max_occurrences=10_000)
    for h in history:  # each earlier answer: a request whose whole text is its answer
        index.start_request([])
        index.extend(h)
    index.start_request(prompt)
    for t in answer:  # token by token, as decoding commits them
        index.extend([t])
    return index


def check_draft(make, seed):
    rng, history, prompt, answer = random_case(seed)
    max_match, depth = rng.randint(1, 5), rng.randint(1, 6)
    index = indexed(history, prompt, answer, max_match, make)
    n, scores = plain_draft(prompt + answer, history, max_match, depth)
    everything = index.draft(depth, 10_000)
    assert everything.match == n
    assert dict(zip(everything.paths, everything.scores)) == pytest.approx(scores)
    budget = rng.randint(1, 8)
    some = index.draft(depth, budget)
    # the best `budget` nodes: prefix-closed, and no left-out node scores above a kept one
    assert len(some.paths) == min(budget, len(scores))
    assert all(p[:-1] in some.paths or len(p) == 1 for p in some.paths)
    left_out = [s for p, s in scores.items() if p not in some.paths]
    assert not left_out or max(left_out) <= min(some.scores) + 1e-12
    assert some.expected(budget) == pytest.approx(sum(some.scores))


@pytest.mark.parametrize("seed", range(40))
def test_the_suffix_index_agrees_with_a_plain_search(seed):
    check_draft(SuffixIndex, seed)


class ShortestMatchFirst(SuffixIndex):
    """A wrong variant: the shortest repeated suffix instead of the longest."""

    def occurrences(self):
        text, last = self.text, len(self.text) - 1
        for n in range(1, min(self.max_match, len(text)) + 1):
            found = [
                o
                for o in self.index.get(tuple(text[-n:]), [])
                if (o[0] == REQUEST and o[1] < last) or (o[0] != REQUEST and o[1] < len(self.docs[o[0]]) - 1)
            ]
            if found:
                return n, found
        return 0, []


class OwnTextOnly(SuffixIndex):
    """A wrong variant: earlier answers never searched."""

    def occurrences(self):
        n, occ = super().occurrences()
        return (n, [o for o in occ if o[0] == REQUEST]) if any(o[0] == REQUEST for o in occ) else (0, [])


def test_the_suffix_check_fails_on_a_wrong_index():
    assert fails_for_some_seed(check_draft, ShortestMatchFirst, range(40))
    assert fails_for_some_seed(check_draft, OwnTextOnly, range(40))


def test_the_history_is_bounded_and_drops_the_oldest_answer_whole():
    index = SuffixIndex(max_match=3, history_tokens=10)
    for answer in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]):
        index.start_request([0])
        index.extend(answer)
    index.start_request([0])
    assert sum(index.history.values()) <= 10
    kept = [index.docs[d] for d in index.history]
    assert kept == [[5, 6, 7, 8], [9, 9, 9, 9]]
    # nothing of the dropped answer is left in the index: it equals one built on the kept answers
    fresh = SuffixIndex(max_match=3, history_tokens=10)
    for answer in kept:
        fresh.start_request([0])
        fresh.extend(answer)
    fresh.start_request([0])

    def entries(ix):
        return {k: [ix.docs[d][e - len(k) + 1 :] for d, e in v] for k, v in ix.index.items()}

    assert entries(index) == entries(fresh)
    index.forget_history()
    assert not index.history and set(index.docs) == {REQUEST}
    assert all(d == REQUEST for v in index.index.values() for d, _ in v)


def test_a_continuation_repeated_across_answers_is_drafted_from_the_history():
    index = SuffixIndex(max_match=4, history_tokens=100)
    for _ in range(3):
        index.start_request([7, 7])
        index.extend([1, 2, 3, 4, 5])
    index.start_request([8, 8, 1, 2])
    draft = index.draft(max_depth=3, budget=3)
    assert draft.match == 2 and draft.paths == ((3,), (3, 4), (3, 4, 5)) and draft.scores == (1.0, 1.0, 1.0)
    assert TextDraft(draft.paths, draft.scores).chains(2) == [[3, 4]]
    assert SuffixIndex(max_match=4).draft(3, 3) == TextDraft()
