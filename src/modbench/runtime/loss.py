"""The training objective and the held-out loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100  # the target index cross_entropy skips


def lm_loss(logits: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor | None = None,
            count: int | None = None) -> torch.Tensor:
    """Next-token cross-entropy inside each packed row: predict ``idx[:, 1:]``.

    With ``mask`` (``(B, T-1)`` booleans over those predictions) only the ``True`` ones count:
    their summed loss divided by ``count`` (default: how many there are), so micro-batches of
    one batch can share the batch's denominator.
    """
    # The targets are shifted rather than the logits sliced: position t predicts idx[:, t+1],
    # and the last position, which predicts nothing, gets the ignore index. Slicing
    # logits[:, :-1] would copy the whole (B, T, V) tensor forward and zero-fill it backward.
    v = logits.shape[-1]
    target = F.pad(idx[:, 1:], (0, 1), value=IGNORE)
    if mask is not None:
        target[:, :-1].masked_fill_(~mask, IGNORE)
    flat, target = logits.reshape(-1, v), target.reshape(-1)
    if flat.dtype != torch.float64:  # half-precision logits are scored in fp32
        flat = flat.float()
    if mask is None:
        return F.cross_entropy(flat, target, ignore_index=IGNORE)
    total = F.cross_entropy(flat, target, ignore_index=IGNORE, reduction="sum")
    return total / max(int(mask.sum()) if count is None else count, 1)


def micro_loss(forward: Callable[..., Any], micro: torch.Tensor,
               mask: torch.Tensor | None = None, count: int = 0, *,
               n_micro: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lm, aux)`` of one micro-batch of a step, through ``forward`` (a modbench model, or a
    function that calls one), which sums the next-token cross-entropy without holding the full
    logits (``forward(micro, with_aux=True, loss=True, mask=mask)``).

    ``lm`` is the micro-batch's share of the batch's mean loss: its mean over its predictions
    divided by ``n_micro``, or with ``mask`` the kept predictions' sum divided by ``count``
    (the whole batch's number of kept predictions), as :func:`lm_loss` computes them from
    logits; ``aux`` the auxiliary loss terms the cores added (0 when none did)."""
    total, aux = forward(micro, with_aux=True, loss=True, mask=mask)
    if mask is None:
        return total / (micro.shape[0] * (micro.shape[1] - 1)) / n_micro, aux
    return total / max(count, 1), aux


@torch.no_grad()
def validation_loss(model: nn.Module, data: Any, n_sequences: int, batch_size: int,
                    device: torch.device,
                    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> float:
    """Mean next-token loss over the fixed validation set (the first ``n_sequences`` rows of
    ``data.val_batches``, ``batch_size`` rows a forward), in evaluation mode; the model's mode
    is restored afterwards. The model sums the loss itself (``model(batch, loss=True)``), so
    the full logits of a batch never exist."""
    was_training = model.training
    model.eval()
    total: torch.Tensor | float = 0.0
    rows = 0
    for batch in data.val_batches(n_sequences, batch_size):
        batch = batch.to(device)
        with autocast():
            loss = model(batch, loss=True) / (batch.shape[1] - 1)  # summed over its rows
        total = total + loss.detach().double()  # as float() would sum: one read-back below
        rows += batch.shape[0]
    model.train(was_training)
    return float(total) / max(rows, 1)


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)`` (capped to stay finite), or ``None`` for a missing or non-finite loss."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(min(loss, 700.0))


def finite_or_none(x: float | None) -> float | None:
    """``x`` where it is a finite number, else ``None`` (JSON has no NaN)."""
    return x if x is not None and math.isfinite(x) else None
