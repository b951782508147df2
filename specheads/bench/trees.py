"""Calibrated trees kept per machine, and what a calibration was measured on.

A tree calibrated by tree=auto fits the machine it was timed on, so it belongs to that machine, not
to the head: it goes to the cache (cache_root()/trees/<head digest>-<machine key>.json) and
tree=default on that machine drafts with it from then on, while the head directory keeps the tree
it was shipped with. Only tree.save=head writes it into the head directory itself.

Each calibration records the identity of its prompts (a digest per prompt), so that a benchmark
can say when it measures a head on the very prompts its tree was chosen on, and when it was made
(calibrated_at, UTC): a cached tree older than the head's own calibration is not used, and
tree.save=head removes this machine's cached tree for the head, which would otherwise keep
winning over the one just stored (the cache key ignores config.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import torch

from ..atomic import write_json
from ..config.infer import SEARCH_DEFAULTS
from ..decode.policy import stored_dynamic
from ..heads.io import CONFIG_NAME, draft_precision
from ..kernels.linear_layout import cpu_isa, cpu_model
from ..target import cache_root, target_identity
from .record import short, weights_sha256

CACHE_VERSION = 1


def prompt_digest(text: str) -> str:
    """A prompt's identity: sha256 of its words (whitespace-insensitive), 16 hex digits."""
    return hashlib.sha256(" ".join(str(text).split()).encode()).hexdigest()[:16]


def head_digest(head_dir: str | Path) -> str:
    """sha256 of the head's weights and files, config.json left out (a stored tree does not make
    another head)."""
    root = Path(head_dir)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != CONFIG_NAME):
        h.update(f"{f.relative_to(root).as_posix()}\0".encode())
        with open(f, "rb") as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def machine_description(device: torch.device, kernels: bool) -> dict[str, Any]:
    """What a calibration's timings depend on, without naming the host: the processor, the
    device, the threads, torch, and whether the measured CPU kernels were installed."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "cpu": platform.processor() or cpu_model() or platform.machine(),
        "device": device.type + (f" ({gpu})" if gpu else ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
        "kernels": "measured" if kernels else "stock",
    }


def machine_record(device: torch.device, kernels: bool) -> dict[str, Any]:
    """machine_description and what tells two machines of one model name apart in a benchmark's
    summary (its instruction sets, its cores); not part of machine_key, which names the host."""
    return {**machine_description(device, kernels), "isa": cpu_isa(), "cores": os.cpu_count()}


def machine_key(target, kernels: bool, **extra: Any) -> str:
    """16 hex digits naming this host, its machine (machine_description), the target's weights and
    dtype, and `extra`: what a calibration kept in the cache was timed on."""
    parts = {
        "version": CACHE_VERSION,
        "host": platform.node(),
        "machine": machine_description(target.device, kernels),
        "target": target_identity(target)["weights_sha256"],
        "dtype": str(target.dtype),
        **extra,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(head_dir: str | Path, target, kernels: bool, precision: str) -> Path:
    """The cache file of this head's tree on this machine (and target: its weights and dtype; and
    the precision the head drafts in, heads.io.draft_precision, which sets what a draft step costs)."""
    machine = machine_key(target, kernels, head_dtype=precision)
    return cache_root() / "trees" / f"{head_digest(head_dir)[:16]}-{machine}.json"


def utc_now() -> str:
    """A calibration's calibrated_at: now, in UTC, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def calibrated_at(calibration: dict | None) -> datetime | None:
    """When a calibration was made, or None (a record from before calibrated_at, or unreadable)."""
    stamp = (calibration or {}).get("calibrated_at")
    try:
        when = datetime.fromisoformat(str(stamp)) if stamp else None
    except ValueError:
        return None
    return when.replace(tzinfo=timezone.utc) if when is not None and when.tzinfo is None else when


def older_than(calibration: dict | None, other: dict | None) -> bool:
    """Whether `calibration` was made before `other`; a record without calibrated_at counts as older
    than one with it (two without it: neither is older)."""
    mine, theirs = calibrated_at(calibration), calibrated_at(other)
    if theirs is None:
        return False
    return mine is None or mine < theirs


def store_in_cache(path: Path, paths: list[list[int]], calibration: dict) -> Path:
    write_json(path, {"version": CACHE_VERSION, "default_tree": paths, "calibration": calibration})
    return path


def read_cache(path: Path) -> dict | None:
    """The cached calibration, or None (missing, unreadable or from another version: calibrate anew)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    ok = isinstance(stored, dict) and stored.get("version") == CACHE_VERSION and stored.get("default_tree")
    return stored if ok else None


def remove_cached_tree(path: Path) -> bool:
    """Drop a cached tree (tree.save=head stored a newer one in the head directory): True when one was there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def calibrated_weights(calibration: dict | None) -> str | None:
    """The weights digest a calibration was made for: its weights_sha256, else, for one carried
    over from earlier weights, those; None when it names none (a record from before either)."""
    calibration = calibration or {}
    carried = calibration.get("carried_over") or {}
    return calibration.get("weights_sha256") or carried.get("from_weights_sha256")


def other_weights_line(calibration: dict | None, head_dir: str | Path) -> str | None:
    """One line when the tree calibration a head drafts with was made for other weights than the
    ones in its directory (its choices were measured on another head); None when they agree or
    the record names no weights."""
    made, here = calibrated_weights(calibration), weights_sha256(head_dir)
    if made is None or here is None or (made == here and "carried_over" not in (calibration or {})):
        return None
    return (
        f"warning: {head_dir}'s tree calibration was made for other weights ({short(made)}, these are "
        f"{short(here)}): its tree and figures were measured on them; tree=auto calibrates it for these\n"
    )


