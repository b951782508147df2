"""The distill.py job: load the target, regenerate the data, then (optionally) cache features."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..errors import SpecHeadsError
from ..target import load_target, resolve_device
from .config import DistillJobConfig
from .regenerate import run_distillation


def distill(cfg) -> Path:
    """Run (or finish) the distillation described by a composed distill config."""
    job: DistillJobConfig = OmegaConf.to_object(cfg) if not isinstance(cfg, DistillJobConfig) else cfg
    torch.manual_seed(job.seed)
    target = load_target(job.model, resolve_device(job.device))
    out = run_distillation(target, job.distill, seed=job.seed, target_path=job.model.path)
    if job.distill.features.enabled:
        cache_features(job, target, out)
    return out


def cache_features(job: DistillJobConfig, target, data_dir: Path) -> Path:
    """Offline hidden-state caching of the distilled conversations (the hook for distill.features)."""
    raise SpecHeadsError("distill.features.enabled: offline feature caching is not available yet")
