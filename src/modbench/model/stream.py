"""The residual stream as an object, and the per-forward context.

The block never adds residuals itself. For every sublayer it asks the stream for the input
and hands the branch output back::

    state = stream.start(x0)                                   # once per forward
    x = stream.read(state, layer, "attn")                      # the sublayer's input
    out = post_norm(core(pre_norm(x)))
    stream.write(state, layer, "attn", out, merge, residual_norm)
    ...
    h = final_norm(stream.finish(state))                       # once per forward

A stream is an ``nn.Module`` built once per model by the ``stream`` slot's ``factory(cfg)``;
it may hold parameters per sublayer (index ``sublayer_index(layer, sublayer)``, 0 .. 2L - 1).
``state`` (a :class:`StreamState`, one per forward pass) records every sublayer's input, output
and the stream value after its write, so a stream, a merge or a core can look at any earlier
sublayer. Implementations:

- :class:`AdditiveStream` (baseline): ``x' = residual_norm(merge(x, out))``; ``merge`` is the
  ``merge`` slot (``x + out``, LayerScale, DeepNorm's ``alpha x + out``, LAUREL, nGPT).
- DenseFormer (``methods/denseformer.py``): additive inside each block, then a depth-weighted
  average of the embedding and all earlier block outputs after the block's FFN write.
- Hyper-Connections (``methods/hyper_connections.py``): ``state.x`` holds n lanes
  ``(..., n, d)``; ``read`` mixes them into the sublayer input (width connection), ``write``
  re-mixes them and adds the output (depth connection); ``finish`` reduces the lanes.
- Attention Residuals (``methods/attnres.py``): the stream is the list of earlier outputs;
  ``read`` is a softmax over depth; ``write`` appends.

Streams that replace the additive merge claim the ``merge`` slot with :func:`claim_merge`, so
a method that also fills it is refused by the slot rules, in either order.

Activation memory is measured by :func:`modbench.analysis.memory.saved_activation_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.model.spec import ModelSpec

SUBLAYER_ORDER = ("attn", "ffn")


def sublayer_index(layer: int, sublayer: str) -> int:
    """0-based position of a sublayer in the stream: block ``l``'s attention is ``2l``, its
    FFN ``2l + 1``."""
    return 2 * layer + SUBLAYER_ORDER.index(sublayer)


@dataclass
class Record:
    """What one sublayer saw and produced."""

    layer: int
    sublayer: str  # "attn" | "ffn"
    input: torch.Tensor  # what read() returned
    output: torch.Tensor  # the branch output handed to write()
    # the stream value after the write: one lane (..., d) for the additive stream and
    # DenseFormer (after the depth average, where one ran), the lanes (..., n, d) for
    # Hyper-Connections, the newest depth source for Attention Residuals
    after: torch.Tensor

    @property
    def index(self) -> int:
        return sublayer_index(self.layer, self.sublayer)


@dataclass
class StreamState:
    """Per-forward state of the residual stream."""

    x: torch.Tensor  # the current stream value (its layout is the stream's own)
    embedding: torch.Tensor  # the (normed) embedding output, v_0
    history: list[Record] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # scratch for stream implementations


@dataclass
class ForwardContext:
    """Everything a core may need besides its input, shared by all layers of one forward.

    ``aux``: the auxiliary loss terms of this forward (:meth:`add_aux`), e.g. a
    mixture-of-experts load-balancing loss. ``Transformer.forward(idx, with_aux=True)``
    returns their sum with the logits; the engines train on ``lm_loss + aux`` (both scaled
    alike over micro-batches) and report the LM loss alone."""

    cos: torch.Tensor  # (T, d_h) RoPE tables for this sequence length
    sin: torch.Tensor
    seq_len: int
    stream: StreamState | None = None
    shared: dict[str, Any] = field(default_factory=dict)  # cross-layer scratch (e.g. V_1)
    aux: list[torch.Tensor] = field(default_factory=list)  # auxiliary loss terms, 0-d

    def add_aux(self, term: torch.Tensor) -> None:
        """Add a scalar (0-d) term to this forward's training objective. It is added as
        given: a core applies its own coefficient. A core reused by several layers adds
        one term per call."""
        if term.ndim != 0:
            raise ValueError(f"an auxiliary loss term must be a 0-d tensor, got shape "
                             f"{tuple(term.shape)}; reduce it (sum or mean) first")
        self.aux.append(term)

    def aux_total(self) -> torch.Tensor:
        """The sum of the terms added (in the order added), or a float32 zero on the RoPE
        tables' device when none was: adding it to a loss changes no bit of the loss or of
        its gradient."""
        if not self.aux:
            return torch.zeros((), dtype=torch.float32, device=self.cos.device)
        total = self.aux[0]
        for term in self.aux[1:]:
            total = total + term
        return total


class AddMerge(nn.Module):
    """The baseline residual merge: ``x' = x + out``."""

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        return x + out


