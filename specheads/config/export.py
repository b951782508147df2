"""The export job's structured config (conf/export.yaml is validated against it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from .train import ModelConfig


@dataclass
class BenchInput:
    # OUT.summary.json written by `infer.py bench.output=OUT.jsonl`: its table goes into the model card.
    summary: Optional[str] = None


@dataclass
class ExportJobConfig:
    # A head directory or Hub id. On the command line `head=` is accepted too (see __main__).
    head_path: str = MISSING
    # eagle3 | speculators | eagle | vllm-medusa | medusa
    format: str = MISSING
    # Output directory (replaced atomically). May be left out with push_to_hub=true.
    out: Optional[str] = None
    # The target, when a format stores copies of its embedding / LM head. None: the conf/model
    # option named like the head's target.
    model: Optional[ModelConfig] = None
    # auto: every engine the format serves that can load this head. Or one engine (vllm, sglang,
    # speculators, trtllm, tgi); for eagle3 it also picks the aux-layer-id numbering.
    engine: str = "auto"
    # auto keeps the head's own dtype; bfloat16 / float16 halve the files.
    dtype: str = "auto"
    # Copy the target's embedding into the draft (null: as the format's reference checkpoints do).
    embeddings: Optional[bool] = None
    # Hub id of the target written where engines load it (verifier, base_model_name_or_path).
    base_model: Optional[str] = None
    # Default number of drafted tokens (speculators proposal, serve commands). null: from the tree.
    num_speculative_tokens: Optional[int] = None
    push_to_hub: bool = False
    repo_id: Optional[str] = None
    private: bool = False
    commit_message: Optional[str] = None
    bench: BenchInput = field(default_factory=BenchInput)
    device: str = "cpu"


def register_export_configs() -> None:
    """specheads.config.train.register_configs stores export_schema too (conf/ tests compose every primary)."""
    from .train import register_configs

    register_configs()
    ConfigStore.instance().store(name="export_schema", node=ExportJobConfig)
