"""Activation checkpointing (``train.activation_checkpointing``): each decoder block keeps
no activations for the backward; the backward recomputes them by running the block again
(``torch.utils.checkpoint``, non-reentrant).

The shared decoder's block returns nothing: it reads and writes the residual stream's
:class:`~modbench.model.stream.StreamState` and the forward's
:class:`~modbench.model.stream.ForwardContext` in place (the stream's value, the history of
every sublayer, the stream's and the cores' scratch such as Value-Residual's V_1). A plain
``checkpoint(block, ...)`` would therefore recompute from the state as the *whole* forward
left it, not as the block found it. So the checkpointed block takes a copy of that state
when it is entered (the containers are copied, the tensors are shared) and the
recomputation runs on a fresh copy of it: the same inputs, the same operations, the same
saved tensors (torch checks their shapes and dtypes). The forward's numbers are unchanged;
the backward's equal the plain backward's.

A forward that updates buffers (PowerNorm's and PRepBN's running statistics) would update
them a second time when recomputed, so such models are refused. The patch is an instance
attribute (``block.forward``): parameter names and state-dict keys are unchanged, and FSDP
may shard the block afterwards (its hooks run around the checkpointed forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from modbench.errors import ModbenchError


def stateful_buffers(model: nn.Module) -> list[str]:
    """Names of the model's persistent buffers: state the forward (or backward) may update,
    such as running statistics (RoPE tables are non-persistent constants)."""
    params = {name for name, _ in model.named_parameters()}
    return [name for name in model.state_dict() if name not in params]


def apply_activation_checkpointing(model: nn.Module, method: str) -> None:
    """Make every decoder block of ``model`` recompute its activations in the backward."""
    stateful = stateful_buffers(model)
    if stateful:
        raise ModbenchError(
            f"train.activation_checkpointing cannot be used with method '{method}': its "
            f"forward updates buffers ({stateful[0]}), which a recomputed forward would update "
            "twice; set train.activation_checkpointing=false"
        )
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ModbenchError("train.activation_checkpointing needs a modbench decoder (a model "
                            "with .blocks); set train.activation_checkpointing=false")
    for block in blocks:
        block.forward = _checkpointed(block.forward)


def _checkpointed(forward: Callable[..., None]) -> Callable[..., None]:
    def run(stream: nn.Module, ctx: Any) -> None:
        entered = _copy_tree(ctx)  # the state as this block finds it
        calls = 0

        def block() -> None:
            nonlocal calls
            calls += 1
            # the first call is the forward (it writes the real state); later ones are the
            # backward's recomputation, on a fresh copy of the state as it was on entry
            forward(stream, ctx if calls == 1 else _copy_tree(entered))

        checkpoint(block, use_reentrant=False)

    return run


def _copy_tree(obj: Any) -> Any:
    """A copy of the containers (dataclass instances, dicts, lists, tuples) in ``obj``;
    tensors and other objects are shared."""
    if isinstance(obj, dict):
        return {k: _copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_tree(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy_tree(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _copy_tree(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj
