"""The residual stream as an object, and the per-forward context.

Each sublayer reads its input from the stream and writes its output back::

    x = stream.read(state, layer, "attn")
    stream.write(state, layer, "attn", out, merge, residual_norm)

``state`` (a :class:`StreamState`, one per forward pass) records every sublayer's input,
output and the stream value after the merge, so a stream implementation, a merge or a core
can look at any earlier sublayer. The default :class:`AdditiveStream` is the plain
``x + out`` residual; LayerScale, DeepNorm's ``alpha x + out`` and LAUREL are *merges*
(per-sublayer modules), while DenseFormer, Hyper-Connections, Attention Residuals and
nGPT replace the stream (or the merge) through the ``stream``/``merge`` slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Record:
    """What one sublayer saw and produced."""

    layer: int
    sublayer: str  # "attn" | "ffn"
    input: torch.Tensor  # what read() returned
    output: torch.Tensor  # the branch output handed to write()
    after: torch.Tensor  # the stream value after merge and residual norm


@dataclass
class StreamState:
    """Per-forward state of the residual stream."""

    x: torch.Tensor  # the current stream value
    embedding: torch.Tensor  # the (normed) embedding output, v_0
    history: list[Record] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # scratch for stream implementations


@dataclass
class ForwardContext:
    """Everything a core may need besides its input, shared by all layers of one forward."""

    cos: torch.Tensor  # (T, d_h) RoPE tables for this sequence length
    sin: torch.Tensor
    seq_len: int
    stream: StreamState | None = None
    shared: dict[str, Any] = field(default_factory=dict)  # cross-layer scratch (e.g. V_1)


class AddMerge(nn.Module):
    """The baseline residual merge: ``x' = x + out``."""

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        return x + out


def add_merge_factory(cfg: Any, layer: int, sublayer: str) -> nn.Module:
    return AddMerge()


class AdditiveStream(nn.Module):
    """The standard residual stream: one lane, each sublayer merged into it in turn."""

    def start(self, x0: torch.Tensor) -> StreamState:
        return StreamState(x=x0, embedding=x0)

    def read(self, state: StreamState, layer: int, sublayer: str) -> torch.Tensor:
        return state.x

    def write(
        self,
        state: StreamState,
        layer: int,
        sublayer: str,
        out: torch.Tensor,
        merge: nn.Module,
        residual_norm: nn.Module,
    ) -> None:
        x = state.x
        state.x = residual_norm(merge(x, out, state))
        state.history.append(Record(layer, sublayer, x, out, state.x))

    def finish(self, state: StreamState) -> torch.Tensor:
        return state.x


def additive_stream_factory(cfg: Any) -> nn.Module:
    return AdditiveStream()
