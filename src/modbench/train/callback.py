"""The trainer's hook interface, in a module of its own so that methods (which the trainer
imports) can subclass it without an import cycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from modbench.train.trainer import Trainer


class Callback:
    """Hooks into the training loop; override what you need."""

    def on_train_start(self, trainer: Trainer) -> None: ...
    def on_batch(self, trainer: Trainer, step: int, batch: torch.Tensor) -> None: ...
    def after_optimizer_step(self, trainer: Trainer, step: int) -> None: ...
    def on_step_end(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None: ...
    def on_eval(self, trainer: Trainer, step: int, val_loss: float) -> None: ...
    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...
