"""The steps greedy speculative decoding takes along the target's own answers.

Calibration and replay know, at every answer position (replay.rank_vectors' positions: the tree
rooted at answer token i, an answer of n + 1 tokens having n of them), how many drafts a setting
would accept there. The loop does not step at every position: a step rooted at answer token i that
accepts a drafts emits a + 1 tokens (the drafts and the target's own token), and the next step is
rooted at answer token i + a + 1. Averaging over every position counts a long accepted run once
per token of it (text copied from the prompt: 3.5 tokens a step per position where the loop made
2.1), so every scorer walks the answers as the loop does (`walk`) and divides the answers' tokens
by the steps it visited.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def answer_lengths(prompts: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]]) -> list[int]:
    """Positions per answer (rank_vectors' count: an answer of n + 1 tokens roots n steps' trees,
    its last token none), for the prompts and their prompt + answer contexts."""
    return [max(len(full) - len(ids) - 1, 0) for ids, full in zip(prompts, contexts)]


def walk(lengths: Sequence[int], accepted: Sequence[int] | Callable[[int], int]) -> list[int]:
    """The positions the greedy loop steps at, as indices into the flat per-position list (the
    answers' positions one after another, `lengths[j]` of answer j).

    The rule: each answer starts at its position 0; a step at position i accepts a = accepted[i]
    drafts (accepted may be a function of the flat index, called once per visited position, in
    order: an adaptive rule choosing at the steps it takes) and the next step is at i + a + 1; the
    answer ends when that reaches its length. A step whose drafts reach past the answer's end is
    its last (the loop stops at EOS or max_new_tokens), so each answer of n positions makes
    exactly n tokens after its prefill's: a setting's tau is sum(lengths) / len(walk(...)).
    """
    if not callable(accepted) and len(accepted) != sum(lengths):
        raise ValueError(f"{len(accepted)} positions' acceptance for answers of {sum(lengths)} positions")
    visited: list[int] = []
    append = visited.append  # plain lists and ints: calibration walks thousands of settings
    start = 0
    for n in lengths:
        i, end = start, start + n
        if callable(accepted):
            while i < end:
                append(i)
                i += 1 + accepted(i)
        else:
            while i < end:
                append(i)
                i += 1 + accepted[i]
        start = end
    return visited


def walked_tau(lengths: Sequence[int], steps: int) -> float:
    """Tokens per step of a walk of `steps` steps over these answers (1.0 with no steps)."""
    return sum(lengths) / steps if steps else 1.0
