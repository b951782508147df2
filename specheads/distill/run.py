"""The distill.py job: load the target, regenerate the data, then (optionally) cache features."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.distill import DistillJobConfig
from ..config.train import DataConfig
from ..data.datasets import build_datasets
from ..data.features import ensure_split_features
from ..heads.spec import default_layer_ids
from ..target import load_target, resolve_device
from .regenerate import run_distillation


def distill(job: DistillJobConfig) -> Path:
    """Run (or finish) the distillation described by the job's settings."""
    torch.manual_seed(job.seed)
    target = load_target(job.model, resolve_device(job.device))
    out = run_distillation(target, job.distill, seed=job.seed, target_path=job.model.path)
    if job.distill.features.enabled:
        cache_features(job, target, out)
    return out


def cache_features(job: DistillJobConfig, target, data_dir: Path) -> Path:
    """Cache the target's states over the distilled conversations, split as train.py splits them.

    Train from it with `python train.py data.path=DATA_DIR data.features=FEATURES_DIR`.
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
    train_rows, eval_rows = build_datasets(data_cfg, target.tokenizer)
    ensure_split_features(
        target,
        {"train": train_rows, "eval": eval_rows},
        layer_ids,
        feats.final,
        out,
        feats.max_length,
        dtype=feats.dtype,
        data_fingerprint=getattr(train_rows, "_fingerprint", None),
    )
    print(f"features: {out}")
    return out
