"""Optimizer construction from a recipe: weight decay on matrices only.

``recipe.optimizer``: ``adamw`` and ``adam`` (torch's), or ``muon`` (:class:`MuonAdamW`:
``torch.optim.Muon`` on the hidden weight matrices, AdamW on everything else), optionally with
noise-adaptive per-matrix learning rates (``recipe.muon_layerwise_lr=noise``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from modbench.config import RecipeConfig
from modbench.errors import ModbenchError
from modbench.runtime.device import fused_kernel

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

    **Noise-adaptive layerwise learning rates** (``recipe.muon_layerwise_lr=noise``; Hao, Gong,
    Xu, Wang, Liu 2025, "Noise-Adaptive Layerwise Learning Rates: Accelerating Geometry-Aware
    Optimization for Deep Neural Network Training", arXiv 2510.14009, LANTON). Each Muon
    matrix ``l`` gets its own group and, before every step, its own lr scale::

        N_t^l = ( s_l ||G_t^l - B_{t-1}^l / (1 - mu^(t-1))||_* )^2  noise sample (t >= 2)
        H_t^l = beta H_{t-1}^l + (1 - beta) N_t^l,  H_0^l = 0        beta = muon_noise_beta
        Hhat_t^l = H_t^l / (1 - beta^n_l)                            n_l: samples so far
        r_t^l = min( c, sqrt( max_j Hhat_t^j / Hhat_t^l ) )          c = muon_noise_max_ratio
        lr_t^l = r_t^l x lr_t x muon_lr_ratio    (then Muon's per-shape adjust_lr as above)

    ``G`` is the (clipped) gradient, ``B_{t-1}`` Muon's momentum EMA (factor ``mu =
    muon_momentum``) before this step, bias-corrected as Adam's moments are: the running mean
    the deviation is measured from (with ``mu = 0`` it is the previous gradient, and the
    sample the two-point ``||G_t - G_{t-1}||``), ``||.||_*`` the nuclear norm (sum of singular
    values, ``torch.linalg.svdvals`` in float32): the dual of the spectral norm whose unit ball
    Muon's LMO (the orthogonalised update) lives in, scaled by the same per-shape factor
    ``s_l`` that ``muon_adjust_lr`` gives the step (a step of lr ``s_l O`` has length lr in the
    norm ``||.||_op / s_l``, whose dual is ``s_l ||.||_*``). The noisiest matrix keeps the
    group's lr, a quieter one steps up to ``c`` times further (layers with less gradient noise
    get larger steps, as the paper's noise-adaptive rate ~ 1/sigma_l). A matrix with no noise
    sample yet (the first step) has ``r = 1``. Decoupled weight decay scales with the matrix's
    lr, as Muon's does. The scales need one host read per step (Muon takes its lr as a Python
    number), and one SVD per matrix per step.

    *Choices where the paper's text was not available to us* (only its abstract and reviews):
    the deviation from the bias-corrected momentum (not from the previous gradient, which would
    need a copy of every gradient), the normalisation by the group's noisiest matrix, the
    per-shape factor ``s_l``, the cap ``c`` and the defaults ``beta = 0.99``, ``c = 10`` are
    ours.

    ``param_groups`` lists Muon's groups then AdamW's (the inner optimizers' own dicts, each
    with ``"optimizer": "muon" | "adamw"``; with ``noise``, one Muon group per matrix carrying
    its current ``lr_scale``); ``state_dict`` holds both inner state dicts (the noise EMA
    ``noise_ema``, its sample count ``noise_samples`` and ``momentum_steps`` sit in Muon's
    per-matrix state, so a resumed run continues bit-exactly). One process only: FSDP / DDP
    checkpoint helpers do not know this layout (refused by
    :func:`~modbench.train.distributed.check_world`)."""

    def __init__(self, model: nn.Module, recipe: RecipeConfig) -> None:
        muon, adamw = muon_split(model)
        if not muon:
            raise ModbenchError("recipe.optimizer=muon found no hidden weight matrix in the "
                                "model; use recipe.optimizer=adamw")
        self.layerwise = recipe.muon_layerwise_lr
        self.noise_beta = recipe.muon_noise_beta
        self.noise_max_ratio = recipe.muon_noise_max_ratio
        self.adjust_lr = recipe.muon_adjust_lr
        if self.layerwise == "noise":
            muon_groups = [{"params": [p], "optimizer": "muon", "lr_ratio": recipe.muon_lr_ratio,
                            "lr_scale": 1.0} for p in muon]
        else:
            muon_groups = [{"params": muon, "optimizer": "muon",
                            "lr_ratio": recipe.muon_lr_ratio}]
        self.muon = torch.optim.Muon(
            muon_groups,
            lr=recipe.lr, weight_decay=recipe.weight_decay, momentum=recipe.muon_momentum,
            nesterov=recipe.muon_nesterov, ns_steps=recipe.muon_ns_steps,
            adjust_lr_fn=recipe.muon_adjust_lr)
        decay = [p for p in adamw if p.ndim >= 2]
        rest = [p for p in adamw if p.ndim < 2]
        groups = [{"params": ps, "weight_decay": wd, "optimizer": "adamw"}
                  for ps, wd in ((decay, recipe.weight_decay), (rest, 0.0)) if ps]
        self.adamw = torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas,
                                       eps=recipe.eps, fused=fused_kernel(adamw))
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
        if self.layerwise == "noise":
            self._update_noise_scales()
        scheduled = [g["lr"] for g in self.muon.param_groups]
        try:
            for g in self.muon.param_groups:
                g["lr"] = g["lr"] * g["lr_ratio"]
                if "lr_scale" in g:
                    g["lr"] = g["lr"] * g["lr_scale"]
            self.muon.step()
        finally:
            for g, lr in zip(self.muon.param_groups, scheduled, strict=True):
                g["lr"] = lr
        self.adamw.step()
        return loss

    def dual_scale(self, shape: torch.Size) -> float:
        """``s_l``: the per-shape factor ``muon_adjust_lr`` gives a matrix's step (torch's
        ``Muon`` rule), so the noise is measured in the dual of the norm the step is taken in."""
        rows, cols = shape[:2]
        if self.adjust_lr == "match_rms_adamw":
            return 0.2 * math.sqrt(max(rows, cols))
        return math.sqrt(max(1.0, rows / cols))

    @torch.no_grad()
    def _update_noise_scales(self) -> None:
        """Add this step's noise sample to each matrix's EMA, then set every Muon group's
        ``lr_scale`` (the class docstring's ``r_t^l``)."""
        beta = self.noise_beta
        for g in self.muon.param_groups:
            (p,) = g["params"]
            if p.grad is None:
                continue
            state = self.muon.state[p]
            k = state.get("momentum_steps", 0)  # momentum updates before this step
            state["momentum_steps"] = k + 1
            if k == 0:  # no mean estimate yet
                continue
            mean = state["momentum_buffer"].float() / (1 - g["momentum"] ** k)
            dev = p.grad.float() - mean
            sample = (self.dual_scale(p.shape) * torch.linalg.svdvals(dev).sum()) ** 2
            if "noise_ema" in state:
                state["noise_ema"].mul_(beta).add_(sample, alpha=1 - beta)
                state["noise_samples"] += 1
            else:
                state["noise_ema"] = (1 - beta) * sample
                state["noise_samples"] = 1
        states = [self.muon.state[g["params"][0]] for g in self.muon.param_groups]
        known = [i for i, st in enumerate(states) if "noise_ema" in st]
        scales = [1.0] * len(states)
        if known:
            hhat = torch.stack([states[i]["noise_ema"].float()
                                / (1 - beta ** states[i]["noise_samples"]) for i in known])
            top = hhat.max()
            cap = torch.full_like(hhat, self.noise_max_ratio)
            # a matrix without noise steps at the cap; if none has noise, all keep the lr
            ratio = torch.where(hhat > 0, (top / hhat.clamp(min=torch.finfo(hhat.dtype).tiny))
                                .sqrt().clamp(max=self.noise_max_ratio), cap)
            ratio = torch.where(top > 0, ratio, torch.ones_like(hhat))
            for i, r in zip(known, ratio.tolist(), strict=True):  # one host read per step
                scales[i] = r
        for g, r in zip(self.muon.param_groups, scales, strict=True):
            g["lr_scale"] = r

    def layer_lr_scales(self) -> list[float]:
        """Each Muon matrix's current ``lr_scale`` (1.0 for all without
        ``recipe.muon_layerwise_lr=noise``), in the order of :func:`muon_split`."""
        return [g.get("lr_scale", 1.0) for g in self.muon.param_groups
                for _ in g["params"]]

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
        saved = state_dict["muon"]["param_groups"]
        layerwise = "noise" if any("lr_scale" in g for g in saved) else "none"
        if layerwise != self.layerwise or len(saved) != len(self.muon.param_groups):
            raise ModbenchError(f"the checkpoint's Muon state was trained with "
                                f"recipe.muon_layerwise_lr={layerwise} ({len(saved)} Muon "
                                f"groups), this optimizer has {self.layerwise} "
                                f"({len(self.muon.param_groups)}); resume with the recipe the "
                                "run was trained with")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]
        self.state = self.adamw.state


def build_optimizer(model: nn.Module, recipe: RecipeConfig) -> torch.optim.Optimizer:
    if recipe.optimizer == "muon":
        return MuonAdamW(model, recipe)
    groups = param_groups(model, recipe.weight_decay)
    fused = fused_kernel([p for g in groups for p in g["params"]])  # type: ignore[attr-defined]
    kind = torch.optim.Adam if recipe.optimizer == "adam" else torch.optim.AdamW
    return kind(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps, fused=fused)
