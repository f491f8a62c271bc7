"""Unified Normalization (UN): a batch quadratic-mean norm with fluctuation-smoothed statistics,
adaptive outlier filtration, and an inference form that fuses into the next linear layer.

Equations (Yang et al. 2022; the authors' code hikvision-research/Unified-Normalization,
``UN1d``/``UN2dFunction``), per channel c, on the tokens of a batch flattened to (N = B T, C);
t counts training-mode forwards (1, 2, ...), W is the window, m the momentum::

    x2_t       = mean_tokens(x^2)                    the batch quadratic mean (no centring)
    buffer     : the last W values of x2 (slot t mod W)
    filtration (t >= warmup, option ``filtration``): before the slot is written,
                 v = var(sqrt(buffer)) over all its entries (unbiased); after writing x2_t,
                 outlier if any channel has  AM(buffer) - GM(buffer) > W v ; then the slot
                 gets the running psi^2 instead, and this step is a "skip"
    psi^2      = x2_t                    if t <= W, t < warmup or skip
               = GM(buffer) = exp(mean_window(log buffer))      otherwise (fluctuation smoothing)
    z          = x / sqrt(psi^2 + eps),   y = gamma z + beta
    running    psi^2_run <- m psi^2_run + (1 - m) psi^2        (m = 0.9)
    backward   (gradient compensation, r = sqrt(psi^2 + eps) / sqrt(psi^2_run + eps) with the
               running value before this step's update, clamped to [1/5, 5], and r = 1 while
               t <= max(1000, warmup) or on a skip):
               g = dL/dy * gamma * r;   gz_t = mean_tokens(g z);  gz buffer of the last W
               mu = gz_t if t <= W, t < warmup or skip, else mean_window(gz buffer)
               Gamma <- m Gamma + (1 - m) mu
               dL/dx = (g - mu z) / sqrt(psi^2 + eps) on a skip, else (g - Gamma z) / sqrt(..)
               dL/dgamma = sum_tokens(dL/dy * r z),   dL/dbeta = sum_tokens(dL/dy)
    evaluation y = gamma x / sqrt(psi^2_run + eps) + beta       a fixed per-channel affine map

The evaluation form is affine, so :func:`fuse_unified_norms` folds it into the linear layers
that read the norm's output: W' = W diag(gamma / sqrt(psi^2_run + eps)), b' = b + W beta.

Citation: Yang, Zhang, Lan, Yang, Li, Tan, Xiao, Pu 2022, "Unified Normalization for
Accelerating and Stabilizing Transformers" (ACM MM 2022), arXiv 2208.01313; code
hikvision-research/Unified-Normalization.

Init: gamma = 1, beta = 0, psi^2_run = 1, Gamma = 0, both buffers 0, t = 0.

Defaults as in the published ``UN1d``: window 4, warmup 4000, momentum 0.9, filtration off
(its docstring: "Suggest to set as False for NLP tasks"; ``filtration=true`` turns it on).
With warmup 4000 every CPU run (a few hundred steps) normalises by the batch statistic
throughout and never reaches the smoothing; set ``warmup`` lower to exercise it.

Deviations and choices of our own: t counts training-mode forwards as the published code does
(not optimizer steps: with gradient accumulation or activation checkpointing it advances more
than once per step); statistics in float32; no pad masks (packed rows); under DDP each process
uses its own batch's statistics (the published code does not synchronise them either); the
published code returns ``var`` of an all-zero buffer on the first filtration check as is, we
do the same. UN sits at every norm site the placement enables (the paper replaces every LN).

Leak across positions (``leaks_across_positions``): in training mode x2_t is a mean over all
tokens of the batch, so a token's output depends on later tokens (and other sequences).
Evaluation mode uses psi^2_run only: causal, and different from training-mode outputs.

Not stackable: the forward updates buffers and reads t in Python.

Slots: ``norm``. Parameters over the baseline, counted for the baseline placement (2 L + 1
norms): + d per norm (beta). Buffers are not parameters. No extra matmul FLOPs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import baseline_norm_count
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec


class _UNFunction(torch.autograd.Function):
    """UN's training-mode forward (statistics, buffers) and its compensated backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                layer: UnifiedNormLayer) -> torch.Tensor:
        t, win, eps, mom = int(layer.iters.item()), layer.window, layer.eps, layer.momentum
        slot = t % win
        x2 = x.detach().pow(2).mean(0)
        skip = win <= 1  # as published: a window of 1 never smooths
        spread = torch.var(torch.sqrt(layer.buffer_x2))
        layer.buffer_x2[slot] = x2
        smooth_on = t > win and t >= layer.warmup
        if t >= layer.warmup and layer.filtration:
            buf = layer.buffer_x2
            am, gm = buf.mean(0), torch.exp(torch.log(buf).mean(0))
            if bool(((am - gm) > spread * win).any()):
                layer.buffer_x2[slot] = layer.running_var
                layer.skips += 1
                skip = True
        smoothed = smooth_on and not skip
        var = torch.exp(torch.log(layer.buffer_x2).mean(0)) if smoothed else x2
        r = torch.sqrt(var + eps) / torch.sqrt(layer.running_var + eps)
        exact = t <= max(1000, layer.warmup) or skip
        r = torch.ones_like(r) if exact else r.clamp(1 / 5, 5)
        z = x / torch.sqrt(var + eps)
        layer.running_var.mul_(mom).add_((1 - mom) * var)
        ctx.save_for_backward(z, var, weight, r)
        ctx.layer, ctx.t, ctx.skip, ctx.smooth = layer, t, skip, smooth_on
        return z * weight + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        z, var, weight, r = ctx.saved_tensors
        layer: UnifiedNormLayer = ctx.layer
        win, mom = layer.bwindow, layer.momentum
        g = grad * weight * r
        gz = (g * z).mean(0)
        slot = ctx.t % win
        with torch.no_grad():
            layer.buffer_gz[slot] = layer.ema_gz if ctx.skip else gz
            smooth = ctx.t > win and ctx.t >= layer.warmup and not ctx.skip
            mu = layer.buffer_gz.mean(0) if smooth else gz
            layer.ema_gz.mul_(mom).add_((1 - mom) * mu)
            approx = g - (mu if ctx.skip else layer.ema_gz) * z
        gx = approx / torch.sqrt(var + layer.eps)
        return gx, (grad * (r * z)).sum(0), grad.sum(0), None


