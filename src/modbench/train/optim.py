"""Optimizer construction from a recipe: weight decay on matrices only."""

from __future__ import annotations

import torch
from torch import nn

from modbench.config import RecipeConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Two groups: tensors with ``ndim >= 2`` (matrices and embeddings) decay, the rest
    (norm gains, scalars, per-channel gates, biases) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, recipe: RecipeConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, recipe.weight_decay)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps)
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps)
