"""infer.py's session: the draft head (a head directory, Hub id or engine export) and its target,
and a separate draft model (draft.model) where one is given."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ..config.infer import InferJobConfig
from ..config.model import ModelConfig
from ..decode.draft_model import DraftModel, DraftModelDrafter, load_draft_model
from ..decode.drafters import make_drafter, make_hybrid_drafter
from ..decode.policy import DraftPlan
from ..errors import SpecHeadsError
from ..export import is_exported_dir, open_head, resolve_head_path
from ..heads import read_head_config
from ..heads.io import prepare_for_drafting, route_draft_kernels
from ..kernels import gqa_attention
from ..kernels.linear_layout import describe, install, measure_layouts
from ..target import TINY_PREFIX, FrozenTarget, load_target, resolve_device
from .trees import use_cached_tree


@dataclass
class Session:
    target: FrozenTarget
    head: Any  # DraftHead or None (baseline-only benchmark)
    head_dir: Path | None
    head_config: dict
    layouts: Any = None  # the measured linear kernels installed on the target (linear_layout=auto)
    allow_target_mismatch: bool = False  # heads trained on other weights of the target's shape load too
    head_dtype: str = "auto"  # infer.py's head_dtype: what every head of the session drafts in
    draft: DraftModel | None = None  # draft.model, loaded for the target (decode/draft_model.py)
    skip: Any = None  # bench.layer_skip.LayerSkip: the target's layers skipped to draft (skip.layers)

    def draft_like_own_head(self, head, head_dtype: str | None = None) -> None:
        """Prepare another head to draft as the session's own does: in `head_dtype` (the session's
        unless given) and through the target's measured row kernels."""
        prepare_for_drafting(head, head_dtype or self.head_dtype, self.target)
        if self.layouts is not None:
            route_draft_kernels(head, self.layouts)


def method_drafter(session: Session, method: str, plan: DraftPlan) -> tuple:
    """(drafter, policy, what drafts) of a drafting method over the session: the policy the run's
    plan resolved for it (policy.plan_drafts; skip: the layer skip's own choice), drafted by the
    session's head, the text, its draft model or the target's skipped layers; what drafts: the
    head's path or the draft model's name (None: the text or the target alone)."""
    if method == "skip":
        return session.skip.drafter(session.target), session.skip.policy, None
    policy = plan.policy(method)
    if method == "spec":
        return make_drafter(session.head, policy), policy, str(session.head_dir)
    if method == "draft":
        return DraftModelDrafter(session.draft, policy), policy, session.draft.name
    head = str(session.head_dir) if method == "hybrid" and session.head is not None else None
    return make_hybrid_drafter(session.head, policy), policy, head  # lookup, suffix: policy.head is None


def model_config_for_head(head_config: dict, conf_dir: Path) -> ModelConfig:
    """The target a head was trained for: its training record, the tiny target its identity names,
    a conf/model option with the target's name, or else the name itself as a Hub id / path."""
    base = OmegaConf.structured(ModelConfig)
    recorded = (head_config.get("training") or {}).get("model")
    if isinstance(recorded, dict):
        known = {k: v for k, v in recorded.items() if k in ModelConfig.__dataclass_fields__}
        return OmegaConf.to_object(OmegaConf.merge(base, known))
    target = head_config.get("target") or {}
    name = target.get("name")
    if not name:
        raise SpecHeadsError("the head's config.json names no target; give model=NAME")
    identity = target.get("identity") or {}
    source = str(identity.get("source") or "")
    if source.startswith(TINY_PREFIX):  # every tiny type is named tiny-random: the source says which
        return ModelConfig(name=name, path=source, tiny=dict(identity.get("tiny") or {}))
    for path in sorted((conf_dir / "model").glob("*.yaml")):
        data = OmegaConf.load(path)
        if data.get("name") == name or path.stem == name:
            data.pop("defaults", None)
            return OmegaConf.to_object(OmegaConf.merge(base, data))
    return ModelConfig(name=name, path=name, revision=target.get("revision"))


def load_session(settings: InferJobConfig, conf_dir: Path) -> Session:
    head_dir = resolve_head_path(settings.head_path) if settings.head_path else None
    if head_dir is not None and not head_dir.is_dir():
        raise SpecHeadsError(f"head={settings.head_path} is not a directory (config.json + model.safetensors)")
    exported = head_dir is not None and is_exported_dir(head_dir)
    head_config = read_head_config(head_dir) if head_dir is not None and not exported else {}
    if settings.model is not None:
        model_cfg = settings.model
    elif exported:
        raise SpecHeadsError(f"{head_dir} is an engine-format head that names no specheads target: give model=NAME")
    else:
        model_cfg = model_config_for_head(head_config, conf_dir)
    target = load_target(model_cfg, resolve_device(settings.device))
    head = open_head(head_dir, target, settings.allow_target_mismatch) if head_dir else None
    if head is not None:
        prepare_for_drafting(head, settings.head_dtype, target)
    if head is not None and not exported and settings.tree.kind == "default":
        # a tree calibrated for this head on this machine (tree=auto) beats the one it shipped with
        kernels = settings.linear_layout == "auto" and target.device.type == "cpu"
        use_cached_tree(head, head_dir, target, kernels=kernels)
    draft = load_draft_model(settings.draft, target) if settings.draft.model else None
    layouts = None
    if settings.linear_layout == "auto" and target.device.type == "cpu":
        gqa_attention.install(target.model)  # before timing: the kernels are timed as they will run
        layouts = measure_layouts(target.model)
        # the draft head's multi-row steps (tree levels, catch-up) meet the same small-row matmuls
        install(target.model, layouts)
        if head is not None:
            route_draft_kernels(head, layouts)
        if draft is not None:  # and so do a draft model's (its tree levels under a mask, catch-up)
            gqa_attention.install(draft.model)
            install(draft.model, layouts)
        print(describe(layouts), file=sys.stderr)
    return Session(
        target, head, head_dir, head_config, layouts, settings.allow_target_mismatch, settings.head_dtype, draft
    )
