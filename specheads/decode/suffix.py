"""A suffix index over token text: what followed the text's current suffix, scored by frequency.

The hybrid drafter's text source (Suffix Decoding's, arXiv 2411.04975, in spirit): the text of the
request (prompt and answer so far) and, optionally, earlier answers of the same process are indexed
by every n-gram of up to `max_match` tokens. At a step the longest suffix of the request's text that
occurred before (in either) is the pattern; the continuations that followed its occurrences form a
trie, and each node is scored by the share of occurrences whose continuation passes through it: an
estimate of the probability that the answer takes that path. Since a child's count never exceeds
its parent's, the nodes taken best-first form a connected tree, and the sum of the scores of the
nodes taken is their expected accepted length under those estimates (the identity the tree
calibration uses for a head's rank paths, bench/calibrate.py).

Memory is bounded: the request's own text is indexed once per request, and earlier answers are kept
up to `history_tokens` tokens, the oldest answer dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

REQUEST = -1  # the document id of the request's own text


@dataclass(frozen=True)
class TextDraft:
    """The nodes a text source proposes at one step, best first: `paths[i]` is a token path below the
    root (its every prefix comes earlier in the list), `scores[i]` its estimated probability;
    `match` is the length of the matched suffix (0: nothing matched)."""

    paths: tuple[tuple[int, ...], ...] = ()
    scores: tuple[float, ...] = ()
    match: int = 0

    def chains(self, budget: int) -> list[list[int]]:
        """The first `budget` nodes as root-to-leaf chains (what tree.merge_chains hangs below a root)."""
        kept = self.paths[: max(budget, 0)]
        inner = {p[:-1] for p in kept}
        return [list(p) for p in kept if p not in inner]

    def expected(self, budget: int) -> float:
        """Expected accepted tokens of the first `budget` nodes under the scores."""
        return float(sum(self.scores[: max(budget, 0)]))


class SuffixIndex:
    """Every n-gram (n <= max_match) of the indexed documents, with where each occurrence ends.

    `extend` appends to the request's text; `start_request` begins a new one, first moving the
    finished request's answer into the history (if history_tokens > 0)."""

    def __init__(self, max_match: int = 8, history_tokens: int = 0, max_occurrences: int = 32):
        if max_match < 1:
            raise ValueError("max_match must be >= 1")
        self.max_match = max_match
        self.history_tokens = max(int(history_tokens), 0)
        self.max_occurrences = max_occurrences
        self.docs: dict[int, list[int]] = {REQUEST: []}
        self.history: OrderedDict[int, int] = OrderedDict()  # doc id -> tokens, oldest first
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> [(doc, end)]
        self.answer_from = 0  # where the request's answer starts in its text
        self._next_doc = 0

    @property
    def text(self) -> list[int]:
        return self.docs[REQUEST]

    def _ngrams(self, tokens: list[int], start: int):
        """(n-gram, end) of every n-gram (n <= max_match) of tokens ending at positions start.."""
        for end in range(start, len(tokens)):
            for n in range(1, min(self.max_match, end + 1) + 1):
                yield tuple(tokens[end - n + 1 : end + 1]), end

    def _add(self, doc: int, tokens: list[int], start: int) -> None:
        """Index the n-grams of doc ending at positions start.. (tokens is the doc's whole text)."""
        for key, end in self._ngrams(tokens, start):
            self.index.setdefault(key, []).append((doc, end))

    def _remove(self, doc: int) -> None:
        tokens = self.docs.pop(doc)
        for key in {key for key, _ in self._ngrams(tokens, 0)}:
            kept = [o for o in self.index[key] if o[0] != doc]
            if kept:
                self.index[key] = kept
            else:
                del self.index[key]

    def start_request(self, prompt: Sequence[int]) -> None:
        """A new request: the last one's answer joins the history (bounded), its prompt is dropped."""
        answer = self.text[self.answer_from :]
        self._remove(REQUEST)
        if self.history_tokens and answer:
            doc, self._next_doc = self._next_doc, self._next_doc + 1
            self.docs[doc] = answer[-self.history_tokens :]
            self.history[doc] = len(self.docs[doc])
            self._add(doc, self.docs[doc], 0)
            while sum(self.history.values()) > self.history_tokens:
                oldest, _ = self.history.popitem(last=False)
                self._remove(oldest)
        self.docs[REQUEST] = []
        self.extend(prompt)
        self.answer_from = len(prompt)

    def forget_history(self) -> None:
        """Drop every earlier answer (a benchmark's warm-up must not seed the questions it times)."""
        for doc in list(self.history):
            self._remove(doc)
        self.history.clear()
        self.answer_from = len(self.text)  # the current request's answer so far is not kept either

    def extend(self, tokens: Sequence[int]) -> None:
        text = self.text
        start = len(text)
        text.extend(int(t) for t in tokens)
        self._add(REQUEST, text, start)

    def occurrences(self) -> tuple[int, list[tuple[int, int]]]:
        """(n, occurrences) of the longest suffix of the request's text (n <= max_match) that occurred
        before with at least one token after it: the request's own most recent first, then the
        history's newest first, at most max_occurrences. (0, []) when none."""
        text = self.text
        last = len(text) - 1
        for n in range(min(self.max_match, len(text)), 0, -1):
            found = self.index.get(tuple(text[-n:]))
            if not found:
                continue
            own = [o for o in reversed(found) if o[0] == REQUEST and o[1] < last]
            past = sorted(
                (o for o in found if o[0] != REQUEST and o[1] < len(self.docs[o[0]]) - 1), key=lambda o: -o[0]
            )
            occ = (own + past)[: self.max_occurrences]
            if occ:
                return n, occ
        return 0, []

    def draft(self, max_depth: int, budget: int) -> TextDraft:
        """The best `budget` nodes (at most max_depth deep) continuing the text's longest repeated suffix."""
        if budget < 1 or max_depth < 1:
            return TextDraft()
        n, occ = self.occurrences()
        if not occ:
            return TextDraft()
        counts: dict[tuple[int, ...], int] = {}
        for doc, end in occ:
            tokens = self.docs[doc]
            path: tuple[int, ...] = ()
            for t in tokens[end + 1 : end + 1 + max_depth]:
                path = (*path, t)
                counts[path] = counts.get(path, 0) + 1
        # best first: higher count, then shallower (a parent ties its child and comes first), then
        # the order the occurrences listed them in (dicts keep insertion order; sorted is stable)
        order = sorted(counts, key=lambda p: (-counts[p], len(p)))[:budget]
        total = len(occ)
        return TextDraft(tuple(order), tuple(counts[p] / total for p in order), n)
