"""The built-in default data: the target writes its own prompts (Magpie) and answers them.

Built on first use (resumable, like any distillation) under
cache_root()/data/<target>-<key> and reused afterwards. The key covers the target (name, shape,
a sample of its weights), its tokenizer and chat template, the sizes, the seed and the pipeline
version, so a change to any of them builds a new set instead of reusing a stale one.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..target import cache_root
from ..tiny import BYTE_VOCAB, CHATML_TEMPLATE, SPECIAL_TOKENS
from ..config.distill import DistillConfig, MagpieConfig
from .regenerate import PIPELINE_VERSION, read_manifest, run_distillation, tokenizer_fingerprint

BUILTIN_VERSION = 1
# Conversations per shard: an interrupted first build loses at most one shard of work.
BUILTIN_SHARD_SIZE = 64


def is_tiny_random(target) -> bool:
    """The in-process tiny targets (byte tokenizer, random weights) used for smoke runs."""
    tok = target.tokenizer
    return len(tok) == BYTE_VOCAB + len(SPECIAL_TOKENS) and tok.chat_template == CHATML_TEMPLATE


def builtin_distill_config(data_cfg, output: Path, random_weights: bool = False) -> DistillConfig:
    """The distillation that makes the built-in set (decontamination happens in build_datasets,
    against data.decontaminate, so the cached set does not depend on the eval files).

    A random-weight target writes random bytes, which the prompt quality filter would reject
    entirely; for those smoke-run targets only deduplication is kept.
    """
    magpie = MagpieConfig()
    if random_weights:
        magpie = MagpieConfig(min_words=0, min_printable=0.0, cut="keep")
    return DistillConfig(
        magpie=magpie,
        prompts="magpie",
        num_prompts=int(data_cfg.builtin_examples),
        max_new_tokens=int(data_cfg.builtin_answer_tokens),
        temperature=0.0,
        turns=int(getattr(data_cfg, "builtin_turns", 1)),
        batch_size=int(data_cfg.builtin_batch_size),
        shard_size=BUILTIN_SHARD_SIZE,
        output=str(output),
        decontaminate=[],
    )


def builtin_key(target, data_cfg) -> str:
    weights = target.embed_tokens.weight
    sample = weights[: min(64, weights.shape[0])].detach().float().cpu().numpy().tobytes()
    parts = {
        "target": target.info.to_dict(),
        "weights": hashlib.sha256(sample).hexdigest()[:16],
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "examples": int(data_cfg.builtin_examples),
        "answer_tokens": int(data_cfg.builtin_answer_tokens),
        "turns": int(getattr(data_cfg, "builtin_turns", 1)),
        "random_weights": is_tiny_random(target),
        "seed": int(getattr(data_cfg, "builtin_seed", 0)),
        "shard_size": BUILTIN_SHARD_SIZE,
        "builtin_version": BUILTIN_VERSION,
        "pipeline_version": PIPELINE_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def builtin_dir(target, data_cfg) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", target.info.name) or "target"
    return cache_root() / "data" / f"{name}-{builtin_key(target, data_cfg)}"


def ensure_builtin_data(target, data_cfg) -> Path:
    """The directory of the built-in conversations for this target, built if missing."""
    directory = builtin_dir(target, data_cfg)
    if (directory / "manifest.json").is_file() and read_manifest(directory).get("complete"):
        return directory
    print(f"building the built-in data set for {target.info.name} "
          f"({data_cfg.builtin_examples} conversations, cached in {directory})")
    cfg = builtin_distill_config(data_cfg, directory, random_weights=is_tiny_random(target))
    return run_distillation(target, cfg, seed=int(getattr(data_cfg, "builtin_seed", 0)))
