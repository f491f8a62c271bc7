"""Learning-rate schedule: linear warm-up, then cosine (or linear, or constant) to a floor."""

from __future__ import annotations

import math

from modbench.config import RecipeConfig


def lr_at(step: int, recipe: RecipeConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a ``total_steps`` run.

    Warm-up is linear from ``lr / warmup`` at step 0 to ``lr`` at step ``warmup - 1``; the
    decay then runs from ``lr`` to ``min_lr_ratio * lr`` at the last step.
    """
    peak, floor = recipe.lr, recipe.lr * recipe.min_lr_ratio
    warmup = min(recipe.warmup_for(total_steps), total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    if recipe.schedule == "constant":
        return peak
    span = max(total_steps - warmup - 1, 1)
    progress = min(max((step - warmup) / span, 0.0), 1.0)
    if recipe.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
