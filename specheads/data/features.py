"""Offline hidden-state features: one pass of the frozen target, cached as safetensors shards.

Layout of a cache directory:
    index.json            key (what the features depend on), shards, dtype, layer ids + convention
    shard-00000.safetensors
        input_ids [N] int64, loss_mask [N] int8, offsets [R+1] int64 (row r = N-range offsets[r]:offsets[r+1])
        layer_<k> [N, H] and/or final [N, H] in the cache dtype
A cache whose key differs from what a run needs (another target, layers, tokenizer, template or
max_length) is refused with a message naming the differing fields. Until its last shard is written
a cache lives in `.<name>.partial/` beside it (plan.json + the finished shards), where an
interrupted pass resumes.

Who computes the states is a FeatureSource: the loaded target's transformers forward
(TargetForward, the default), or a serving engine (specheads.distill.vllm_features: vLLM's
extract_hidden_states). The cache is the same either way; its index records the writer
(`writer`: backend and versions), and a head trained from it records that in its provenance.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..atomic import atomic_path, write_json
from ..distributed import all_gather_objects, broadcast_object, process_rank
from ..errors import SpecHeadsError
from ..target import FLOAT_DTYPES, LAYER_CONVENTION, FrozenTarget, check_layer_ids
from .datasets import row_lengths
from .packing import packed_layout

INDEX_NAME = "index.json"
PLAN_NAME = "plan.json"  # in an unfinished cache only: what its shards belong to
CACHE_VERSION = 1
DTYPES = FLOAT_DTYPES


class FeatureSource(Protocol):
    """What computes the cached states of rows."""

    backend: str  # "transformers" | "vllm": recorded in the index (writer.backend)

    def record(self) -> dict:
        """The index's `writer` entry: the backend and what a reader of the head wants to know of it
        (versions, dtype), and under "checks" what was measured of it (an engine's identity checks),
        which a resumed pass need not reproduce."""

    def states(self, rows: Sequence[torch.Tensor], layer_ids: list[int], final: bool) -> Iterator[dict]:
        """For each row of token ids (in order), {state name: [T, H]} (names as state_names gives)."""


class TargetForward:
    """The transformers path: one forward of the loaded target per row, no padding, so a cached row
    is bit-identical to a fresh forward of it."""

    backend = "transformers"

    def __init__(self, target: FrozenTarget):
        self.target = target

    def record(self) -> dict:
        import transformers

        return {
            "backend": self.backend,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "dtype": str(self.target.dtype).removeprefix("torch."),
            "device": self.target.device.type,
        }

    def states(self, rows, layer_ids, final):
        for ids in rows:
            s = self.target.states(ids.unsqueeze(0).to(self.target.device), layer_ids=layer_ids, final=final)
            out = {f"layer_{k}": s.hidden[k][0] for k in layer_ids}
            if final:
                out["final"] = s.final[0]
            yield out


def writer_backend(index: dict) -> str:
    """Who wrote a cache (its index's writer.backend); caches from before the index recorded it
    were all written by the transformers forward."""
    return (index.get("writer") or {}).get("backend", TargetForward.backend)


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


def partial_dir(out_dir) -> Path:
    """Where an unfinished cache keeps its finished shards until the last one is written."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.partial"


def rows_digest(rows) -> str:
    """What the rows hold (a `datasets.Dataset` by its fingerprint): a resumed cache continues only
    the pass over the same rows."""
    fingerprint = getattr(rows, "_fingerprint", None)
    if fingerprint is not None:
        return f"dataset:{fingerprint}"
    h = hashlib.sha256()
    for row in rows:
        h.update(b"|" + ",".join(map(str, row["input_ids"])).encode())
        h.update(b"/" + bytes(int(m) for m in row["loss_mask"]))
    return h.hexdigest()[:16]


def check_disk(directory: Path, need: int, tokens: int, bytes_per_token: int) -> None:
    """Refuse, before the target pass starts, a cache that the disk cannot hold."""
    free = shutil.disk_usage(directory).free
    if need > free:
        raise SpecHeadsError(
            f"the feature cache needs {need / 1e9:.1f} GB for {tokens:,} tokens ({bytes_per_token:,} bytes a token) "
            f"but {directory} has {free / 1e9:.1f} GB free: point data.features (or distill.features.output) at a "
            "larger disk, cache fewer layers or a bf16 dtype, or train online (data.features=null)"
        )


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
    source: FeatureSource | None = None,
) -> dict:
    """Run the target once over `rows` (dicts with input_ids, loss_mask) and cache its states.

    `source` computes them (default: TargetForward(target), which needs the target's weights here;
    another source needs of `target` only its info and tokenizer, for the cache's key); the index
    records it as `writer`.

    Rows run one at a time (no padding), so a cached row is bit-identical to a fresh forward of it.
    Shards are written one file at a time (each renamed into place whole) into a hidden
    `.<name>.partial` directory beside `out_dir`, which is renamed onto `out_dir` once the index is
    written. An interrupted pass (a crash, a lost machine, Ctrl-C) leaves whole shards only, and
    the same call resumes it: the shards already written are kept when the plan (what the
    tensors depend on, the rows and their split into shards) is the same, and the finished cache
    equals an uninterrupted one file for file. A plan that changed starts over.

    In a process group every rank must call this: rank r writes shards r, r + N, ... of the plan,
    and rank 0 writes the index (with `extra` fields) and renames the directory into place once
    every rank has finished; a rank that fails fails them all.
    """
    if dtype not in DTYPES:
        raise SpecHeadsError(f"feature dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if shard_tokens < 1:
        raise SpecHeadsError(f"feature shard_tokens must be >= 1, got {shard_tokens}")
    layer_ids = check_layer_ids(target.info, layer_ids)
    source = source if source is not None else TargetForward(target)
    writer = source.record()
    extra = {**(extra or {}), "writer": writer}
    # what a resumed pass must share with the interrupted one: the writer without its measured checks
    plan_extra = {**extra, "writer": {k: v for k, v in writer.items() if k != "checks"}}
    key = feature_cache_key(target, layer_ids, final, max_length)
    names = state_names(layer_ids, final)
    rank, world = process_rank()
    out_dir = Path(out_dir)
    lengths = [min(n, max_length) for n in row_lengths(rows)]
    plan = shard_plan(lengths, shard_tokens)
    element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    bytes_per_token = len(names) * target.info.hidden_size * element
    shards = [{"file": shard_name(j), "rows": len(r), "tokens": sum(lengths[i] for i in r)} for j, r in enumerate(plan)]
    work = partial_dir(out_dir)
    failure = None
    if rank == 0:
        try:
            _prepare_partial(work, key, dtype, names, plan, rows_digest(rows), plan_extra)
            todo = [e["tokens"] for e in shards if not (work / e["file"]).is_file()]
            # states plus 9 bytes of ids and mask a token
            check_disk(work, sum(todo) * (bytes_per_token + 9), sum(todo), bytes_per_token)
            if len(todo) < len(shards):
                print(
                    f"resuming the feature cache {out_dir}: {len(shards) - len(todo)} of {len(shards)} shards written"
                )
        except Exception as err:
            failure = err
    failed = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if failed is not None:
        raise SpecHeadsError(f"feature caching failed on rank 0: {failed}")
    mine = [j for j in range(rank, len(plan), world) if not (work / shards[j]["file"]).is_file()]
    try:
        _write_shards(source, rows, plan, mine, layer_ids, final, names, DTYPES[dtype], max_length, work)
    except Exception as err:  # reported to every rank below, so none waits forever or renames a partial cache
        failure = err
    # one exchange: every rank's failure (or None)
    reports = all_gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = [(r, m) for r, m in enumerate(reports) if m is not None]
    if failed:
        if failure is not None:
            raise failure
        raise SpecHeadsError(f"feature caching failed on rank {failed[0][0]}: {failed[0][1]}")
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
            (work / PLAN_NAME).unlink()
            write_json(work / INDEX_NAME, index)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(work, out_dir)
        except BaseException as err:
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


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def _prepare_partial(work: Path, key, dtype, names, plan, digest, extra) -> None:
    """Keep an unfinished pass's shards when it was the same pass; else start an empty one."""
    wanted = {
        "key": key,
        "dtype": dtype,
        "names": names,
        "plan": [[r.start, r.stop] for r in plan],
        "rows": digest,
        "extra": extra or {},
    }
    found = None
    if (work / PLAN_NAME).is_file():
        try:
            found = json.loads((work / PLAN_NAME).read_text())
        except json.JSONDecodeError:
            found = None
    if found != wanted:
        if work.exists():
            if found is not None:
                print(f"the unfinished feature cache {work} was for other rows or settings: starting over")
            shutil.rmtree(work)
        work.mkdir(parents=True)
        write_json(work / PLAN_NAME, wanted)
        return
    # a process killed while saving leaves its temporary file: never part of the cache
    for stray in work.iterdir():
        if stray.name != PLAN_NAME and not stray.name.startswith("shard-"):
            stray.unlink()


def _write_shards(source, rows, plan, mine, layer_ids, final, names, dtype, max_length, directory) -> None:
    """This rank's (remaining) shards of the plan, each written whole under its number in the plan."""
    bar = tqdm(total=sum(len(plan[j]) for j in mine), desc=f"caching features ({source.backend})", unit="row")
    for j in mine:
        buf = _ShardBuffer(names)
        ids = [torch.as_tensor(rows[r]["input_ids"], dtype=torch.long)[:max_length] for r in plan[j]]
        masks = [torch.as_tensor(rows[r]["loss_mask"], dtype=torch.long)[:max_length] for r in plan[j]]
        for row_ids, mask, states in zip(ids, masks, source.states(ids, layer_ids, final), strict=True):
            buf.add(row_ids, mask, {n: states[n].to(dtype).cpu() for n in names})
            bar.update(1)
        buf.flush(directory / shard_name(j))
    bar.close()


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

    def flush(self, path: Path) -> None:
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.long)
        offsets[1:] = torch.tensor(self.lengths).cumsum(0)
        tensors = {
            "input_ids": torch.cat(self.ids),
            "loss_mask": torch.cat(self.masks).to(torch.int8),
            "offsets": offsets,
        }
        tensors.update({n: torch.cat(self.states[n]).contiguous() for n in self.names})
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp))
        self.reset()


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


