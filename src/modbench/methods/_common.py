"""Helpers shared by the methods (not a method module: names starting with
``_`` are not imported by the registry)."""

from __future__ import annotations

from typing import Any

from torch import nn

from modbench.config import ModelConfig
from modbench.model.spec import parts_of
from modbench.runtime.callback import Callback


def baseline_norm_count(cfg: ModelConfig) -> int:
    """Norms of the baseline (Pre-LN) placement: two input norms per block and the final
    norm. Norm types document their parameter overhead against this placement."""
    return 2 * cfg.n_layers + 1


def projection_widths(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(d_in, d_out)`` of each projection of a baseline block, by role (q k v o of the
    attention, gate up down of the gated FFN)."""
    d, dh = cfg.d_model, cfg.head_dim
    return {"q": (d, cfg.n_heads * dh), "k": (d, cfg.n_kv_heads * dh),
            "v": (d, cfg.n_kv_heads * dh), "o": (cfg.n_heads * dh, d),
            "gate": (d, cfg.d_ff), "up": (d, cfg.d_ff), "down": (cfg.d_ff, d)}


def block_projection_params(cfg: ModelConfig) -> int:
    """Parameters of one baseline block's projections (its attention and FFN cores)."""
    return sum(i * o for i, o in projection_widths(cfg).values())


def set_step(model: nn.Module, step: int, total: int) -> None:
    """Tell the step-dependent modules of ``model`` (PowerNorm's warm-up, PRepBN's lambda)
    the 0-based optimizer ``step`` of a run of ``total`` steps."""
    for m in model.modules():
        fn = getattr(m, "modbench_set_step", None)
        if callable(fn):
            fn(step, total)


class StepCallback(Callback):
    """Trainer callback that tells step-dependent modules the current optimizer step.

    Before every batch (and at the start, so a resumed run is right from its first step) it
    calls ``module.modbench_set_step(step, total_steps)`` on every module of the model that
    has that method. Outside the trainer the modules keep their own step (0 unless set).
    """

    def _apply(self, trainer: Any, step: int) -> None:
        set_step(trainer.model, step, trainer.cfg.train.steps)

    def on_train_start(self, trainer: Any) -> None:
        self._apply(trainer, trainer.step)

    def on_batch(self, trainer: Any, step: int, batch: Any) -> None:
        self._apply(trainer, step)



def inner_linear(m: nn.Module) -> nn.Module:
    """The plain linear layer inside any chain of linear wrappers (``.inner``)."""
    while hasattr(m, "inner"):
        m = m.inner
    return m


#: a block's projections by sublayer, as ``model.parts`` names them
SUBLAYER_ROLES: dict[str, tuple[str, ...]] = {"attention": ("q", "k", "v", "o"),
                                              "FFN": ("gate", "up", "down")}


def unreached_sublayer(model: nn.Module,
                       roles: tuple[str, ...]) -> tuple[int, str, list[str]] | None:
    """For a method that acts on the linear layers of ``roles`` (through the ``linear`` /
    ``tie`` / ``linear_wrappers`` slots): the first ``(block, sublayer, roles asked there)``
    where the sublayer has none of them made through the linear slot, because another
    method's core builds its projections itself (``moe``'s experts, TokenFormer's
    Pattention), so the method would silently not reach it; ``None`` when every sublayer it
    names has at least one (``relu2``'s FFN has no gate, and that is fine)."""
    parts = parts_of(model)
    for layer in range(model.cfg.n_layers):  # type: ignore[union-attr]
        for sublayer, group in SUBLAYER_ROLES.items():
            wanted = [r for r in roles if r in group]
            if wanted and not any(parts.has_linear(r, layer) for r in wanted):
                return layer, sublayer, wanted
    return None
