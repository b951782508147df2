"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio * lr."""

from __future__ import annotations

import math

import torch


class WarmupCosine:
    """LR multiplier for LambdaLR. A plain object (not a lambda) so its settings are saved with
    the scheduler's state_dict and a resumed run continues the same curve."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps = max(0, warmup_steps)
        self.total_steps = max(1, total_steps)
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        # LambdaLR calls this with the number of optimizer steps taken so far (0 before the first).
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))