def use_cached_tree(head, head_dir: str | Path, target, kernels: bool, out: TextIO = sys.stderr) -> bool:
    """tree=default: a tree calibrated for this head on this machine replaces the stored one (one
    line says so), unless it is older than the head's own calibration (config.json's, e.g. one
    stored by tree.save=head since). False when none is used (the head's own tree stays). Either
    way, one line when the calibration drafted with was made for other weights (other_weights_line)."""
    used = cached_tree(head, head_dir, target, kernels, out)
    line = other_weights_line(getattr(head, "calibration", None), head_dir)
    if line:
        out.write(line)
    return used


def cached_tree(head, head_dir: str | Path, target, kernels: bool, out: TextIO) -> bool:
    """use_cached_tree's choice between this machine's cached tree and the head's own."""
    path = cache_path(head_dir, target, kernels, draft_precision(head))
    stored = read_cache(path)
    if stored is None:
        return False
    own = getattr(head, "calibration", None)
    if older_than(stored.get("calibration"), own):
        out.write(
            f"tree: {head_dir}'s own calibration is newer than the tree calibrated on this machine ({path}): "
            "it drafts with its own\n"
        )
        return False
    head.default_tree = stored["default_tree"]
    head.calibration = stored.get("calibration")
    dynamic = stored_dynamic(head.calibration)
    tree = f"a dynamic tree of {dynamic['total_tokens']} nodes" if dynamic else f"{len(head.default_tree)} nodes"
    out.write(
        f"tree: {head_dir} drafts with the tree calibrated on this machine "
        f"({tree}, {path}; tree=auto calibrates again)\n"
    )
    return True


def existing_calibration(head, head_dir: str | Path | None, target, kernels: bool) -> tuple[str, list, dict] | None:
    """The calibration a new tree=auto is weighed against and whose search it repeats, as
    tree=default would find it: this machine's cached one for the head unless it is older than the
    head's own, else the head's own (config.json's calibration with its default_tree). (where it
    is, its default_tree, its record), or None."""
    own = getattr(head, "calibration", None)
    if head_dir is not None and (Path(head_dir) / CONFIG_NAME).is_file():
        path = cache_path(head_dir, target, kernels, draft_precision(head))
        stored = read_cache(path)
        if stored is not None and stored.get("calibration") and not older_than(stored["calibration"], own):
            return f"this machine's cached calibration ({path})", stored["default_tree"], stored["calibration"]
    if own and getattr(head, "default_tree", None):
        return f"the calibration in {Path(head_dir) / CONFIG_NAME if head_dir else 'the head'}", head.default_tree, own
    return None


def search_space(calibration: dict | None) -> dict[str, Any]:
    """What a calibration searched, as the tree.* keys of config.infer.SEARCH_DEFAULTS: its
    `search` record, else (a record from before it) what every record says: its depth, top_k,
    max_nodes, tokens and prompt count, and dynamic trees weighed when it has a `dynamic` record
    (a `policy` without one: off)."""
    if not calibration:
        return {}
    search = calibration.get("search")
    if isinstance(search, dict):
        return {k: v for k, v in search.items() if k in SEARCH_DEFAULTS and v is not None}
    derived = {
        "depth": calibration.get("depth"),
        "top_k": calibration.get("top_k"),
        "max_nodes": calibration.get("max_nodes"),
        "calibration_tokens": calibration.get("tokens"),
        "calibration_prompts": (calibration.get("prompts") or {}).get("count"),
        "dynamic": "weigh" if "dynamic" in calibration else "off" if "policy" in calibration else None,
    }
    return {k: v for k, v in derived.items() if v is not None}


def prompts_record(source: str, texts: Sequence[str]) -> dict[str, Any]:
    """The identity of a calibration's prompts: where they came from and a digest of each."""
    return {"source": source, "count": len(texts), "sha256": [prompt_digest(t) for t in texts]}


def overlap(calibration: dict | None, questions: Iterable[dict], turns: str = "first") -> list:
    """question_ids of the questions (the turns measured) that the calibration's prompts include."""
    digests = set(((calibration or {}).get("prompts") or {}).get("sha256") or [])
    if not digests:
        return []
    hits = []
    for q in questions:
        texts = q["turns"] if turns == "all" else q["turns"][:1]
        if any(prompt_digest(t) in digests for t in texts):
            hits.append(q["question_id"])
    return hits


def warn_overlap(method: str, calibration: dict | None, questions: Sequence[dict], turns: str, out: TextIO) -> list:
    """One line when a head's tree was calibrated on questions this benchmark measures."""
    hits = overlap(calibration, questions, turns)
    if hits:
        source = ((calibration or {}).get("prompts") or {}).get("source", "?")
        shown = ", ".join(str(h) for h in hits[:8]) + (", ..." if len(hits) > 8 else "")
        out.write(
            f"warning: {method}'s tree was calibrated on {len(hits)} of the {len(questions)} questions measured "
            f"here (question_id {shown}, from {source}): its tree was chosen on them; calibrate on other "
            "prompts (tree.calibration_questions=...) for an unbiased measurement\n"
        )
    return hits
