"""The LM head's loss without the full logits.

A training step of the papers' GPU runs scores 512 × 1024 tokens against a 65,664-token
vocabulary: the (B, T, V) logits alone are 69 GB in bf16 and their fp32 copy for the
cross-entropy 137 GB. :func:`cross_entropy_sum` never holds them: it projects the final hidden
states to logits a piece of the sequence at a time (at most :data:`LOGITS_CHUNK_BYTES` of fp32
logits a piece), takes that piece's cross-entropy, and keeps for the backward only the hidden
states, recomputing each piece's logits there (``torch.utils.checkpoint``). The cost is one
more forward of the head (2·d·V FLOPs a token, about 4 % of a climb-1.2b step); a batch that
fits in one piece (every CPU preset's) is computed exactly as an unchunked loss, with no
recomputation. The loss equals the unchunked one to float rounding (the pieces' sums are
added in order).

``Transformer.forward(idx, loss=True)`` returns this sum; the engines divide it by their
denominator (:mod:`modbench.runtime.loss`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: The target index ``F.cross_entropy`` skips (its default).
IGNORE = -100
#: The most fp32 logits one piece of the loss holds (bytes).
LOGITS_CHUNK_BYTES = 256 * 2**20


def next_token_targets(idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Position t's target is ``idx[:, t+1]``; the last position, which predicts nothing, and
    the predictions ``mask`` (``(B, T-1)`` booleans) leaves out get :data:`IGNORE`."""
    target = F.pad(idx[:, 1:], (0, 1), value=IGNORE)
    if mask is not None:
        target[:, :-1].masked_fill_(~mask, IGNORE)
    return target


def _piece(project: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
           target: torch.Tensor) -> torch.Tensor:
    logits = project(h)
    if logits.dtype != torch.float64:  # half-precision logits are scored in fp32
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def cross_entropy_sum(project: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                      target: torch.Tensor, vocab_size: int, *,
                      chunk_bytes: int = LOGITS_CHUNK_BYTES) -> torch.Tensor:
    """The summed next-token cross-entropy (0-d; fp32, or fp64 for an fp64 model) of hidden
    states ``h`` ``(B, T, d)`` against ``target`` ``(B, T)`` (:data:`IGNORE` skipped), with
    ``project`` mapping hidden states to logits. Pieces of rows and positions hold at most
    ``chunk_bytes`` of fp32 logits each; where there is more than one piece and gradients
    are on, each piece's logits are recomputed in the backward instead of kept."""
    b, t = target.shape
    per_piece = max(1, chunk_bytes // (4 * vocab_size))  # tokens
    if b * t <= per_piece:
        return _piece(project, h, target)
    rows = min(b, per_piece)
    cols = max(1, per_piece // rows)
    recompute = torch.is_grad_enabled() and h.requires_grad
    parts = []
    for r in range(0, b, rows):
        for c in range(0, t, cols):
            hp, tp = h[r:r + rows, c:c + cols], target[r:r + rows, c:c + cols]
            parts.append(checkpoint(_piece, project, hp, tp, use_reentrant=False,
                                    preserve_rng_state=False)
                         if recompute else _piece(project, hp, tp))
    total = parts[0]
    for part in parts[1:]:  # in order
        total = total + part
    return total
