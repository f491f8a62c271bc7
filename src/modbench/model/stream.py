"""The residual stream as an object, and the per-forward state a block maps to the next.

A block is a function of tensors: ``Block.forward(state) -> state``, ``state`` a
:class:`StreamState` (a small dataclass of tensors). The block never adds residuals itself. For
every sublayer it asks the stream for the input and hands the branch output back; the
stream's methods are pure functions of the state (they return a new state, never change the
one they are given)::

    state = stream.start(x0)                                   # once per forward
    x, state = stream.read(state, layer, "attn")               # the sublayer's input
    out = post_norm(core(pre_norm(x), ctx))
    state = stream.write(state, layer, "attn", x, out, merge, residual_norm)
    ...
    h = final_norm(stream.finish(state))                       # once per forward

A stream is an ``nn.Module`` built once per model by the ``stream`` slot's ``factory(cfg)``;
it may hold parameters per sublayer (index ``sublayer_index(layer, sublayer)``, 0 .. 2L - 1).
Implementations:

- :class:`AdditiveStream` (baseline): ``x' = residual_norm(merge(x, out))``; ``merge`` is the
  ``merge`` slot (``x + out``, LayerScale, DeepNorm's ``alpha x + out``, LAUREL, nGPT).
- DenseFormer (``methods/denseformer.py``): additive inside each block, then a depth-weighted
  average of the embedding and all earlier block outputs after the block's FFN write.
- Hyper-Connections (``methods/hyper_connections.py``): ``state.x`` holds n lanes
  ``(..., n, d)``; ``read`` mixes them into the sublayer input (width connection), ``write``
  re-mixes them and adds the output (depth connection); ``finish`` reduces the lanes.
- Attention Residuals (``methods/attnres.py``): the stream is the list of earlier outputs;
  ``read`` is a softmax over depth; ``write`` appends.

**What is kept across layers.** Nothing but the state: its current value ``x``, the
embedding ``v_0``, and what a method declares it needs from earlier layers, as explicit
tensors:

- a stream puts its own entries in ``state.kept`` (a dict from the method's keys to tensors
  or tuples of tensors) in ``start`` and replaces them in ``write`` (DenseFormer: the block
  outputs its averages read; AttnRes: its depth sources; the two-lane stream: its slow lane);
- a core keeps a tensor for later layers in ``ctx.shared`` (Value-Residual's ``V_1``): the
  block carries ``ctx.shared`` over to the next block in ``state.shared``;
- a merge that reads the inputs of earlier sublayers (LAUREL-PA) declares how many in its
  ``inputs_kept`` attribute; the model keeps that many (the largest over its merges) in
  ``state.inputs``, the oldest first.

Every sublayer's input, output and stream value after it are not kept. Diagnostics and
per-layer logging receive them as :class:`Record` s through :meth:`Stream.add_recorder`
(a hook the stream calls from ``write``; none is called while activation checkpointing
recomputes a block, see :func:`recomputing`).

Streams that replace the additive merge claim the ``merge`` slot with :func:`claim_merge`, so
a method that also fills it is refused by the slot rules, in either order.

Activation memory is measured by :func:`modbench.measure.memory.saved_activation_bytes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
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
    """What one sublayer saw and produced (handed to the recorders, never kept by the model)."""

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
    """The state one block maps to the next: tensors only (a pytree of a dataclass, dicts and
    tuples). Never changed in place: the stream's ``read`` / ``write`` return a new one
    (:meth:`replace`)."""

    x: torch.Tensor  # the current stream value (its layout is the stream's own)
    embedding: torch.Tensor  # the (normed) embedding output, v_0
    kept: dict[str, Any] = field(default_factory=dict)  # a stream's own kept tensors, by key
    shared: dict[str, torch.Tensor] = field(default_factory=dict)  # cores' (ctx.shared)
    inputs: tuple[torch.Tensor, ...] = ()  # the last `inputs_kept` sublayer inputs
    inputs_kept: int = 0
    aux: torch.Tensor | None = None  # the running sum of the auxiliary loss terms
    cos: torch.Tensor | None = None  # (T, d_h) RoPE tables for this sequence length
    sin: torch.Tensor | None = None

    def replace(self, **changes: Any) -> StreamState:
        """A copy with ``changes`` (the other fields shared, not copied)."""
        return dataclasses.replace(self, **changes)

    def keep(self, key: str, value: Any) -> StreamState:
        """A copy whose ``kept[key]`` is ``value`` (the dict is new; ``self`` is unchanged)."""
        return self.replace(kept={**self.kept, key: value})


@dataclass
class ForwardContext:
    """Everything a core may need besides its input. One per block call (the block makes it
    from its input state), so a recomputed block sees the context it first saw.

    ``shared``: tensors a core keeps for the later layers (Value-Residual's ``V_1``), carried
    from block to block in ``StreamState.shared``. ``aux``: the auxiliary loss terms this
    block's cores added (:meth:`add_aux`), e.g. a mixture-of-experts load-balancing loss;
    the block adds them, in order, to the state's running sum.
    ``Transformer.forward(idx, with_aux=True)`` returns that sum with the logits; the engines
    train on ``lm_loss + aux`` (both scaled alike over micro-batches) and report the LM loss
    alone."""

    cos: torch.Tensor  # (T, d_h) RoPE tables for this sequence length
    sin: torch.Tensor
    seq_len: int
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
        return add_terms(None, self.aux, self.cos.device)


def add_terms(total: torch.Tensor | None, terms: list[torch.Tensor],
              device: torch.device | None = None) -> torch.Tensor:
    """``total + terms[0] + terms[1] + ...`` in that order (``total`` None: start from the
    first term); a float32 zero on ``device`` when there is nothing to add."""
    for term in terms:
        total = term if total is None else total + term
    if total is None:
        return torch.zeros((), dtype=torch.float32, device=device)
    return total


class AddMerge(nn.Module):
    """The baseline residual merge: ``x' = x + out``."""

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        return x + out


def add_merge_factory(cfg: ModelConfig, layer: int, sublayer: str) -> nn.Module:
    return AddMerge()


# ------------------------------------------------------------------------- recorders

_RECOMPUTING = [0]  # depth of recomputations running (activation checkpointing)


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark a block's recomputation (activation checkpointing's backward): the streams call
    no recorder inside, so a record is seen once per forward."""
    _RECOMPUTING[0] += 1
    try:
        yield
    finally:
        _RECOMPUTING[0] -= 1


class _RecorderHandle:
    def __init__(self, recorders: list[Callable[[Record], None]],
                 fn: Callable[[Record], None]) -> None:
        self.recorders, self.fn = recorders, fn

    def remove(self) -> None:
        if self.fn in self.recorders:
            self.recorders.remove(self.fn)


class Stream(nn.Module):
    """The protocol the block calls (see the module docstring). Subclasses override all four
    methods; ``write`` calls :meth:`record` once per sublayer."""

    def __init__(self) -> None:
        super().__init__()
        self._recorders: list[Callable[[Record], None]] = []

    def add_recorder(self, fn: Callable[[Record], None]) -> _RecorderHandle:
        """Call ``fn(record)`` after every sublayer's write (a hook, like a module's forward
        hook: ``handle.remove()`` takes it away)."""
        self._recorders.append(fn)
        return _RecorderHandle(self._recorders, fn)

    def record(self, layer: int, sublayer: str, x: torch.Tensor, out: torch.Tensor,
               after: torch.Tensor) -> None:
        """Hand one sublayer's :class:`Record` to the recorders (none: nothing is built)."""
        if self._recorders and not _RECOMPUTING[0]:
            rec = Record(layer, sublayer, x, out, after)
            for fn in list(self._recorders):
                fn(rec)

    def start(self, x0: torch.Tensor) -> StreamState:
        raise NotImplementedError

    def read(self, state: StreamState, layer: int, sublayer: str
             ) -> tuple[torch.Tensor, StreamState]:
        """The sublayer's input, and the state to hand to :meth:`write` (the same one, or one
        with what the write needs from the read in ``kept``)."""
        raise NotImplementedError

    def write(
        self,
        state: StreamState,
        layer: int,
        sublayer: str,
        x: torch.Tensor,
        out: torch.Tensor,
        merge: nn.Module,
        residual_norm: nn.Module,
    ) -> StreamState:
        """The state after the sublayer whose input was ``x`` (what :meth:`read` returned)
        produced ``out``."""
        raise NotImplementedError

    def finish(self, state: StreamState) -> torch.Tensor:
        raise NotImplementedError


class AdditiveStream(Stream):
    """The standard residual stream: one lane, each sublayer merged into it in turn.

    A stream that keeps the additive merge and then changes the merged value (DenseFormer's
    depth average, 3PT's rotation) subclasses it and overrides :meth:`after_merge`."""

    def start(self, x0: torch.Tensor) -> StreamState:
        return StreamState(x=x0, embedding=x0)

    def read(self, state: StreamState, layer: int, sublayer: str
             ) -> tuple[torch.Tensor, StreamState]:
        return state.x, state

    def write(
        self,
        state: StreamState,
        layer: int,
        sublayer: str,
        x: torch.Tensor,
        out: torch.Tensor,
        merge: nn.Module,
        residual_norm: nn.Module,
    ) -> StreamState:
        merged = residual_norm(merge(x, out, state))
        state = self.after_merge(state, layer, sublayer, merged)
        self.record(layer, sublayer, x, out, state.x)
        return state

    def after_merge(self, state: StreamState, layer: int, sublayer: str,
                    x: torch.Tensor) -> StreamState:
        """The state after a sublayer's merge and post-residual norm ``x``: its ``x`` is the
        value recorded and read next (here ``x`` itself)."""
        return state.replace(x=x)

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
