"""Structured configs: one schema module per entry point, every YAML in conf/ validated against them.

Registering the schemas in Hydra's ConfigStore makes composition strict: an unknown key or a value
of the wrong type fails when the config is composed, before any weights are loaded. Each entry
point then turns the composed config into its schema's dataclasses once (`typed`) and passes
those on.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import SpecHeadsError
from .distill import DistillJobConfig
from .export import ExportJobConfig
from .infer import InferJobConfig, TreeConfig
from .model import ModelConfig
from .train import DataConfig, DeepSpeedConfig, HeadConfig, TrainJobConfig


def register_configs() -> None:
    """Every primary's schema (conf/<primary>.yaml names it first) and every group's."""
    cs = ConfigStore.instance()
    for name, node in (
        ("train_schema", TrainJobConfig),
        ("distill_schema", DistillJobConfig),
        ("infer_schema", InferJobConfig),
        ("export_schema", ExportJobConfig),
    ):
        cs.store(name=name, node=node)
    for group, node in (
        ("model", ModelConfig),
        ("head", HeadConfig),
        ("data", DataConfig),
        ("deepspeed", DeepSpeedConfig),
        ("tree", TreeConfig),
    ):
        cs.store(group=group, name=f"{group}_schema", node=node)


def typed(cfg: Any) -> Any:
    """A composed config as its schema's dataclass objects, interpolations resolved. A value
    composition cannot check (a mandatory `???` left unset) becomes one SpecHeadsError line."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        first = str(err).strip().splitlines()[0]
        key = getattr(err, "full_key", None)
        raise SpecHeadsError(first + (f" ({key})" if key and key not in first else "")) from None
