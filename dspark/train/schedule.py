"""Warmup + cosine learning rate over a step count or a wall-time budget, whichever ends first:
on a shared CPU the step rate is not known in advance, so the schedule follows the clock."""

from __future__ import annotations

import math
import time


class Schedule:
    def __init__(self, lr: float, min_lr: float, warmup: int, max_steps: int, budget_s: float):
        self.lr, self.min_lr, self.warmup = lr, min_lr, warmup
        self.max_steps, self.budget_s = max_steps, budget_s
        self.t0 = time.time()

    def progress(self, step: int) -> float:
        return min(1.0, max(step / self.max_steps, (time.time() - self.t0) / self.budget_s))

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0

    def rate(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * self.progress(step)))


def adamw(params, lr, weight_decay):
    """AdamW with decay on matrices only (norm gains, biases and gdn decay parameters are 1-D)."""
    import torch
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))
