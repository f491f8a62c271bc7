"""DenseFormer: a depth-weighted average (DWA) of all earlier block outputs after each block.

Equation (docs/sources.md#denseformer, arXiv 2605.20798 Appendix B.9), blocks i = 0 .. L-1
(0-based)::

    X_0     = the embedding (after the embedding norm site)
    X_{i+1} = Block_i(x_i)                     the block's output (standard residual inside)
    x_{i+1} = sum_{j in S_i} alpha_{i,j} X_j   if (i + 1) % p == 0   (a DWA after block i)
            = X_{i+1}                          otherwise
    S_i     = { j <= i + 1 : j = i + 1 (mod k) }   (dilation k: every k-th earlier output)

then the final norm and head on x_L. With k = p = 1 every block averages over all of
X_0 .. X_{i+1}.

Citation: Pagliardini, Mohtashami, Fleuret, Jaggi 2024, "DenseFormer: Enhancing Information
Flow in Transformers via Depth Weighted Averaging" (arXiv 2402.02622); code
epfml/DenseFormer ``denseformer/denseformer.py`` (``DWAModules``: the dilation groups, the
period test ``(i + 1) % p == 0`` and the weight counts are taken from it).

Init: identity, alpha_{i,i+1} = 1 and all other alpha_{i,j} = 0, so at initialisation the
model is exactly the baseline. The weights are plain parameters restored by
``modbench_init()``, so the generic N(0, 0.02^2) pass never touches them (the pitfall of the
reference code, whose DWA weights are ``nn.Linear`` layers).

Parameters: |S_i| = floor((i + 1) / k) + 1 weights for each block i with (i + 1) % p == 0::

    P(L, k, p) = sum_{m = 1}^{floor(L / p)} ( floor(m p / k) + 1 ),    P(L, 1, 1) = L (L + 3) / 2

FLOPs: each DWA is one (1 x |S_i|) by (|S_i| x d) matrix product per token, counted as
2 d |S_i|; in total 2 d P(L, k, p) per token (forward). B.9 calls this "no change": it is
negligible (0.05% at 1.2B).

Options: ``dilation`` k (default 1), ``period`` p (default 1); each must lie in 1 .. L
(beyond L a DWA would average one term, or none would run).

Choices of our own: a "block" is one decoder layer (attention and FFN sublayers); the DWA
runs after the FFN sublayer's write, on the value after its merge and post-residual norm;
the merge and residual-norm slots apply inside the block as in the baseline, so DenseFormer
composes with every merge (LayerScale, LAUREL, DeepNorm) and placement (Post-LN). The
weighted sum is an autograd function that saves references to the block outputs (which
exist anyway) instead of a stacked copy per DWA: activation memory grows by one d-vector
per token and block, not quadratically (the reference code's in-place accumulator serves
the same purpose). DWA weights are 1-D tensors, so the recipe's matrix-only weight decay
leaves them alone. Slot: ``stream``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec
from modbench.model.stream import AdditiveStream, StreamState, stream_precision

KEY = "denseformer.outputs"


def dwa_sources(i: int, dilation: int) -> list[int]:
    """Indices j of X_j averaged after block i (0-based): j <= i + 1, j = i + 1 mod k."""
    return list(range((i + 1) % dilation, i + 2, dilation))


def dwa_blocks(n_layers: int, period: int) -> list[int]:
    """Blocks i after which a DWA runs."""
    return [i for i in range(n_layers) if (i + 1) % period == 0]


def dwa_param_count(n_layers: int, dilation: int, period: int) -> int:
    return sum(len(dwa_sources(i, dilation)) for i in dwa_blocks(n_layers, period))


class _WeightedSum(torch.autograd.Function):
    """``sum_j w_j x_j`` that saves the inputs by reference (no stacked copy kept)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, *xs)
        stacked = torch.stack(xs)  # temporary: freed when forward returns
        return torch.tensordot(w.to(stacked.dtype), stacked, dims=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w, *xs = ctx.saved_tensors
        gw = None
        if ctx.needs_input_grad[0]:
            gw = torch.stack([(grad * x).sum() for x in xs]).to(w.dtype)
        gxs = [grad * w[j].to(grad.dtype) if ctx.needs_input_grad[1 + j] else None
               for j in range(len(xs))]
        return (gw, *gxs)


def weighted_sum(w: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
    return _WeightedSum.apply(w, *xs)


class DenseFormerStream(AdditiveStream):
    """Additive stream with a DWA after every p-th block."""

    def __init__(self, dim: int, n_layers: int, dilation: int, period: int) -> None:
        super().__init__()
        self.dim, self.n_layers, self.dilation, self.period = dim, n_layers, dilation, period
        self.blocks = dwa_blocks(n_layers, period)
        self.alphas = nn.ParameterList(
            nn.Parameter(self._identity(len(dwa_sources(i, dilation)))) for i in self.blocks)
        self.slot = {i: n for n, i in enumerate(self.blocks)}
        # X_j a DWA after block i or later reads: the state keeps only these
        self.read_later = [{j for b in self.blocks if b >= i for j in dwa_sources(b, dilation)}
                           for i in range(n_layers + 1)]

    @staticmethod
    def _identity(m: int) -> torch.Tensor:
        w = torch.zeros(m)
        w[-1] = 1.0
        return w

    @torch.no_grad()
    def modbench_init(self) -> None:
        for a in self.alphas:
            a.copy_(self._identity(a.numel()))

    def start(self, x0: torch.Tensor) -> StreamState:
        # kept: X_0 .. X_l, those a later average reads (the others are None)
        return StreamState(x=x0, embedding=x0, kept={KEY: (x0,)})

    def after_merge(self, state: StreamState, layer: int, sublayer: str,
                    x: torch.Tensor) -> StreamState:
        if sublayer != "ffn":
            return state.replace(x=x)
        outputs: tuple[Any, ...] = (*state.kept[KEY], x)  # X_{layer + 1}
        if layer in self.slot:
            xs = [outputs[j] for j in dwa_sources(layer, self.dilation)]
            with stream_precision(x):
                x = weighted_sum(self.alphas[self.slot[layer]], xs)
        later = self.read_later[layer + 1]
        outputs = tuple(o if j in later else None for j, o in enumerate(outputs))
        return state.replace(x=x, kept={**state.kept, KEY: outputs})

    def extra_repr(self) -> str:
        return f"n_layers={self.n_layers}, dilation={self.dilation}, period={self.period}"


def _check(cfg: ModelConfig, dilation: int, period: int) -> None:
    for key, v in (("dilation", dilation), ("period", period)):
        if not 1 <= v <= cfg.n_layers:
            raise ModbenchError(
                f"option {key}={v} of method 'denseformer' must lie in 1..n_layers "
                f"({cfg.n_layers}); 1 averages over every block"
            )


@register
class DenseFormer(Method):
    name = "denseformer"
    category = "residual"
    stackable = False
    stack_note = "its depth-weighted average is an autograd.Function without a vmap rule"
    citation = ("Pagliardini, Mohtashami, Fleuret, Jaggi 2024, DenseFormer: Enhancing "
                "Information Flow in Transformers via Depth Weighted Averaging")
    summary = ("Depth-weighted average of the embedding and all earlier block outputs after "
               "each block; identity init.")
    starts_as_baseline = True

    @dataclass
    class Options:
        dilation: int = 1  # k: average every k-th earlier output
        period: int = 1  # p: a DWA after every p-th block

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        k, p = self.opts.dilation, self.opts.period
        _check(cfg, k, p)

        def factory(c: ModelConfig) -> nn.Module:
            return DenseFormerStream(c.d_model, c.n_layers, k, p)

        spec.fill("stream", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        _check(cfg, self.opts.dilation, self.opts.period)
        return dwa_param_count(cfg.n_layers, self.opts.dilation, self.opts.period)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 2.0 * cfg.d_model * self.extra_params(cfg)
