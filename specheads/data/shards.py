"""Reading a distillation's output directory (written by specheads.distill.regenerate).

shards/shard-00000.jsonl   OpenAI "messages" rows
manifest.json              the run's fingerprint and the completed shards
metadata.json              provenance
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecHeadsError

MANIFEST = "manifest.json"
METADATA = "metadata.json"
SHARDS = "shards"


def is_distill_output(directory: Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def read_manifest(directory: Path) -> dict:
    try:
        return json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecHeadsError(f"{directory}/{MANIFEST} is unreadable ({err})") from None


def read_metadata(directory: Path) -> dict:
    """The distillation's provenance ({} where it has none readable: it only informs)."""
    try:
        metadata = json.loads((Path(directory) / METADATA).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return metadata if isinstance(metadata, dict) else {}


def completed_shard_files(directory: Path, partial: bool = False) -> list[Path]:
    """The shard files of a finished distillation, in order. With `partial`, those of an unfinished
    one that are complete (so a head can train while distill.py is still writing)."""
    manifest = read_manifest(directory)
    done = sorted(int(k) for k in manifest.get("shards", {}))
    if not manifest.get("complete"):
        progress = f"{len(done)} of {manifest.get('num_shards')} shards"
        if not partial:
            raise SpecHeadsError(
                f"{directory} is an unfinished distillation ({progress}); run the same distill.py command "
                "to finish it, or set data.partial_distill=true to use the completed shards"
            )
        print(f"data: {directory} is an unfinished distillation; using its {progress}")
    return [Path(directory) / manifest["shards"][str(k)]["file"] for k in done]
