"""Activation memory, measured by counting (not timing): ``benchmarks/stream_memory.py``
and the stream tests use it to compare residual-stream designs."""

from __future__ import annotations

import torch
from torch import nn

from modbench.runtime.loss import lm_loss


def saved_activation_bytes(model: nn.Module, idx: torch.Tensor) -> int:
    """Activation memory of one training forward: the bytes of every tensor autograd saves
    for the backward pass (the loss included), each storage counted once (by its data
    pointer), parameters and buffers excluded. Deterministic: it counts, it does not time."""
    skip = {t.untyped_storage().data_ptr() for t in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in skip and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
        return t

    was_training = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(model(idx), idx)
        del loss
    finally:
        model.train(was_training)
    return sum(seen.values())
