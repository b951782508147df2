"""Structured configs: one schema module per entry point, every YAML in conf/ validated against them.

Registering the schemas in Hydra's ConfigStore makes composition strict: an unknown key or a value
of the wrong type fails when the config is composed, before any weights are loaded. Each entry
point then turns the composed config into its schema's dataclasses once (`typed`) and passes
those on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import SpecHeadsError
from .distill import DistillJobConfig
from .export import ExportJobConfig
from .infer import InferJobConfig, TreeConfig
from .model import ModelConfig
from .train import DataConfig, DeepSpeedConfig, HeadConfig, TrainJobConfig


def installed_conf_dir() -> Path:
    """The Hydra configs installed with specheads: the package `specheads.conf`, which is conf/ of
    the source tree copied into the wheel (setup.py), or conf/ itself in an editable install."""
    try:
        spec = importlib.util.find_spec("specheads.conf")
    except ImportError:
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise SpecHeadsError(
            "specheads' configs (the package specheads.conf) are not installed: install specheads with pip "
            "(`pip install .`, or `pip install -e .` in a checkout), or run the scripts of a checkout"
        )
    return Path(locations[0])


def model_option(name: str, conf_dir: Path | None = None) -> tuple[str, Any] | None:
    """(option, its yaml) of the conf/model option whose `name` is `name` (model=OPTION selects it;
    llama-70b's name is llama-3.3-70b), None when none is; conf_dir defaults to the installed configs."""
    for path in sorted(((conf_dir or installed_conf_dir()) / "model").glob("*.yaml")):
        data = OmegaConf.load(path)
        if data.get("name") == name:
            return path.stem, data
    return None


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


def unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Keys of a composed config that its schema does not declare. Hydra's `+key=value` adds
    keys even to a structured config, and OmegaConf.to_object would carry them along unread."""
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if schema is None or not dataclasses.is_dataclass(schema):
        return []  # free-form dicts (model.tiny, deepspeed.extra) take any key
    declared = {f.name for f in dataclasses.fields(schema)}
    found = []
    for key in node.keys():
        if key not in declared:
            found.append(f"{prefix}{key}")
        else:
            found += unknown_keys(node._get_node(key), f"{prefix}{key}.")
    return found


def typed(cfg: Any) -> Any:
    """A composed config as its schema's dataclass objects, interpolations resolved. A key the
    schema lacks, or a value composition cannot check (a mandatory `???` left unset), becomes one
    SpecHeadsError line."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise SpecHeadsError(f"unknown config key {', '.join(unknown)}: not in the schema")
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        first = str(err).strip().splitlines()[0]
        key = getattr(err, "full_key", None)
        raise SpecHeadsError(first + (f" ({key})" if key and key not in first else "")) from None
