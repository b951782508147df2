"""Offline hidden-state features: one pass of the frozen target, cached as safetensors shards.

Layout of a cache directory:
    index.json            key (what the features depend on), shards, dtype, layer ids + convention
    shard-00000.safetensors
        input_ids [N] int64, loss_mask [N] int8, offsets [R+1] int64 (row r = N-range offsets[r]:offsets[r+1])
        layer_<k> [N, H] and/or final [N, H] in the cache dtype
A cache whose key differs from what a run needs (another target, layers, tokenizer, template or
max_length) is refused with a message naming the differing fields.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..distributed import all_gather_objects, broadcast_object, process_rank
from ..errors import SpecHeadsError
from ..target import FLOAT_DTYPES, LAYER_CONVENTION, FrozenTarget
from .datasets import row_lengths

INDEX_NAME = "index.json"
CACHE_VERSION = 1
DTYPES = FLOAT_DTYPES


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def feature_cache_key(target: FrozenTarget, layer_ids: Iterable[int], final: bool, max_length: int) -> dict[str, Any]:
    """Everything the cached tensors depend on, besides the rows themselves."""
    tok = target.tokenizer
    vocab = json.dumps(sorted(tok.get_vocab().items())) if tok is not None else ""
    return {
        "version": CACHE_VERSION,
        "target": target.info.name,
        "revision": target.info.revision,
        "target_shape": [target.info.hidden_size, target.info.num_layers, target.info.vocab_size],
        "layer_ids": sorted({int(k) for k in layer_ids}),
        "layer_convention": LAYER_CONVENTION,
        "final_post_norm": bool(final),
        "tokenizer": _digest(vocab),
        "chat_template": _digest((getattr(tok, "chat_template", None) or "") if tok is not None else ""),
        "max_length": int(max_length),
    }


def state_names(layer_ids: Iterable[int], final: bool) -> list[str]:
    names = [f"layer_{int(k)}" for k in sorted({int(k) for k in layer_ids})]
    return names + (["final"] if final else [])


def shard_plan(lengths: Iterable[int], shard_tokens: int) -> list[range]:
    """The rows of each shard: a shard closes once it holds `shard_tokens` tokens.

    The plan depends on the row lengths only, so a cache written by N ranks (each writing whole
    shards of the plan) is the same, file for file, as the cache of one.
    """
    plan, start, tokens, n = [], 0, 0, 0
    for n, length in enumerate(lengths, 1):
        tokens += length
        if tokens >= shard_tokens:
            plan.append(range(start, n))
            start, tokens = n, 0
    if start < n:
        plan.append(range(start, n))
    return plan


def write_features(
    target: FrozenTarget,
    rows,
    layer_ids: Iterable[int],
    final: bool,
    out_dir,
    max_length: int,
    dtype: str = "bfloat16",
    shard_tokens: int = 262144,
    extra: dict | None = None,
) -> dict:
    """Run the target once over `rows` (dicts with input_ids, loss_mask) and cache its states.

    Rows run one at a time (no padding), so a cached row is bit-identical to a fresh forward of it.
    In a process group every rank must call this: rank r writes shards r, r + N, ... of the plan
    into one temp directory, and rank 0 writes the index (with `extra` fields) and renames the
    directory into place once every rank has finished; a rank that fails fails them all and
    leaves nothing behind.
    """
    if dtype not in DTYPES:
        raise SpecHeadsError(f"feature dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if shard_tokens < 1:
        raise SpecHeadsError(f"feature shard_tokens must be >= 1, got {shard_tokens}")
    layer_ids = target.check_layer_ids(layer_ids)
    key = feature_cache_key(target, layer_ids, final, max_length)
    names = state_names(layer_ids, final)
    rank, world = process_rank()
    out_dir = Path(out_dir)
    plan = shard_plan((min(n, max_length) for n in row_lengths(rows)), shard_tokens)
    mine = list(range(rank, len(plan), world))
    tmp = None
    if rank == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-")
    tmp = Path(broadcast_object(tmp))
    written, failure = [], None
    try:
        written = _write_shards(target, rows, plan, mine, layer_ids, final, names, DTYPES[dtype], max_length, tmp)
    except Exception as err:  # reported to every rank below, so none waits forever or renames a partial cache
        failure = err
    # one exchange: every rank's failure (or None) and the shards it wrote
    reports = all_gather_objects((None if failure is None else f"{type(failure).__name__}: {failure}", written))
    failed = [(r, m) for r, (m, _) in enumerate(reports) if m is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise SpecHeadsError(f"feature caching failed on rank {failed[0][0]}: {failed[0][1]}")
    shards = sorted((e for _, entries in reports for e in entries), key=lambda e: e["file"])
    bytes_per_token = len(names) * target.info.hidden_size * torch.tensor([], dtype=DTYPES[dtype]).element_size()
    index = {
        "key": key,
        "dtype": dtype,
        "names": names,
        "rows": sum(e["rows"] for e in shards),
        "tokens": sum(e["tokens"] for e in shards),
        "bytes_per_token": bytes_per_token,
        "shards": shards,
        **(extra or {}),
    }
    if rank == 0:
        try:
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            all_gather_objects(f"{type(err).__name__}: {err}")  # the other ranks wait for this
            raise
        print(
            f"cached {index['rows']} rows / {index['tokens']} tokens of {', '.join(names)} ({dtype}) "
            f"in {len(shards)} shard(s) from {world} rank(s): {bytes_per_token} bytes per token, "
            f"{bytes_per_token * index['tokens'] / 2**20:.1f} MiB"
        )
    # no rank reads the cache before rank 0 has renamed it into place (or failed to)
    failure = all_gather_objects(None)[0]
    if failure is not None:
        raise SpecHeadsError(f"feature caching failed on rank 0: {failure}")
    return index


def _write_shards(target, rows, plan, mine, layer_ids, final, names, dtype, max_length, directory) -> list[dict]:
    """This rank's shards of the plan, each written under its number in the plan."""
    entries = []
    bar = tqdm(total=sum(len(plan[j]) for j in mine), desc="caching features", unit="row")
    for j in mine:
        buf = _ShardBuffer(names)
        for r in plan[j]:
            row = rows[r]
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long)[:max_length]
            mask = torch.as_tensor(row["loss_mask"], dtype=torch.long)[:max_length]
            s = target.states(ids.unsqueeze(0).to(target.device), layer_ids=layer_ids, final=final)
            states = {f"layer_{k}": s.hidden[k][0] for k in layer_ids}
            if final:
                states["final"] = s.final[0]
            buf.add(ids, mask, {n: states[n].to(dtype).cpu() for n in names})
            bar.update(1)
        entries.append(buf.flush(directory, j))
    bar.close()
    return entries


