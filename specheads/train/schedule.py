"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio * lr; and the wall-clock
budget (train.max_minutes) that can end a run, and its schedule, before max_steps."""

from __future__ import annotations

import math
import time

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


class TimeBudget:
    """A run limited to `minutes` of training (train.max_minutes). `projected_end(step)` is where the
    run will stop at the steps/s seen so far: the schedule's cosine is retargeted to it, so a
    budgeted run decays its learning rate fully instead of being cut off mid-curve. The first
    `settle_steps` steps (compilation, allocator warm-up) are not used for the estimate."""

    def __init__(self, minutes: float, first_step: int, settle_steps: int = 10, clock=time.monotonic):
        if minutes <= 0:
            raise ValueError(f"train.max_minutes must be > 0, got {minutes}")
        self.seconds = 60.0 * minutes
        self.clock = clock
        self.start = clock()
        self.settle_steps = settle_steps
        self.first_step = first_step
        self.settled: tuple[int, float] | None = None  # (step, time) once past settle_steps

    def elapsed(self) -> float:
        return self.clock() - self.start

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds

    def projected_end(self, step: int, max_steps: int) -> int | None:
        """The step the budget will end at (at most max_steps), or None before an estimate exists."""
        now = self.clock()
        if self.settled is None:
            if step - self.first_step >= self.settle_steps:
                self.settled = (step, now)
            return None
        settled_step, settled_at = self.settled
        if step <= settled_step or now <= settled_at:
            return None
        rate = (step - settled_step) / (now - settled_at)
        left = max(0.0, self.seconds - (now - self.start))
        return min(max_steps, step + int(rate * left))