class UnifiedNormLayer(nn.Module):
    def __init__(self, dim: int, eps: float, window: int, warmup: int, filtration: bool,
                 momentum: float = 0.9, bwindow: int | None = None) -> None:
        super().__init__()
        self.dim, self.eps, self.window, self.warmup = dim, eps, window, warmup
        self.bwindow = window if bwindow is None else bwindow
        self.filtration, self.momentum = filtration, momentum
        self.fused = False
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.register_buffer("ema_gz", torch.zeros(dim))
        self.register_buffer("buffer_x2", torch.zeros(window, dim))
        self.register_buffer("buffer_gz", torch.zeros(self.bwindow, dim))
        self.register_buffer("iters", torch.zeros((), dtype=torch.long))
        self.register_buffer("skips", torch.zeros((), dtype=torch.long))

    def modbench_init(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)
        self.running_var.fill_(1.0)
        for b in (self.ema_gz, self.buffer_x2, self.buffer_gz, self.iters, self.skips):
            b.zero_()

    @torch.no_grad()
    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The evaluation-mode map y = scale * x + shift (per channel)."""
        scale = self.weight / torch.sqrt(self.running_var + self.eps)
        return scale, self.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            if self.training:
                raise ModbenchError("this unified_norm was fused into the next linear layer "
                                    "for inference; train the unfused model instead")
            return x
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        flat = xf.reshape(-1, self.dim)
        w, b = self.weight.to(flat.dtype), self.bias.to(flat.dtype)
        if not self.training:
            y = flat / torch.sqrt(self.running_var.to(flat.dtype) + self.eps) * w + b
            return y.reshape(xf.shape).to(x.dtype)
        with torch.no_grad():
            self.iters += 1
        y = _UNFunction.apply(flat, w, b, self)
        return y.reshape(xf.shape).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.dim}, window={self.window}, warmup={self.warmup}, "
                f"filtration={self.filtration}, fused={self.fused}")


def fuse_unified_norms(model: nn.Module, idx: torch.Tensor, atol: float = 1e-4
                       ) -> tuple[nn.Module, int]:
    """A copy of an evaluation-mode model with every UN whose output feeds only linear layers
    folded into them: W' = W diag(scale), b' = b + W shift, and the UN made an identity.

    ``idx`` is a probe batch of token ids: a forward with hooks finds which ``nn.Linear``
    layers read each UN's output tensor; each fold is kept only if the copy still gives the
    same logits on ``idx`` (within ``atol``), so a UN whose output also goes elsewhere (the
    residual stream under Post-LN) stays, as does one read by a weight shared with another
    module (a tied head). Returns the fused copy and the number of UNs fused.
    """
    if model.training:
        raise ModbenchError("fuse_unified_norms needs an evaluation-mode model: call "
                            "model.eval() first (training mode uses batch statistics)")
    fused = copy.deepcopy(model)
    norms = {id(m): m for m in fused.modules() if isinstance(m, UnifiedNormLayer)}
    outputs: dict[int, UnifiedNormLayer] = {}
    readers: dict[int, list[nn.Linear]] = {k: [] for k in norms}
    hooks = []

    def on_norm(m: nn.Module, inp: Any, out: torch.Tensor) -> None:
        outputs[id(out)] = m  # type: ignore[assignment]
        keep.append(out)  # keep the tensor alive so its id stays unique

    def on_linear(m: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
        src = outputs.get(id(inp[0]))
        if src is not None:
            readers[id(src)].append(m)  # type: ignore[arg-type]

    keep: list[torch.Tensor] = []
    for m in fused.modules():
        if isinstance(m, UnifiedNormLayer):
            hooks.append(m.register_forward_hook(on_norm))
        elif isinstance(m, nn.Linear):
            hooks.append(m.register_forward_pre_hook(on_linear))
    with torch.no_grad():
        reference = fused(idx)
    for h in hooks:
        h.remove()
    keep.clear()
    counts: dict[int, int] = {}
    for _, p in fused.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    n = 0
    with torch.no_grad():
        for key, norm in norms.items():
            lins = readers[key]
            if not lins or any(counts[id(lin.weight)] > 1 for lin in lins):
                continue
            scale, shift = norm.affine()
            saved = [(lin.weight, lin.bias) for lin in lins]
            for lin in lins:
                w = lin.weight
                bias = w @ shift.to(w.dtype)
                if lin.bias is not None:
                    bias = bias + lin.bias
                lin.weight = nn.Parameter(w * scale.to(w.dtype)[None, :])
                lin.bias = nn.Parameter(bias)
            norm.fused = True
            if torch.allclose(fused(idx), reference, atol=atol, rtol=0):
                n += 1
                continue
            norm.fused = False  # its output is also read elsewhere: undo
            for lin, (w, b) in zip(lins, saved, strict=True):
                lin.weight = w
                lin.bias = b
    return fused, n


@register
class UnifiedNorm(Method):
    name = "unified_norm"
    category = "norm"
    stackable = False
    stack_note = "it updates running statistics and windows in the forward and reads t in Python"
    compile_graph_breaks = ("its forward branches in Python on its iteration count and on the "
                            "outlier filtration test, both read from buffers on the host")
    citation = ("Yang, Zhang, Lan, Yang, Li, Tan, Xiao, Pu 2022, Unified Normalization for "
                "Accelerating and Stabilizing Transformers (ACM MM)")
    summary = ("Batch quadratic-mean norm with window-smoothed statistics, outlier filtration; "
               "eval form fuses into the next linear; training mode leaks across positions.")
    leaks_across_positions = True

    @dataclass
    class Options:
        window: int = 4  # iterations in the geometric-mean / gradient window (W)
        warmup: int = 4000  # training forwards that use the batch statistic
        filtration: bool = False  # adaptive outlier filtration (published: off for NLP)
        momentum: float = 0.9  # of the running psi^2 and of Gamma

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        o = self.opts
        if o.window < 1:
            raise ModbenchError(f"option window={o.window} of method 'unified_norm' must be at "
                                "least 1 iteration")
        if o.warmup < 0:
            raise ModbenchError(f"option warmup={o.warmup} of method 'unified_norm' must be 0 "
                                "or more forwards")
        if not 0.0 <= o.momentum < 1.0:
            raise ModbenchError(f"option momentum={o.momentum} of method 'unified_norm' must be "
                                "in [0, 1)")
        window, warmup, filt, mom = o.window, o.warmup, bool(o.filtration), float(o.momentum)

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return UnifiedNormLayer(dim, eps, window, warmup, filt, mom)

        spec.fill("norm", factory, by=self.name, key=("unified_norm", window, warmup, filt, mom))

    def extra_params(self, cfg: ModelConfig) -> int:
        return baseline_norm_count(cfg) * cfg.d_model  # beta; gamma replaces the gain

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