class _ShardBuffer:
    def __init__(self, names: list[str]):
        self.names = names
        self.reset()

    def reset(self):
        self.ids, self.masks, self.states, self.lengths = [], [], {n: [] for n in self.names}, []
        self.tokens = 0

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def add(self, ids, mask, states):
        self.ids.append(ids)
        self.masks.append(mask)
        for n in self.names:
            self.states[n].append(states[n])
        self.lengths.append(ids.numel())
        self.tokens += ids.numel()

    def flush(self, directory: Path, number: int) -> dict:
        name = f"shard-{number:05d}.safetensors"
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.long)
        offsets[1:] = torch.tensor(self.lengths).cumsum(0)
        tensors = {
            "input_ids": torch.cat(self.ids),
            "loss_mask": torch.cat(self.masks).to(torch.int8),
            "offsets": offsets,
        }
        tensors.update({n: torch.cat(self.states[n]).contiguous() for n in self.names})
        save_file(tensors, str(directory / name))
        entry = {"file": name, "rows": self.rows, "tokens": self.tokens}
        self.reset()
        return entry


@dataclass
class FeatureRow:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    states: dict[Any, torch.Tensor]  # layer id -> [T, H], "final" -> [T, H]


class FeatureCache:
    """Random access to cached rows; refuses a cache made for something else."""

    def __init__(self, directory, expected_key: dict | None = None):
        self.directory = Path(directory)
        path = self.directory / INDEX_NAME
        if not path.is_file():
            raise SpecHeadsError(f"{self.directory} is not a feature cache (no {INDEX_NAME})")
        try:
            self.index = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise SpecHeadsError(f"{path} is not valid JSON: {err}") from None
        if expected_key is not None:
            check_key(self.index.get("key", {}), expected_key, self.directory)
        self.names = self.index["names"]
        self._starts = []
        total = 0
        for shard in self.index["shards"]:
            self._starts.append(total)
            total += shard["rows"]
        self._rows = total
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._rows

    def _shard(self, i: int):
        if i not in self._open:
            f = self.directory / self.index["shards"][i]["file"]
            if not f.is_file():
                raise SpecHeadsError(f"feature shard {f} is missing")
            self._open[i] = safe_open(str(f), framework="pt")
        return self._open[i]

    def __getitem__(self, r: int) -> FeatureRow:
        if not 0 <= r < self._rows:
            raise IndexError(r)
        s = bisect_right(self._starts, r) - 1
        shard = self._shard(s)
        local = r - self._starts[s]
        offsets = shard.get_slice("offsets")[local : local + 2]
        a, b = int(offsets[0]), int(offsets[1])
        states = {}
        for n in self.names:
            key = "final" if n == "final" else int(n.split("_", 1)[1])
            states[key] = shard.get_slice(n)[a:b]
        return FeatureRow(shard.get_slice("input_ids")[a:b], shard.get_slice("loss_mask")[a:b].long(), states)


