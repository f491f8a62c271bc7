"""The trainer's hook points, below every package that attaches to them (methods, evaluation,
diagnostics), so none of them imports the trainer.

The trainer calls each :class:`Callback` at these named points, in list order: first the
methods' own callbacks, then the trainer's standard ones (probe scoring, per-layer logging),
then the caller's, and last the experiment trackers (``train.trackers``, rank 0 only), which
send what the others added::

    on_train_start(run)               once, the model and optimizer ready (a resume loaded)
    on_batch(run, step, batch)        step's token batch (B, T), before the forward
    after_backward(run, step)         the step's gradients are in the parameters' ``.grad``
                                      (summed over micro-batches, reduced over processes,
                                      clipped), before the optimizer uses them; the weights
                                      are still those of the forward. Called for every
                                      member the step trained, also for a step whose loss
                                      or norm then turns out not to be finite
    after_optimizer_step(run, step)   after the optimizer changed the weights
    on_step_end(run, step, record)    step's metrics record before it is logged: keys a
                                      callback adds are logged with it
    on_eval(run, step, record)        a validation record before it is logged (add keys: the
                                      probe accuracies are added this way)
    on_train_end(run, summary)        the summary before summary.json is written (add keys)

``step`` is the 0-based optimizer step (the record's ``step`` counts steps done, step + 1).
``run`` is the trainer, seen through :class:`TrainingRun`.

In a multi-process run (torchrun, DDP or FSDP) every process calls every callback at the same
points, on its own copy of the model (under FSDP its parameters are DTensor shards, and a
forward gathers from every process, so a callback that runs the model must do so on every
process); only rank 0 writes the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from modbench.config import RunConfig


class TrainingRun(Protocol):
    """What a callback may read of the run in progress (it must not replace these)."""

    cfg: RunConfig  # the run's resolved config (recipe exceptions applied); read-only
    out: Path  # the run folder
    model: nn.Module  # the model being trained (not a compiled or distributed wrapper)
    optimizer: torch.optim.Optimizer
    device: torch.device
    data: Any  # the token data (modbench.runtime.data.open_data)
    step: int  # the current 0-based optimizer step


class Callback:
    """Hooks into the training loop; override what you need (see the module docstring)."""

    def on_train_start(self, run: TrainingRun) -> None: ...
    def on_batch(self, run: TrainingRun, step: int, batch: torch.Tensor) -> None: ...
    def after_backward(self, run: TrainingRun, step: int) -> None: ...
    def after_optimizer_step(self, run: TrainingRun, step: int) -> None: ...
    def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None: ...
    def on_eval(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None: ...
    def on_train_end(self, run: TrainingRun, summary: dict[str, Any]) -> None: ...
