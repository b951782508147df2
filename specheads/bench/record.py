"""What a results record says it measured: the weights, the questions, the machine, the command.

Every benchmark, replay and engine run writes its figures with a `record` (results_record) naming
each head it ran by the sha256 of its weights file (model.safetensors), so a figure can always be
traced to the weights it measured: BENCHMARKS.md's current results and README's table are made
from the records in results/ (tools/results_tables.py), and a shipped head whose weights have no
record there, or a table that names other weights, fails a test.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..heads.io import WEIGHTS_NAME
from ..provenance import file_digest, portable_path, provenance

RECORD_VERSION = 1
SHOWN_DIGITS = 12  # the digits of a weights digest shown beside a figure


def weights_sha256(head_dir: str | os.PathLike) -> str | None:
    """sha256 of a head directory's weights file (config.json left out: a calibration stored there
    does not change the weights), or None when it has none (a Hub id not downloaded, a draft model)."""
    weights = Path(head_dir).expanduser() / WEIGHTS_NAME
    return file_digest(weights) if weights.is_file() else None


def short(digest: str | None) -> str:
    """The digits of a digest shown beside a figure ("-" when there is none)."""
    return digest[:SHOWN_DIGITS] if digest else "-"


def head_entry(head_dir: str | os.PathLike) -> dict[str, str | None]:
    return {"dir": portable_path(head_dir), "weights_sha256": weights_sha256(head_dir)}


def questions_entry(path: str | os.PathLike | None, count: int | None = None) -> dict[str, Any] | None:
    """The question file by its portable name and digest (and how many of its questions ran)."""
    if path is None:
        return None
    local = Path(str(path)).expanduser()
    return {
        "path": portable_path(path),
        "sha256": file_digest(local) if local.exists() else None,
        "count": count,
    }


def results_record(
    kind: str,
    heads: Mapping[str, str | os.PathLike | None],
    questions: str | os.PathLike | None = None,
    count: int | None = None,
    machine: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The record a run writes beside its figures: `kind` (bench, replay, vllm, llamacpp, ...), each
    head it ran under its label (head_entry), the questions, the machine, the date (UTC) and the
    command and commit that made it."""
    return {
        "version": RECORD_VERSION,
        "kind": kind,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "heads": {label: head_entry(d) for label, d in heads.items() if d is not None},
        "questions": questions_entry(questions, count),
        "machine": dict(machine) if machine else None,
        **provenance(),
    }
