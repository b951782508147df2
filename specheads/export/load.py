"""Open a head from wherever it lives: a head directory, a Hub id, or an engine-format export."""

from __future__ import annotations

import os

from ..heads import DraftHead, load_head
from ..target import FrozenTarget
from .exporter import is_exported_dir, load_exported
from .hub import resolve_head_path


def open_head(
    path_or_hub_id: str | os.PathLike, target: FrozenTarget, allow_target_mismatch: bool = False
) -> DraftHead:
    """A Hub id is fetched (or found in the local HF cache); a directory exported for a serving
    engine (vLLM, SGLang, speculators, Medusa layouts) is read back into our head. Our own head
    directory is checked against the target's identity (load_head)."""
    directory = resolve_head_path(path_or_hub_id)
    if is_exported_dir(directory):
        return load_exported(directory, target)
    return load_head(directory, target, allow_target_mismatch=allow_target_mismatch)
