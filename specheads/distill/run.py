"""The distill.py job: load the target, regenerate the data, then (optionally) cache features.

Under a launcher (`torchrun --nproc_per_node N distill.py ...` or `deepspeed distill.py ...`) the
ranks share the feature caching of a finished distillation: each writes its shards of the cache,
and the cache equals the one a single process writes. Regeneration runs on one process: later
shards depend on the prompts of earlier ones (deduplication), so it is not split.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..config.distill import DistillJobConfig
from ..config.train import DataConfig
from ..data.datasets import build_datasets
from ..data.features import ensure_split_features
from ..data.shards import is_distill_output, read_manifest
from ..distributed import Dist, main_rank_first, process_group
from ..errors import SpecHeadsError
from ..heads.spec import default_layer_ids
from ..target import TINY_PREFIX, load_target, resolve_device
from .backends import load_tokenizer_target
from .regenerate import run_distillation

# who computes the cached features (distill.features.backend)
FEATURE_BACKENDS = ("transformers", "vllm")


def launched_world_size() -> int:
    """How many ranks a launcher started (1 for a plain `python distill.py`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distill(job: DistillJobConfig) -> Path | None:
    """Run (or finish) the distillation described by the job's settings; the directory on rank 0."""
    torch.manual_seed(job.seed)
    if launched_world_size() == 1:
        return distill_on(job, None)
    check_ranks_can_share(job)
    with process_group(job.device) as d:
        out = distill_on(job, d)
    return out if d.is_main else None


def distill_on(job: DistillJobConfig, d: Dist | None) -> Path:
    """The job in one process (`d` None) or on one rank of a process group."""
    feats = job.distill.features
    if feats.backend not in FEATURE_BACKENDS:
        raise SpecHeadsError(f"unknown distill.features.backend={feats.backend!r}; use one of {list(FEATURE_BACKENDS)}")
    if feats.enabled and feats.backend == "vllm" and not feats.server.url:
        raise SpecHeadsError(
            "distill.features.backend=vllm needs distill.features.server.url=http://HOST:PORT/v1: a vLLM server "
            "running extract_hidden_states (docs/training.md, Features from vLLM)"
        )
    if feats.enabled and feats.backend == "vllm" and not feats.storage:
        raise SpecHeadsError(
            "distill.features.backend=vllm needs distill.features.storage=DIR: the server's shared_storage_path as "
            "this machine sees it (its dumps are read and deleted only there)"
        )
    if needs_no_weights(job):
        target = load_tokenizer_target(job.model)  # the weights are served elsewhere
    else:
        target = load_target(job.model, d.device if d is not None else resolve_device(job.device))
    out = run_distillation(target, job.distill, seed=job.seed, target_path=job.model.path)
    if job.distill.features.enabled:
        cache_features(job, target, out, d)
    return out


def needs_no_weights(job: DistillJobConfig) -> bool:
    """Whether the job runs the target elsewhere only: its answers written by a server (or already
    written) and its features, if any, computed by vLLM. Then only its tokenizer is loaded here."""
    feats = job.distill.features
    if job.model.path.startswith(TINY_PREFIX) or (feats.enabled and feats.backend == "transformers"):
        return False
    if job.distill.backend == "server":
        return True
    out = Path(job.distill.output).expanduser()
    return feats.enabled and is_distill_output(out) and bool(read_manifest(out).get("complete"))


def check_ranks_can_share(job: DistillJobConfig) -> None:
    out = Path(job.distill.output).expanduser()
    if not job.distill.features.enabled:
        raise SpecHeadsError("distill.py on several ranks caches features only: add distill.features.enabled=true")
    if not (is_distill_output(out) and read_manifest(out).get("complete")):
        raise SpecHeadsError(
            f"{out} is not a finished distillation: regenerate it on one process first "
            "(python distill.py ...), then cache its features on several ranks"
        )


def cache_features(job: DistillJobConfig, target, data_dir: Path, d: Dist | None = None) -> Path:
    """Cache the target's states over the distilled conversations, split as train.py splits them.

    Train from it with `python train.py data.path=DATA_DIR data.features=FEATURES_DIR`. In a process
    group `d`, rank 0 tokenizes first and the others reuse its cache. With
    distill.features.backend=vllm the states come from a vLLM server (specheads.distill.vllm_features),
    and `target` needs only its tokenizer and info here.
    """
    feats = job.distill.features
    out = Path(feats.output) if feats.output else data_dir / "features"
    layer_ids = feats.layer_ids or default_layer_ids("eagle3", target.info.num_layers)
    data_cfg = DataConfig(
        name="distilled",
        path=str(data_dir),
        max_length=feats.max_length,
        eval_fraction=feats.eval_fraction,
        shuffle_seed=feats.shuffle_seed,
        decontaminate=list(job.distill.decontaminate),
    )
    with main_rank_first(d) if d is not None else contextlib.nullcontext():
        train_rows, eval_rows = build_datasets(data_cfg, target.tokenizer)
    source = None  # the target loaded here (specheads.data.features.TargetForward)
    if feats.backend == "vllm":
        from .vllm_features import VLLMStates

        source = VLLMStates(target, feats.server, layer_ids, feats.final, feats.storage)
    ensure_split_features(
        target,
        {"train": train_rows, "eval": eval_rows},
        layer_ids,
        feats.final,
        out,
        feats.max_length,
        dtype=feats.dtype,
        data_fingerprint=getattr(train_rows, "_fingerprint", None),
        shard_tokens=feats.shard_tokens,
        source=source,
    )
    if d is None or d.is_main:
        print(f"features: {out}")
    return out
