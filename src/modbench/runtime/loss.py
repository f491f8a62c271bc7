"""The training objective and the held-out loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(logits: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor | None = None,
            count: int | None = None) -> torch.Tensor:
    """Next-token cross-entropy inside each packed row: predict ``idx[:, 1:]``.

    With ``mask`` (``(B, T-1)`` booleans over those predictions) only the ``True`` ones count:
    their summed loss divided by ``count`` (default: how many there are), so micro-batches of
    one batch can share the batch's denominator.
    """
    v = logits.shape[-1]
    flat = logits[:, :-1].reshape(-1, v).float()
    if mask is None:
        return F.cross_entropy(flat, idx[:, 1:].reshape(-1))
    target = idx[:, 1:].masked_fill(~mask, -100).reshape(-1)
    total = F.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
    return total / max(int(mask.sum()) if count is None else count, 1)


@torch.no_grad()
def validation_loss(model: nn.Module, data: Any, n_sequences: int, batch_size: int,
                    device: torch.device,
                    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> float:
    """Mean next-token loss over the fixed validation set (the first ``n_sequences`` rows of
    ``data.val_batches``), in evaluation mode; the model's mode is restored afterwards."""
    was_training = model.training
    model.eval()
    total, rows = 0.0, 0
    for batch in data.val_batches(n_sequences, batch_size):
        batch = batch.to(device)
        with autocast():
            loss = lm_loss(model(batch), batch)
        total += loss.item() * batch.shape[0]
        rows += batch.shape[0]
    model.train(was_training)
    return total / max(rows, 1)


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)`` (capped to stay finite), or ``None`` for a missing or non-finite loss."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(min(loss, 700.0))


def finite_or_none(x: float | None) -> float | None:
    """``x`` where it is a finite number, else ``None`` (JSON has no NaN)."""
    return x if x is not None and math.isfinite(x) else None
