"""Conversations -> token ids with an assistant-only loss mask, and the train/eval datasets.

Formats: ShareGPT ({"conversations": [{"from", "value"}]}) and OpenAI ({"messages": [{"role",
"content"}]}), read from a local .json/.jsonl/.parquet file, a directory (a distillation output, a
`datasets` save_to_disk directory, or a folder of such files) or a Hub id.

The loss mask is found on the rendered text, so it works for any chat template: each message's
content is located in the rendered conversation (anchored by rendering the conversation prefix by
prefix), and the tokenizer's offset mapping turns those character spans into token spans.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from tqdm.auto import tqdm

from ..config.train import DataConfig
from ..errors import SpecHeadsError

Conversation = list[dict[str, str]]

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
OPENAI_ROLES = {"user", "assistant", "system"}
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


# ---------------------------------------------------------------------------------------------
# Reading


def load_conversations(path: str, format: str = "auto", split: str = "train") -> list[Conversation]:
    """Read conversations as lists of {"role", "content"} messages; malformed rows raise."""
    if format not in ("auto", "sharegpt", "openai"):
        raise SpecHeadsError(f"unknown data format {format!r}; use auto, sharegpt or openai")
    conversations = []
    for where, row in iter_rows(path, split):
        conversations.append(row_to_conversation(row, format, where))
    return conversations


def iter_rows(path: str, split: str = "train") -> Iterable[tuple[str, Any]]:
    """(location for error messages, row) for every row of a file, directory or Hub data set."""
    local = Path(path).expanduser()
    if local.is_file():
        yield from _file_rows(local)
    elif local.is_dir():
        yield from _dir_rows(local, split)
    elif path.startswith((".", "/", "~")) or local.suffix in DATA_FILE_SUFFIXES:
        raise SpecHeadsError(f"data file {path} does not exist")
    else:
        yield from _hub_rows(path, split)


def _file_rows(file: Path) -> Iterable[tuple[str, Any]]:
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        with open(file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{file}:{lineno}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise SpecHeadsError(f"{file}:{lineno}: invalid JSON ({err.msg})") from None
    elif suffix == ".json":
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
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
        raise SpecHeadsError(f"{file}: unsupported data file type; use .json, .jsonl or .parquet")


def _dir_rows(directory: Path, split: str) -> Iterable[tuple[str, Any]]:
    from ..distill.regenerate import completed_shard_files, is_distill_output

    if is_distill_output(directory):
        for file in completed_shard_files(directory):
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
    files = sorted(p for p in directory.iterdir() if p.suffix.lower() in DATA_FILE_SUFFIXES)
    if not files:
        raise SpecHeadsError(f"{directory} holds no .json/.jsonl/.parquet data files")
    for file in files:
        yield from _file_rows(file)


def _hub_rows(name: str, split: str) -> Iterable[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as err:  # network, missing repo, bad split: all are the user's input
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecHeadsError(f"cannot load data set {name!r} (split {split!r}): {first}") from None
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


# ---------------------------------------------------------------------------------------------
# Tokenizing


def render(tokenizer, messages: Conversation, add_generation_prompt: bool = False) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise SpecHeadsError("the tokenizer has no chat template; set one on the target's tokenizer")
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: Conversation) -> tuple[str, list[tuple[int, int]], list[int]]:
    """The rendered conversation, the character span of every assistant message's content, and
    the index of the message each span belongs to."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = render(tokenizer, plain)
    spans, owners, cursor = [], [], 0
    for i, message in enumerate(messages):
        anchored = False
        if message["role"] == "assistant":
            # Anchor the search after the generation prompt, so a short answer ("user") cannot
            # be matched inside the template's own header text.
            prefix = render(tokenizer, plain[:i], add_generation_prompt=True) if i else ""
            if prefix and text.startswith(prefix):
                cursor, anchored = max(cursor, len(prefix)), True
        content = message["content"]
        if not content.strip():
            if anchored:  # an empty answer still ends its turn: train on the end token
                spans.append((cursor, cursor))
                owners.append(i)
            continue
        start = text.find(content, cursor)
        if start < 0:  # some templates strip the content
            content = content.strip()
            start = text.find(content, cursor)
        if start < 0:  # the template rewrote this message: it gets no loss (rows left with
            continue   # no assistant token at all are dropped by build_datasets)
        end = start + len(content)
        if message["role"] == "assistant":
            spans.append((start, end))
            owners.append(i)
        cursor = end
    return text, spans, owners


