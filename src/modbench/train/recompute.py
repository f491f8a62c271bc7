"""Activation checkpointing (``train.activation_checkpointing``): the decoder blocks keep no
activations for the backward; the backward recomputes them by running the block again
(``torch.utils.checkpoint``, non-reentrant).

A block is a function of tensors (``Block.forward(state) -> state``, see
``model/stream.py``): it changes nothing outside the state it returns, so the checkpointed
block keeps only its input state (the stream value, and the tensors a method keeps from
earlier layers, which are the earlier blocks' anyway) and the recomputation runs it on that
same input: the same operations, the same saved tensors (torch checks their shapes and
dtypes). The forward's numbers are unchanged; the backward's equal the plain backward's. The
stream's recorders (diagnostics, per-layer logging) are not called while a block is
recomputed (:func:`modbench.model.stream.recomputing`), so they see each sublayer once.

Modes (:func:`parse_mode`, the config key's values):

- ``false``: off;
- ``true`` / ``"full"``: every block recomputes everything;
- ``"every:k"``: every k-th block (blocks 0, k, 2k, ...) recomputes everything, the others
  keep their activations (torchtitan's selective "every k-th layer");
- ``"attn"``: every block keeps the output of its attention kernel (the fused
  scaled-dot-product attention op and its statistics) and recomputes the rest, so the
  backward does not run attention twice (selective checkpointing,
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``). An explicit attention
  kernel (softpick, sigmoid, soft-cap, ...) has no such op and is recomputed whole.

A forward that updates buffers (PowerNorm's and PRepBN's running statistics) would update
them a second time when recomputed, so such models are refused. The patch is an instance
attribute (``block.forward``): parameter names and state-dict keys are unchanged, and FSDP
may shard the block afterwards (its hooks run around the checkpointed forward).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from modbench.errors import ModbenchError
from modbench.model.stream import recomputing

MODES = ("full", "attn", "every:k")
_EVERY = re.compile(r"every:([1-9][0-9]*)")

# the fused attention ops whose outputs the "attn" mode keeps (CPU, CUDA flash, efficient,
# cuDNN); the math fallback is made of ordinary ops and is recomputed
_ATTENTION_OPS = tuple(
    op for name in ("_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention")
    if (op := getattr(torch.ops.aten, name, None)) is not None)


def parse_mode(value: bool | str) -> tuple[str, int] | None:
    """``train.activation_checkpointing`` as ``(mode, k)``: None when off, ``("full", 1)``,
    ``("attn", 1)`` or ``("every", k)``. Raises :class:`ModbenchError` for anything else."""
    if value is False:
        return None
    if value is True or value == "full":
        return ("full", 1)
    if value == "attn":
        return ("attn", 1)
    m = _EVERY.fullmatch(value) if isinstance(value, str) else None
    if m is not None and int(m.group(1)) >= 1:
        return ("every", int(m.group(1)))
    raise ModbenchError(f"train.activation_checkpointing must be false, true (= full), full, "
                        f"attn or every:K with K >= 1 (e.g. every:2), got {value!r}")


def stateful_buffers(model: nn.Module) -> list[str]:
    """Names of the model's persistent buffers: state the forward (or backward) may update,
    such as running statistics (RoPE tables are non-persistent constants)."""
    # every name of every parameter: a weight shared by two layers (the tie slot) is in the
    # state dict under both, and is no buffer
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict() if name not in params]


def apply_activation_checkpointing(model: nn.Module, method: str,
                                   mode: bool | str = True) -> list[int]:
    """Make the decoder blocks of ``model`` recompute their activations in the backward, as
    ``mode`` says (a value of ``train.activation_checkpointing``); returns the indices of the
    blocks checkpointed."""
    parsed = parse_mode(mode)
    if parsed is None:
        return []
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
    kind, k = parsed
    chosen = [i for i in range(len(blocks)) if i % k == 0]
    for i in chosen:
        blocks[i].forward = _checkpointed(blocks[i].forward, selective=kind == "attn")
    return chosen


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)  # the policy sees overloads (.default)
    return (CheckpointPolicy.MUST_SAVE if packet in _ATTENTION_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _contexts(selective: bool) -> Callable[[], tuple[Any, Any]]:
    """The forward's and the recomputation's context managers: the recomputation calls no
    stream recorder; ``selective`` adds the policy that keeps the attention ops' outputs."""
    def make() -> tuple[Any, Any]:
        if not selective:
            return contextlib.nullcontext(), recomputing()
        fwd, rec = create_selective_checkpoint_contexts(_keep_attention)
        return fwd, _both(rec)
    return make


@contextlib.contextmanager
def _both(rec: Any) -> Iterator[None]:
    with rec, recomputing():
        yield


def _checkpointed(forward: Callable[[Any], Any], selective: bool) -> Callable[[Any], Any]:
    contexts = _contexts(selective)

    def run(state: Any) -> Any:
        return checkpoint(forward, state, use_reentrant=False, context_fn=contexts)

    return run