def add_merge_factory(cfg: ModelConfig, layer: int, sublayer: str) -> nn.Module:
    return AddMerge()


class Stream(nn.Module):
    """The protocol the block calls (see the module docstring). Subclasses override all four
    methods; ``write`` must append one :class:`Record` to ``state.history``."""

    def start(self, x0: torch.Tensor) -> StreamState:
        raise NotImplementedError

    def read(self, state: StreamState, layer: int, sublayer: str) -> torch.Tensor:
        raise NotImplementedError

    def write(
        self,
        state: StreamState,
        layer: int,
        sublayer: str,
        out: torch.Tensor,
        merge: nn.Module,
        residual_norm: nn.Module,
    ) -> None:
        raise NotImplementedError

    def finish(self, state: StreamState) -> torch.Tensor:
        raise NotImplementedError


class AdditiveStream(Stream):
    """The standard residual stream: one lane, each sublayer merged into it in turn.

    A stream that keeps the additive merge and then changes the merged value (DenseFormer's
    depth average, 3PT's rotation) subclasses it and overrides :meth:`after_merge`."""

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
        state.x = self.after_merge(state, layer, sublayer, residual_norm(merge(x, out, state)))
        state.history.append(Record(layer, sublayer, x, out, state.x))

    def after_merge(self, state: StreamState, layer: int, sublayer: str,
                    x: torch.Tensor) -> torch.Tensor:
        """The stream value after a sublayer's merge and post-residual norm ``x``, as it is
        recorded and read next (the identity here)."""
        return x

    def finish(self, state: StreamState) -> torch.Tensor:
        return state.x


def additive_stream_factory(cfg: ModelConfig) -> nn.Module:
    return AdditiveStream()


# ----------------------------------------------------------- helpers for stream methods


class StreamMerge(nn.Module):
    """What sits in the ``merge`` slot when a stream replaces the additive merge itself
    (Hyper-Connections, Attention Residuals). The stream never calls it."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        raise ModbenchError(f"the '{self.owner}' stream merges sublayer outputs itself; "
                            "its merge slot is not meant to be called")

    def extra_repr(self) -> str:
        return f"merged by the {self.owner} stream"


def claim_merge(spec: ModelSpec, by: str) -> None:
    """Fill the ``merge`` slot for a stream that replaces the additive merge, so that any
    method filling it too (LayerScale, DeepNorm, LAUREL, nGPT) is refused, in either order."""

    def factory(cfg: ModelConfig, layer: int, sublayer: str) -> nn.Module:
        return StreamMerge(by)

    spec.fill("merge", factory, by=by, key=("stream-owned merge", by))


def is_identity(m: nn.Module) -> bool:
    return isinstance(m, nn.Identity)


@contextmanager
def stream_precision(x: torch.Tensor) -> Iterator[None]:
    """Run the stream's own mixing in the stream's dtype: under bf16 autocast a matmul would
    otherwise round the (float32) residual stream to bf16."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        yield
