"""Mixing synthetic probe rows into the training stream (``data.probe_mix``).

Tiny models only learn associative recall if they see it. With ``data.probe_mix = f``, each
training batch of B rows has ``round(f * B)`` rows replaced by mqar / induction rows
(``modbench.data.synthetic``, RNG stream ``train``). Which rows, and their content, depend on
(data seed, step) only, so every method and every init seed still sees the same i-th batch.
Validation rows are never touched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from modbench.data.synthetic import training_probe_row
from modbench.errors import ModbenchError


class ProbeMixDataset:
    """A token dataset whose training batches carry a fixed fraction of probe rows."""

    def __init__(self, base: Any, fraction: float) -> None:
        if not 0.0 <= fraction < 1.0:
            raise ModbenchError(f"data.probe_mix must be in [0, 1), got {fraction}")
        self.base = base
        self.fraction = fraction

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def probe_rows(self, step: int, batch_size: int, data_seed: int) -> np.ndarray:
        """Indices of the rows of batch ``step`` that hold probes."""
        k = round(self.fraction * batch_size)
        rng = np.random.default_rng([data_seed, step, 0x9B0BE])
        return np.sort(rng.choice(batch_size, size=k, replace=False)) if k else np.zeros(0, int)

    def train_batch(self, step: int, batch_size: int, data_seed: int) -> torch.Tensor:
        batch = self.base.train_batch(step, batch_size, data_seed)
        for r in self.probe_rows(step, batch_size, data_seed):
            row = training_probe_row(data_seed, step, int(r), self.base.vocab_size,
                                     self.base.seq_len)
            batch[int(r)] = torch.from_numpy(row)
        return batch
