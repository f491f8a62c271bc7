"""Mixing synthetic probe rows into the training stream (``data.probe_mix``).

Tiny models only learn associative recall if they see it. With ``data.probe_mix = f``, each
training batch of B rows has ``round(f * B)`` rows replaced by mqar / induction rows
(``modbench.data.synthetic``, RNG stream ``train``). Which rows, and their content, depend on
(data seed, step) only, so every method and every init seed still sees the same i-th batch.
Validation rows are never touched.

``data.probe_loss`` says which next-token predictions of a probe row enter the training loss:
``all`` (every position, like text) or ``answers`` (only the scored ones: an mqar value after
its queried key, the copied tokens of an induction repeat), as Zoology trains MQAR. The random
keys, values and first halves are unpredictable by construction; with ``answers`` their
irreducible loss and its gradient noise leave the objective. Text rows always count in full.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from modbench.config import check_probe_loss
from modbench.data.synthetic import training_probe_episode
from modbench.errors import ModbenchError


class ProbeMixDataset:
    """A token dataset whose training batches carry a fixed fraction of probe rows."""

    def __init__(self, base: Any, fraction: float, loss: str = "all") -> None:
        if not 0.0 <= fraction < 1.0:
            raise ModbenchError(f"data.probe_mix must be in [0, 1), got {fraction}")
        check_probe_loss(loss)
        self.base = base
        self.fraction = fraction
        self.loss = loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def probe_rows(self, step: int, batch_size: int, data_seed: int) -> np.ndarray:
        """Indices of the rows of batch ``step`` that hold probes."""
        k = round(self.fraction * batch_size)
        rng = np.random.default_rng([data_seed, step, 0x9B0BE])
        return np.sort(rng.choice(batch_size, size=k, replace=False)) if k else np.zeros(0, int)

    def train_batch(self, step: int, batch_size: int, data_seed: int) -> torch.Tensor:
        return self.train_batch_and_mask(step, batch_size, data_seed)[0]

    def train_batch_and_mask(self, step: int, batch_size: int,
                             data_seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Batch ``step`` and, with ``probe_loss=answers``, a ``(B, T-1)`` boolean mask of the
        predictions (of ``batch[:, 1:]``) that enter the loss; ``None`` means all of them."""
        batch = self.base.train_batch(step, batch_size, data_seed)
        mask = None
        if self.loss == "answers":
            mask = torch.ones(batch.shape[0], batch.shape[1] - 1, dtype=torch.bool)
        for r in self.probe_rows(step, batch_size, data_seed):
            row, scored = training_probe_episode(data_seed, step, int(r), self.base.vocab_size,
                                                 self.base.seq_len)
            batch[int(r)] = torch.from_numpy(row)
            if mask is not None:
                mask[int(r)] = False
                mask[int(r), scored] = True
        return batch, mask