def collate_features_packed(packs: list[list[FeatureRow]], pad_id: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Packed rows of cached conversations (specheads.data.packing): each pack's rows and states
    joined end to end, then padded as collate_features pads, with document and position_ids as
    collate_packed gives them. The states were cached one conversation at a time, so they are what
    a packed target forward that keeps the conversations apart computes."""
    joined = [
        FeatureRow(
            torch.cat([r.input_ids for r in pack]),
            torch.cat([r.loss_mask for r in pack]),
            {k: torch.cat([r.states[k] for r in pack]) for k in pack[0].states},
        )
        for pack in packs
    ]
    batch, states = collate_features(joined, pad_id, dtype)
    width = batch["input_ids"].shape[1]
    layouts = [packed_layout([r.input_ids.numel() for r in pack], width) for pack in packs]
    batch["document"] = torch.stack([d for d, _ in layouts])
    batch["position_ids"] = torch.stack([p for _, p in layouts])
    return batch, states


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
    source: FeatureSource | None = None,
) -> None:
    """Cache every split under directory/<split>/ unless an up-to-date cache is already there (the
    same key, data and rows, written by the same backend: asking for another writer rewrites it).

    In a process group every rank calls this, and the ranks share each split's target pass."""
    expected = feature_cache_key(target, layer_ids, final, max_length)
    backend = source.backend if source is not None else TargetForward.backend
    for split, rows in splits.items():
        where = split_dir(directory, split)
        if (where / INDEX_NAME).is_file():
            index = json.loads((where / INDEX_NAME).read_text())
            if (
                index.get("key") == expected
                and index.get("data") == data_fingerprint
                and index.get("rows") == len(rows)
                and writer_backend(index) == backend
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
            source=source,
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