def tokenize_conversation(tokenizer, messages: Conversation, max_length: int) -> dict[str, list[int]]:
    """Chat-template token ids and a mask that is 1 exactly on assistant content + its end token."""
    text, spans, owners = assistant_char_spans(tokenizer, messages)
    # a cut-off answer keeps its loss on the content but not on the end token after it
    cut = [bool(messages[i].get("truncated")) for i in owners]
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    else:
        ids, offsets = _tokenize_pieces(tokenizer, text, spans)
    end_ids = special_token_ids(tokenizer)
    mask = [0] * len(ids)
    k = 0
    for n, (start, end) in enumerate(spans):
        while k < len(ids) and offsets[k][1] <= start:
            k += 1
        while k < len(ids) and offsets[k][0] < end:
            if offsets[k][1] > offsets[k][0]:  # zero-width tokens carry no text
                mask[k] = 1
            k += 1
        # The token that closes the turn is predicted from the answer: train on it too.
        if k < len(ids) and ids[k] in end_ids and not cut[n]:
            mask[k] = 1
            k += 1
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def special_token_ids(tokenizer) -> set[int]:
    """Special tokens (eos, <|im_end|>, <|eot_id|>, ...): the ones that may close a turn."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            ids.add(tokenizer.convert_tokens_to_ids(token.content))
    return ids


def _tokenize_pieces(tokenizer, text: str, spans: list[tuple[int, int]]):
    """Offsets for slow tokenizers: tokenize the text piecewise at the span boundaries."""
    cuts = sorted({0, len(text), *[c for span in spans for c in span]})
    ids, offsets = [], []
    for a, b in zip(cuts, cuts[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        # Spread the piece's characters over its tokens; only the piece boundary matters here.
        offsets.extend((a, b) if j == len(piece) - 1 else (a, a + 1) for j in range(len(piece)))
    return ids, offsets


# ---------------------------------------------------------------------------------------------
# Data sets


def build_datasets(data_cfg: DataConfig, tokenizer, target=None):
    """(train, eval) `datasets.Dataset`s with columns input_ids and loss_mask."""
    import datasets

    from .decontaminate import decontaminate, resolve_eval_files

    path = data_cfg.path
    if path == "builtin":
        if target is None:
            raise SpecHeadsError("data.path=builtin needs the target to write its own data")
        from ..distill.builtin import ensure_builtin_data

        path = str(ensure_builtin_data(target, data_cfg))
    conversations = load_conversations(path, data_cfg.format, data_cfg.split)
    eval_files = resolve_eval_files(data_cfg.decontaminate)
    if eval_files:
        conversations, dropped = decontaminate(conversations, eval_files, n=data_cfg.ngram)
        print(f"decontamination: dropped {dropped} of {len(conversations) + dropped} conversations "
              f"overlapping {len(eval_files)} evaluation file(s)")
    order = list(range(len(conversations)))
    random.Random(data_cfg.shuffle_seed).shuffle(order)
    if data_cfg.max_examples is not None:
        order = order[: data_cfg.max_examples]
    rows = []
    for i in tqdm(order, desc="tokenizing", unit="conv", leave=False, disable=len(order) < 2000):
        row = tokenize_conversation(tokenizer, conversations[i], data_cfg.max_length)
        if any(row["loss_mask"]):
            rows.append(row)
    if not rows:
        raise SpecHeadsError(f"no usable conversation with an assistant turn in {data_cfg.path}")
    n_eval = eval_count(len(rows), data_cfg.eval_fraction)
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    return _to_dataset(datasets, train_rows), _to_dataset(datasets, eval_rows)


def eval_count(n: int, fraction: float) -> int:
    if not 0.0 <= fraction < 1.0:
        raise SpecHeadsError(f"data.eval_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0 or n < 2:
        return 0
    return min(n - 1, max(1, round(n * fraction)))


def _to_dataset(datasets, rows: list[dict]):
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    })
    return datasets.Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]},
        features=features,
    )


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded LongTensors input_ids, attention_mask, loss_mask [B, T]."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {k: torch.zeros(len(rows), width, dtype=torch.long)
           for k in ("input_ids", "attention_mask", "loss_mask")}
    out["input_ids"].fill_(pad_id)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][b, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        out["attention_mask"][b, :n] = 1
        out["loss_mask"][b, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
    return out


def first_user_turn(conversation: Conversation) -> Optional[str]:
    return next((m["content"] for m in conversation if m["role"] == "user"), None)
