"""Optimizer construction from a recipe: weight decay on matrices only.

``recipe.optimizer``: ``adamw`` and ``adam`` (torch's), or ``muon`` (:class:`MuonAdamW`:
``torch.optim.Muon`` on the hidden weight matrices, AdamW on everything else).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from modbench.config import RecipeConfig
from modbench.errors import ModbenchError

#: a parameter carrying this attribute set to True is never given to Muon (a method's hook
#: for a 2-D parameter that is not a hidden matrix: a mixing table, a per-channel gain)
NO_MUON = "modbench_no_muon"


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


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(muon, adamw)``: the trainable parameters Muon updates and those AdamW updates.

    Muon takes the hidden weight matrices: every 2-D parameter with both sides > 1, except
    the parameters of ``nn.Embedding`` modules (the input embedding, and so a tied head), of
    the module named ``head`` (an untied LM head) and any parameter marked :data:`NO_MUON`.
    AdamW takes the rest: embeddings, the head, norm gains, scalars, biases, vectors stored
    as ``(1, d)``. This is the split of Jordan et al.'s Muon and of OSP (Park et al. 2025):
    orthogonalised updates for hidden layers only."""
    outer: set[int] = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) or name.split(".")[-1] == "head":
            outer.update(id(p) for p in m.parameters())
    muon, adamw = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        hidden = (p.ndim == 2 and min(p.shape) > 1 and id(p) not in outer
                  and not getattr(p, NO_MUON, False))
        (muon if hidden else adamw).append(p)
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the hidden matrices, AdamW for the rest, as one optimizer.

    **Update.** ``torch.optim.Muon`` (torch's maintained implementation of Jordan et al.
    2024): momentum ``B <- mu B + (1 - mu) g`` (an EMA), the Nesterov look-ahead
    ``(1 - mu) g + mu B``, five steps of the Newton-Schulz quintic ``X <- aX + (bA + cA^2)X``,
    ``A = XX^T``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)`` from ``X_0 = M/||M||_F``
    (transposed when tall), decoupled weight decay ``W <- W(1 - lr wd)``, then
    ``W <- W - lr' O``.

    **Learning rate.** The trainer writes the schedule's lr into every group's ``lr``
    (``engine.set_lr``). The Muon groups step at ``lr x recipe.muon_lr_ratio`` (the ratio is
    kept in the group as ``lr_ratio``; ``lr`` itself stays the schedule's), and Muon then
    scales that per matrix by ``recipe.muon_adjust_lr``: ``match_rms_adamw`` (default;
    Liu et al. 2025, "Muon is Scalable"): ``lr' = 0.2 lr sqrt(max(A, B))``, which gives the
    update AdamW's RMS so the recipe's AdamW lr and weight decay carry over unchanged (ratio
    1); ``original`` (Jordan): ``lr' = lr sqrt(max(1, A/B))``, which wants a ratio near
    0.02 / AdamW's lr. The AdamW groups use the recipe's betas, eps and weight decay (decay
    on ``ndim >= 2`` only: the embeddings and the head, as :func:`param_groups`).

    ``param_groups`` lists Muon's groups then AdamW's (the inner optimizers' own dicts, each
    with ``"optimizer": "muon" | "adamw"``); ``state_dict`` holds both inner state dicts.
    One process only: FSDP / DDP checkpoint helpers do not know this layout (refused by
    :func:`~modbench.train.distributed.check_world`)."""

    def __init__(self, model: nn.Module, recipe: RecipeConfig) -> None:
        muon, adamw = muon_split(model)
        if not muon:
            raise ModbenchError("recipe.optimizer=muon found no hidden weight matrix in the "
                                "model; use recipe.optimizer=adamw")
        self.muon = torch.optim.Muon(
            [{"params": muon, "optimizer": "muon", "lr_ratio": recipe.muon_lr_ratio}],
            lr=recipe.lr, weight_decay=recipe.weight_decay, momentum=recipe.muon_momentum,
            nesterov=recipe.muon_nesterov, ns_steps=recipe.muon_ns_steps,
            adjust_lr_fn=recipe.muon_adjust_lr)
        decay = [p for p in adamw if p.ndim >= 2]
        rest = [p for p in adamw if p.ndim < 2]
        groups = [{"params": ps, "weight_decay": wd, "optimizer": "adamw"}
                  for ps, wd in ((decay, recipe.weight_decay), (rest, 0.0)) if ps]
        self.adamw = torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas,
                                       eps=recipe.eps)
        # deliberately no super().__init__: the inner optimizers own the state; these
        # attributes make the pair look like one torch optimizer to the trainer
        self.defaults = {"lr": recipe.lr}
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        self.state = self.adamw.state  # AdamW's; Muon's is self.muon.state

    def __repr__(self) -> str:
        return f"MuonAdamW(muon={self.muon!r}, adamw={self.adamw!r})"

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scheduled = [g["lr"] for g in self.muon.param_groups]
        try:
            for g in self.muon.param_groups:
                g["lr"] = g["lr"] * g["lr_ratio"]
            self.muon.step()
        finally:
            for g, lr in zip(self.muon.param_groups, scheduled, strict=True):
                g["lr"] = lr
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if set(state_dict) != {"muon", "adamw"}:
            raise ModbenchError("the checkpoint's optimizer state is not a Muon one (keys "
                                f"{sorted(state_dict)}); resume with the recipe.optimizer "
                                "it was trained with")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        self.state = self.adamw.state


def build_optimizer(model: nn.Module, recipe: RecipeConfig) -> torch.optim.Optimizer:
    if recipe.optimizer == "muon":
        return MuonAdamW(model, recipe)
    groups = param_groups(model, recipe.weight_decay)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps)
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps)
