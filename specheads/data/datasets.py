"""The train/eval data sets: conversations -> decontaminated, shuffled, tokenized rows, and batches."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..chat_template import chat_mismatch
from ..config.train import DataConfig
from ..errors import SpecHeadsError
from .chat import tokenize_conversation
from .decontaminate import decontaminate, resolve_eval_files
from .formats import load_conversations
from .packing import packed_layout
from .repeats import answer_repeat_rate
from .shards import is_distill_output, read_metadata


def build_datasets(data_cfg: DataConfig, tokenizer):
    """(train, eval) `datasets.Dataset`s with columns input_ids and loss_mask."""
    import datasets

    sources = [data_cfg.path, *data_cfg.mix]
    if "builtin" in sources:  # the trainer builds it first (specheads.distill.builtin)
        raise SpecHeadsError("data.path=builtin needs the target to write its own data first")
    if data_cfg.max_per_source is not None and data_cfg.max_per_source < 1:
        raise SpecHeadsError(f"data.max_per_source must be a positive count, got {data_cfg.max_per_source}")
    check_chat_of_sources(sources, tokenizer)
    conversations = []
    for source in sources:
        loaded = load_conversations(source, data_cfg.format, data_cfg.split, data_cfg.partial_distill)
        total = len(loaded)
        if data_cfg.max_per_source is not None and total > data_cfg.max_per_source:
            # a seeded random subset, so a small diverse source is not drowned by a large one
            loaded = random.Random(f"{data_cfg.shuffle_seed}:{source}").sample(loaded, data_cfg.max_per_source)
        if len(sources) > 1 or len(loaded) < total:
            print(f"data: {len(loaded)} of {total} conversations from {source}")
        conversations += loaded
    eval_files = resolve_eval_files(data_cfg.decontaminate)
    if eval_files:
        conversations, dropped = decontaminate(conversations, eval_files, n=data_cfg.ngram)
        print(
            f"decontamination: dropped {dropped} of {len(conversations) + dropped} conversations "
            f"overlapping {len(eval_files)} evaluation file(s)"
        )
    limit = data_cfg.max_repeat_rate
    if limit is not None and not 0 <= limit <= 1:
        raise SpecHeadsError(f"data.max_repeat_rate must be a share between 0 and 1, got {limit}")
    order = list(range(len(conversations)))
    random.Random(data_cfg.shuffle_seed).shuffle(order)
    if data_cfg.max_examples is not None and limit is None:
        # unfiltered: the first max_examples conversations, as ever (the rows and feature caches of
        # earlier runs stay the same); filtered: read on until max_examples rows are kept
        order = order[: data_cfg.max_examples]
    rows, looping = [], 0
    for i in tqdm(order, desc="tokenizing", unit="conv", leave=False, disable=len(order) < 2000):
        if data_cfg.max_examples is not None and len(rows) >= data_cfg.max_examples:
            break
        row = tokenize_conversation(tokenizer, conversations[i], data_cfg.max_length)
        if not any(row["loss_mask"]):
            continue
        if limit is not None and answer_repeat_rate(row) > limit:
            looping += 1
            continue
        rows.append(row)
    if limit is not None:
        print(
            f"data: dropped {looping} of {looping + len(rows)} conversations read whose answers repeat more than "
            f"{limit:.0%} of their 4-grams (data.max_repeat_rate)"
        )
    if not rows:
        raise SpecHeadsError(f"no usable conversation with an assistant turn in {', '.join(sources)}")
    n_eval = eval_count(len(rows), data_cfg.eval_fraction)
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    return _to_dataset(datasets, train_rows), _to_dataset(datasets, eval_rows)


def check_chat_of_sources(sources: list[str], tokenizer) -> None:
    """One line on stderr for each distilled source whose answers were written with another chat
    template or thinking setting than this tokenizer renders them with (distill.py records its own)."""
    for source in sources:
        local = Path(source).expanduser()
        if not is_distill_output(local):
            continue
        recorded = (read_metadata(local).get("target") or {}).get("chat")
        warning = chat_mismatch(recorded, tokenizer, f"data {source} was made with", "this run renders it with")
        if warning:
            print(f"warning: {warning}", file=sys.stderr)


def eval_count(n: int, fraction: float) -> int:
    if not 0.0 <= fraction < 1.0:
        raise SpecHeadsError(f"data.eval_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0 or n < 2:
        return 0
    return min(n - 1, max(1, round(n * fraction)))


def _to_dataset(datasets, rows: list[dict]):
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    return datasets.Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]},
        features=features,
    )


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded LongTensors input_ids, attention_mask, loss_mask [B, T]."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in ("input_ids", "attention_mask", "loss_mask")}
    out["input_ids"].fill_(pad_id)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][b, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        out["attention_mask"][b, :n] = 1
        out["loss_mask"][b, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
    return out


def collate_packed(packs: list[list[dict]], pad_id: int) -> dict[str, torch.Tensor]:
    """Packed rows, one per pack of conversations, right padded: input_ids, attention_mask and
    loss_mask as collate's, plus each token's document (its conversation's place in the row, -1 on
    padding) and position_ids restarting at 0 with every conversation (specheads.data.packing)."""
    lengths = [[len(r["input_ids"]) for r in pack] for pack in packs]
    width = max(sum(n) for n in lengths)
    joined = [
        {
            "input_ids": [t for r in pack for t in r["input_ids"]],
            "loss_mask": [m for r in pack for m in r["loss_mask"]],
        }
        for pack in packs
    ]
    out = collate(joined, pad_id)
    layouts = [packed_layout(n, width) for n in lengths]
    out["document"] = torch.stack([d for d, _ in layouts])
    out["position_ids"] = torch.stack([p for _, p in layouts])
    return out


def row_lengths(rows: Sequence[dict]) -> list[int]:
    """Token count of every row; a `datasets.Dataset` is measured in Arrow, without Python lists."""
    if hasattr(rows, "with_format") and hasattr(rows, "column_names"):
        import pyarrow.compute as pc

        return pc.list_value_length(rows.with_format("arrow")["input_ids"]).to_pylist()
    return [len(r["input_ids"]) for r in rows]
