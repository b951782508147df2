"""Keep evaluation prompts out of training data: word n-gram overlap with any eval prompt drops.

Text is normalised to lowercase word tokens (\\w+). A training example is dropped when one of its
user turns shares an n-gram (default 13 words) with an evaluation prompt; an evaluation prompt
shorter than n words (but at least MIN_SHORT_WORDS long) matches when it appears whole.

The evaluation set is the shipped dev prompts (specheads/data/dev_questions.jsonl, always
included) plus whatever files or globs the config names (`data.decontaminate`,
`distill.decontaminate`).
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import SpecHeadsError
from .questions import DEV_QUESTIONS

MIN_SHORT_WORDS = 6
PROMPT_KEYS = ("prompt", "question", "instruction")
_WORD = re.compile(r"\w+")
_GLOB_CHARS = set("*?[")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def resolve_eval_files(patterns: Iterable[str]) -> list[Path]:
    """The shipped dev prompts (always, first), then the files named by paths or globs.

    A relative path or glob is read from the working directory (an installed specheads has no
    checkout to look in); a glob that matches nothing is skipped with one printed line saying so.
    A missing plain path is an error.
    """
    files: list[Path] = [DEV_QUESTIONS]
    for pattern in patterns or ():
        pattern = str(Path(pattern).expanduser()) if str(pattern).startswith("~") else str(pattern)
        if _GLOB_CHARS & set(pattern):
            found = sorted(glob.glob(pattern))
            if not found:
                print(f"decontamination: {pattern} matches no file; skipped", flush=True)
            files.extend(Path(f) for f in found)
        elif Path(pattern).is_file():
            files.append(Path(pattern))
        else:
            raise SpecHeadsError(f"decontamination file {pattern} does not exist")
    unique = {f.resolve(): f for f in files}
    return list(unique.values())


def eval_prompts(files: Iterable[str | Path]) -> list[str]:
    """Every prompt of FastChat question.jsonl ("turns"), ShareGPT/OpenAI (user turns) or
    {"prompt"|"question"|"instruction": str} files."""
    from .formats import iter_rows, row_to_conversation

    prompts: list[str] = []
    for file in files:
        for where, row in iter_rows(str(file)):
            if isinstance(row, dict) and isinstance(row.get("turns"), list):
                prompts.extend(t for t in row["turns"] if isinstance(t, str))
            elif isinstance(row, dict) and any(isinstance(row.get(k), str) for k in PROMPT_KEYS):
                prompts.extend(row[k] for k in PROMPT_KEYS if isinstance(row.get(k), str))
            else:
                conversation = row_to_conversation(row, "auto", where)
                prompts.extend(m["content"] for m in conversation if m["role"] == "user")
    return prompts


class NgramIndex:
    """The n-grams of a set of evaluation prompts; `matches(text)` tests one training text."""

    def __init__(self, prompts: Iterable[str], n: int = 13):
        if n < 1:
            raise SpecHeadsError(f"decontamination n-gram size must be >= 1, got {n}")
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.short: dict[int, set[tuple[str, ...]]] = {}
        for prompt in prompts:
            toks = words(prompt)
            if len(toks) >= n:
                self.grams.update(_ngrams(toks, n))
            elif len(toks) >= min(MIN_SHORT_WORDS, n):
                self.short.setdefault(len(toks), set()).add(tuple(toks))

    def __bool__(self) -> bool:
        return bool(self.grams or self.short)

    def matches(self, text: str) -> bool:
        toks = words(text)
        if any(g in self.grams for g in _ngrams(toks, self.n)):
            return True
        return any(g in grams for size, grams in self.short.items() for g in _ngrams(toks, size))


def _ngrams(toks: Sequence[str], n: int):
    return (tuple(toks[i : i + n]) for i in range(len(toks) - n + 1))


def build_index(eval_files: Iterable[str | Path], n: int = 13) -> NgramIndex:
    return NgramIndex(eval_prompts(eval_files), n)


def decontaminate(conversations: list, eval_files_or_index, n: int = 13) -> tuple[list, int]:
    """Drop conversations whose user turns overlap an evaluation prompt; (kept, dropped count)."""
    index = _as_index(eval_files_or_index, n)
    if not index:
        return list(conversations), 0
    kept = [c for c in conversations if not any(m["role"] == "user" and index.matches(m["content"]) for m in c)]
    return kept, len(conversations) - len(kept)


def _as_index(eval_files_or_index, n: int) -> NgramIndex:
    if isinstance(eval_files_or_index, NgramIndex):
        return eval_files_or_index
    return build_index(eval_files_or_index, n)
