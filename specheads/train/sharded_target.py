"""The frozen target partitioned across the ranks with ZeRO-3 (DeepSpeed's ZeRO-Inference).

Each rank keeps 1/world of every target weight; a layer's weights are all-gathered just before its
forward and released after it, so no rank ever holds the whole target. A checkpoint on disk is
loaded straight into partitions (transformers' ZeRO-3 loading, switched on by HfDeepSpeedConfig),
so the whole target never exists in one process either; a target built in memory (the tiny test
targets) is partitioned by deepspeed.initialize. Hidden-state capture works unchanged (forward
hooks on the layers), and the head's references to the embedding, LM head and final norm gather
their weights when called. Every rank must run the same target forwards in the same order (the
all-gathers are collective): the online state source does, with equal batch counts per rank.
"""

from __future__ import annotations

import contextlib

import torch

from ..config.model import ModelConfig
from ..config.train import TrainJobConfig
from ..distributed import Dist
from ..errors import SpecHeadsError
from ..heads import HEADS
from ..target import TINY_PREFIX, FrozenTarget, load_target


def inference_config() -> dict:
    """ZeRO-3 with no optimizer: parameters partitioned, gathered per module for its forward."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": False},
    }


def check_shardable(cfg: TrainJobConfig) -> None:
    """What a sharded target cannot serve: one-rank-only target work and adapters inside it. The
    sharding was asked for (deepspeed.shard_target=true) or chosen by the plan (the whole target
    fits no GPU): the messages name both."""
    sharded = "a target sharded over the ranks (deepspeed.shard_target, asked for or chosen by the plan)"
    if cfg.data.features:
        raise SpecHeadsError(
            f"{sharded} trains online (every rank runs its share of each target forward); "
            f"drop data.features={cfg.data.features}"
        )
    if cfg.data.path == "builtin":
        raise SpecHeadsError(f"{sharded} needs data.path: the built-in data is written by the target on one rank")
    family = HEADS.get(cfg.head.family)
    if family is not None and family.adapts_target:
        raise SpecHeadsError(f"head={cfg.head.family} trains an adapter inside the target, which cannot be sharded")


def load_sharded_target(model_cfg: ModelConfig, d: Dist) -> FrozenTarget:
    """The frozen target, partitioned over the ranks of `d` (its parameters hold 1/world each)."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    config = inference_config()
    # alive during loading: transformers then reads checkpoints straight into ZeRO-3 partitions
    # (a tiny target is built from its seed instead, whole, and partitioned by initialize below:
    # random weights initialised inside partitions would not be the tiny target's own)
    loading = None if model_cfg.path.startswith(TINY_PREFIX) else HfDeepSpeedConfig(config)
    # the random state is left as it was (the head's initialisation draws from it next), as when
    # the target is loaded whole
    with torch.random.fork_rng(devices=[]):
        target = load_target(model_cfg, d.device)
        # partitions a target built in memory, and hooks gather/release around every module's forward
        engine, *_ = deepspeed.initialize(model=target.model, config=config)
    if engine.module is not target.model:
        raise RuntimeError("deepspeed.initialize was expected to wrap the target's model in place")
    target.model.eval()
    target.zero3_loading = loading  # transformers keeps only a weak reference to it
    return target


def is_sharded(target: FrozenTarget) -> bool:
    return any(hasattr(p, "ds_id") for p in target.model.parameters())


@contextlib.contextmanager
def frozen_parts_gathered(target: FrozenTarget):
    """Within the block the embedding, LM head and final norm hold their whole weights on every rank
    (a head copies from them when it is built); a replicated target is left as it is."""
    if not is_sharded(target):
        yield
        return
    import deepspeed

    params = [p for m in (target.embed_tokens, target.lm_head, target.final_norm) for p in m.parameters()]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield
