"""The schema of `python -m specheads.export` (conf/export.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from .model import ModelConfig


@dataclass
class BenchInput:
    """Benchmark results to put in the model card."""

    # OUT.summary.json written by `infer.py bench.output=OUT.jsonl`: its table goes into the model card.
    summary: str | None = None


@dataclass
class ExportJobConfig:
    """`python -m specheads.export`: a trained head in a serving engine's format, optionally on the Hub."""

    # A head directory or Hub id. On the command line `head=` is accepted too (see __main__).
    head_path: str = MISSING
    # eagle3 | speculators | dflash | eagle | vllm-medusa | medusa | gguf
    format: str = MISSING
    # Output directory (replaced atomically); format=gguf: the output file. May be left out with
    # push_to_hub=true (not with gguf).
    out: str | None = None
    # The target, when a format stores copies of its embedding / LM head (gguf: its vocabulary).
    # None: the conf/model option named like the head's target.
    model: ModelConfig | None = None
    # auto: every engine the format serves that can load this head. Or one engine (vllm, sglang,
    # speculators, trtllm, tgi, llama.cpp); for eagle3 it also picks the aux-layer-id numbering.
    engine: str = "auto"
    # auto keeps the head's own dtype; bfloat16 / float16 halve the files.
    dtype: str = "auto"
    # Copy the target's embedding into the draft (null: as the format's reference checkpoints do).
    embeddings: bool | None = None
    # Hub id of the target written where engines load it (verifier, base_model_name_or_path).
    base_model: str | None = None
    # Default number of drafted tokens (speculators proposal, serve commands). null: from the tree
    # (DFlash: block_size - 1, the block it was trained on; its speculators format refuses more).
    # gguf: the chain llama.cpp drafts, required for a head whose default tree branches; a DFlash,
    # DSpark or DFlash2 head's is its trained block's (llama.cpp's block is as long as its draft).
    num_speculative_tokens: int | None = None
    push_to_hub: bool = False  # upload the export (with a model card) to the Hugging Face Hub
    repo_id: str | None = None  # the Hub repository to push to (org/name)
    private: bool = False  # create the Hub repository as private
    commit_message: str | None = None  # the Hub commit's message; null = a default one
    bench: BenchInput = field(default_factory=BenchInput)
    device: str = "cpu"  # where the head is loaded to be converted and checked
