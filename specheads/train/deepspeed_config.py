"""The DeepSpeed JSON config and the optimizer's parameter groups, from the job's typed settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config.train import DeepSpeedConfig, TrainConfig
from ..errors import SpecHeadsError


def param_groups(module: nn.Module, weight_decay: float, own_lr: tuple[nn.Module, float] | None = None) -> list[dict]:
    """Decay matrices only; norms and biases are left alone (the usual AdamW split). `own_lr`
    (submodule, lr) puts that submodule's parameters in groups of their own at that learning rate
    (Medusa-2's LoRA trains slower than its heads); the others take the optimizer's."""

    def split(params: list, **extra) -> list[dict]:
        rest = [p for p in params if p.ndim < 2]
        decay = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, **extra}]
        return decay + ([{"params": rest, "weight_decay": 0.0, **extra}] if rest else [])

    special = {id(p) for p in own_lr[0].parameters()} if own_lr is not None else set()
    trained = [p for p in module.parameters() if p.requires_grad]
    groups = split([p for p in trained if id(p) not in special])
    if own_lr is not None:
        own = split([p for p in trained if id(p) in special], lr=own_lr[1])
        groups += [g for g in own if g["params"]]
    return groups


def deepspeed_config(
    t: TrainConfig, z: DeepSpeedConfig, world_size: int, device: torch.device, head_dtype: torch.dtype
) -> dict[str, Any]:
    if z.zero_stage not in (0, 1, 2, 3):
        raise SpecHeadsError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {z.zero_stage}")
    zero: dict[str, Any] = {"stage": z.zero_stage}
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if z.offload_param:
        if z.zero_stage != 3:
            raise SpecHeadsError("deepspeed.offload_param needs deepspeed.zero_stage=3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": head_dtype == torch.bfloat16},
        "fp16": {"enabled": head_dtype == torch.float16},
        # our torch AdamW is fine under ZeRO; DeepSpeed only vouches for its own by default
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if z.offload_optimizer:
        # ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's own (compiled) CPU Adam.
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": t.lr, "betas": list(t.betas), "weight_decay": t.weight_decay},
        }
    config.update(z.extra)
    return config
