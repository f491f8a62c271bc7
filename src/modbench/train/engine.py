"""The training loop's only view of the weights: an engine holds the model and its optimizer
and does the numerical part of a step (forward and backward over micro-batches, clipping,
the update) and of validation.

The loop (:class:`modbench.train.trainer.Trainer`) owns everything else: the schedule, the
batches, logging, checkpoints, divergence and callbacks. So a K-seed ensemble (stacked weights,
one loss per member) or a multi-process run (DDP/FSDP wrapping the model, all-reduced losses)
is another engine, driven by the same loop. :class:`ModelEngine` is the one-model,
one-device engine.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from modbench.runtime.loss import lm_loss, validation_loss


class Engine(Protocol):
    model: nn.Module  # the weights, unwrapped (what callbacks, probes and checkpoints see)
    optimizer: torch.optim.Optimizer

    def set_lr(self, lr: float) -> None: ...
    def backward(self, batch: torch.Tensor, mask: torch.Tensor | None) -> float: ...
    def clip_grad_norm(self, max_norm: float) -> float: ...
    def update(self) -> None: ...
    def discard(self) -> None: ...
    def synchronize(self) -> None: ...
    def validation_loss(self, data: Any, n_sequences: int, batch_size: int) -> float: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelEngine:
    """One model and its optimizer on one device.

    ``n_micro`` micro-batches per step (gradient accumulation); ``compile`` runs the forward
    through ``torch.compile`` while :attr:`model` stays the plain module.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 autocast: Callable[[], AbstractContextManager[Any]], *, n_micro: int = 1,
                 compile: bool = False) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.autocast, self.n_micro = autocast, n_micro
        self.forward: Callable[[torch.Tensor], torch.Tensor] = (
            torch.compile(model) if compile else model)  # type: ignore[assignment]

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, batch: torch.Tensor, mask: torch.Tensor | None) -> float:
        """Accumulate the gradient of the batch's mean loss over its micro-batches; return that
        loss. With ``mask`` (``data.probe_loss=answers``) only the kept predictions count, all
        micro-batches sharing the batch's denominator."""
        micros = batch.to(self.device).chunk(self.n_micro)
        count = int(mask.sum()) if mask is not None else 0
        masks = (mask.to(self.device).chunk(self.n_micro) if mask is not None
                 else (None,) * len(micros))
        total = 0.0
        for micro, m in zip(micros, masks, strict=True):
            with self.autocast():
                logits = self.forward(micro)
                loss = (lm_loss(logits, micro) / self.n_micro if m is None
                        else lm_loss(logits, micro, m, count))
            loss.backward()
            total += loss.item()
        return total

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm before clipping (``max_norm <= 0``: no clipping)."""
        clip = max_norm if max_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard(self) -> None:
        """Drop the step's gradients without applying them (a non-finite step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        """Wait for queued device work (honest step times on CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def validation_loss(self, data: Any, n_sequences: int, batch_size: int) -> float:
        return validation_loss(self.model, data, n_sequences, batch_size, self.device,
                               self.autocast)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
