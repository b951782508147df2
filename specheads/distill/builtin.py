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

from ..config.distill import DistillConfig, MagpieConfig
from ..config.train import DataConfig
from ..data.shards import is_distill_output, read_manifest
from ..target import cache_root
from ..tiny import BYTE_VOCAB, SPECIAL_TOKENS, TEMPLATES
from .regenerate import PIPELINE_VERSION, run_distillation, tokenizer_fingerprint

BUILTIN_VERSION = 1
# Conversations per shard: an interrupted first build loses at most one shard of work.
BUILTIN_SHARD_SIZE = 64


def is_tiny_random(target) -> bool:
    """The in-process tiny targets (byte tokenizer, random weights) used for smoke runs."""
    tok = target.tokenizer
    return len(tok) == BYTE_VOCAB + len(SPECIAL_TOKENS) and tok.chat_template in TEMPLATES.values()


def builtin_distill_config(data_cfg: DataConfig, output: Path, random_weights: bool = False) -> DistillConfig:
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
        num_prompts=data_cfg.builtin_examples,
        max_new_tokens=data_cfg.builtin_answer_tokens,
        temperature=0.0,
        turns=data_cfg.builtin_turns,
        batch_size=data_cfg.builtin_batch_size,
        shard_size=BUILTIN_SHARD_SIZE,
        output=str(output),
        decontaminate=[],
    )


def builtin_key(target, data_cfg: DataConfig) -> str:
    weights = target.embed_tokens.weight
    sample = weights[: min(64, weights.shape[0])].detach().float().cpu().numpy().tobytes()
    parts = {
        "target": target.info.to_dict(),
        "weights": hashlib.sha256(sample).hexdigest()[:16],
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "examples": data_cfg.builtin_examples,
        "answer_tokens": data_cfg.builtin_answer_tokens,
        "turns": data_cfg.builtin_turns,
        "random_weights": is_tiny_random(target),
        "seed": data_cfg.builtin_seed,
        "shard_size": BUILTIN_SHARD_SIZE,
        "builtin_version": BUILTIN_VERSION,
        "pipeline_version": PIPELINE_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def builtin_dir(target, data_cfg: DataConfig) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", target.info.name) or "target"
    return cache_root() / "data" / f"{name}-{builtin_key(target, data_cfg)}"


def ensure_builtin_data(target, data_cfg: DataConfig) -> Path:
    """The directory of the built-in conversations for this target, built if missing."""
    directory = builtin_dir(target, data_cfg)
    if is_distill_output(directory) and read_manifest(directory).get("complete"):
        return directory
    print(
        f"building the built-in data set for {target.info.name} "
        f"({data_cfg.builtin_examples} conversations, cached in {directory})"
    )
    cfg = builtin_distill_config(data_cfg, directory, random_weights=is_tiny_random(target))
    return run_distillation(target, cfg, seed=data_cfg.builtin_seed)