def check_key(found: dict, expected: dict, where) -> None:
    diffs = [f"{k}: cached {found.get(k)!r}, needed {v!r}" for k, v in expected.items() if found.get(k) != v]
    if diffs:
        raise SpecHeadsError(
            f"stale feature cache {where} ({'; '.join(diffs)}): "
            "rebuild it with distill.py or point data.features elsewhere"
        )


def collate_features(rows: list[FeatureRow], pad_id: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Right-pad cached rows into (batch, states) exactly like the online path produces them."""
    t = max(r.input_ids.numel() for r in rows)
    b = len(rows)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    states = {k: torch.zeros(b, t, v.shape[-1], dtype=dtype) for k, v in rows[0].states.items()}
    for i, r in enumerate(rows):
        n = r.input_ids.numel()
        ids[i, :n], attn[i, :n], mask[i, :n] = r.input_ids, 1, r.loss_mask
        for k, v in r.states.items():
            states[k][i, :n] = v.to(dtype)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}, states


def split_dir(directory, split: str) -> Path:
    return Path(directory) / split


def ensure_split_features(
    target: FrozenTarget,
    splits: dict,
    layer_ids,
    final: bool,
    directory,
    max_length: int,
    dtype: str = "bfloat16",
    data_fingerprint: str | None = None,
    shard_tokens: int = 262144,
) -> None:
    """Cache every split under directory/<split>/ unless an up-to-date cache is already there.

    In a process group every rank calls this, and the ranks share each split's target pass."""
    expected = feature_cache_key(target, layer_ids, final, max_length)
    for split, rows in splits.items():
        where = split_dir(directory, split)
        if (where / INDEX_NAME).is_file():
            index = json.loads((where / INDEX_NAME).read_text())
            if (
                index.get("key") == expected
                and index.get("data") == data_fingerprint
                and index.get("rows") == len(rows)
            ):
                continue
        write_features(
            target,
            rows,
            layer_ids,
            final,
            where,
            max_length,
            dtype=dtype,
            shard_tokens=shard_tokens,
            extra={"data": data_fingerprint},
        )


def auto_features_dir(target: FrozenTarget, splits: dict, layer_ids, final: bool, max_length: int, dtype: str) -> Path:
    """Where data.features=auto keeps a cache: named by the key and a digest of every row."""
    h = hashlib.sha256(
        json.dumps([feature_cache_key(target, layer_ids, final, max_length), dtype], sort_keys=True).encode()
    )
    for split in sorted(splits):
        h.update(split.encode())
        for row in splits[split]:
            h.update(b"|" + ",".join(map(str, row["input_ids"])).encode())
            h.update(b"/" + bytes(int(m) for m in row["loss_mask"]))
    from ..target import cache_root

    return cache_root() / "features" / f"{target.info.name}-{h.hexdigest()[:16]}"
