"""PowerNorm: batch quadratic-mean normalization with running statistics and an
approximate backward pass.

Equations (docs/sources.md#powernorm; sIncerass/powernorm ``MaskPowerNorm``), per channel c, on the
tokens of a batch flattened to (N = B T, C)::

    group scaling:  x <- x / sqrt(mean_{group}(x^2) + eps)      per token, per channel group
    psi_B^2      =  mean_tokens(x^2)                            the batch quadratic mean
    z            =  x / sqrt(psi^2 + eps),  psi^2 = psi_B^2 while step < warmup, else the
                    running psi^2
    y            =  gamma z + beta
    running psi^2:  during warm-up first a cumulative mean over updates, then every update
                    psi^2 <- alpha_fwd psi^2 + (1 - alpha_fwd) psi_B^2     (alpha_fwd 0.9)
    backward:       g = dL/dy * gamma;  g~ = g - (1 - alpha_bkw) Gamma z;
                    Gamma += mean_tokens(g~ z);   dL/dx = g~ / sqrt(psi_B^2 + eps)
                    (alpha_bkw 0.9; Gamma accumulates as in the published code)

Citation: Shen, Yao, Gholami, Mahoney, Keutzer 2020, "PowerNorm: Rethinking Batch
Normalization in Transformers" (ICML 2020); code sIncerass/powernorm.

Init: gamma = 1, beta = 0, running psi^2 = 1, Gamma = 0.

Leak across positions (``leaks_across_positions``): in training mode, while step < warmup,
psi_B^2 is a mean over every token of the batch, so a token's output depends on later
tokens (and other sequences): a causal LM sees a little of the future during training.
After warm-up the forward uses only the running statistic (updated from the batch, so the
*next* step's outputs still depend on this batch's future tokens). Evaluation mode uses the
running psi^2 only: causal, no leak, and different from training-mode outputs.

Step: the warm-up counts optimizer steps, given by the trainer through a callback
(``StepCallback``); outside the trainer a module stays at step 0 (warm-up) unless
``modbench_set_step`` is called. Choices of our own: ``groups`` defaults to n_heads
(the paper's code; the class default is 1); ``warmup`` defaults to the class's 10,000 (longer
than every CPU run: those train with batch statistics throughout). Statistics are in
float32. The original used PN in the MT encoder only; here it is a norm type at every
site the placement enables.

Slots: ``norm``. Parameters over the baseline, counted for the baseline placement
(2 L + 1 norms): + d per norm (beta). Buffers (running psi^2, Gamma) are not parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import StepCallback, baseline_norm_count
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec


class _PowerFunction(torch.autograd.Function):
    """y = gamma * x / sqrt(phi + eps) + beta with PowerNorm's approximate backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                phi: torch.Tensor, var: torch.Tensor, ema_gz: torch.Tensor, eps: float,
                abkw: float) -> torch.Tensor:
        z = x / torch.sqrt(phi + eps)
        ctx.save_for_backward(z, var, weight)
        ctx.ema_gz, ctx.eps, ctx.abkw = ema_gz, eps, abkw
        return z * weight + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        z, var, weight = ctx.saved_tensors
        g = grad * weight
        approx = g - (1.0 - ctx.abkw) * ctx.ema_gz * z
        ctx.ema_gz.add_((approx * z).mean(0, keepdim=True))
        gx = approx / torch.sqrt(var + ctx.eps)
        return gx, (grad * z).sum(0), grad.sum(0), None, None, None, None, None


class PowerNormLayer(nn.Module):
    def __init__(self, dim: int, eps: float, groups: int, warmup: int,
                 alpha_fwd: float = 0.9, alpha_bkw: float = 0.9) -> None:
        super().__init__()
        if dim % groups:
            raise ModbenchError(f"powernorm groups={groups} must divide the norm width {dim}")
        self.dim, self.eps, self.groups, self.warmup = dim, eps, groups, warmup
        self.afwd, self.abkw = alpha_fwd, alpha_bkw
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_phi", torch.ones(1, dim))
        self.register_buffer("ema_gz", torch.zeros(1, dim))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))
        self.step = 0
        self.warm = warmup > 0  # step < warmup, kept as a bool: a compiled forward guards on
        # it and recompiles once when the warm-up ends, not at every step

    def modbench_set_step(self, step: int, total: int) -> None:
        self.step = step
        self.warm = step < self.warmup

    def modbench_init(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)
        self.running_phi.fill_(1.0)
        self.ema_gz.zero_()
        self.updates.zero_()

    def group_scale(self, x: torch.Tensor) -> torch.Tensor:
        g = x.unflatten(-1, (self.groups, self.dim // self.groups))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = self.group_scale(x.to(torch.promote_types(x.dtype, torch.float32)))
        shape = xf.shape
        flat = xf.reshape(-1, self.dim)
        w, b = self.weight.to(flat.dtype), self.bias.to(flat.dtype)
        if not self.training:
            y = flat / torch.sqrt(self.running_phi + self.eps) * w + b
            return y.reshape(shape).to(x.dtype)
        var = flat.detach().pow(2).mean(0, keepdim=True)
        warm = self.warm
        # a copy of var, not var itself: the same tensor twice in one autograd.Function
        # call breaks torch.compile's graph
        phi = var.clone() if warm else self.running_phi.clone()
        with torch.no_grad():
            self.updates += 1
            if warm:
                # traced (torch.compile), the count stays on the device: a host read breaks
                # the graph. Eager keeps the Python count (the same values on the CPU, where
                # tests/model/test_compile_graphs.py compares them; CUDA may divide by a
                # Python scalar through its reciprocal)
                n: Any = (self.updates.to(self.running_phi.dtype)
                          if torch.compiler.is_compiling() else self.updates.item())
                self.running_phi.mul_((n - 1) / n).add_(var / n)
            self.running_phi.mul_(self.afwd).add_((1 - self.afwd) * var)
        y = _PowerFunction.apply(flat, w, b, phi, var, self.ema_gz, self.eps, self.abkw)
        return y.reshape(shape).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, groups={self.groups}, warmup={self.warmup}"


@register
class PowerNorm(Method):
    name = "powernorm"
    category = "norm"
    stackable = False
    stack_note = "it updates running statistics during the forward and reads their count in Python"
    citation = ("Shen, Yao, Gholami, Mahoney, Keutzer 2020, PowerNorm: Rethinking Batch "
                "Normalization in Transformers (ICML)")
    summary = ("Batch quadratic-mean norm with running stats and approximate backward; "
               "training mode leaks across positions.")
    leaks_across_positions = True

    @dataclass
    class Options:
        groups: int | None = None  # channel groups of the group scaling (None: n_heads)
        warmup: int = 10000  # optimizer steps that use batch statistics in the forward

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        if self.opts.groups is not None and self.opts.groups < 1:
            raise ModbenchError(f"option groups={self.opts.groups} of method 'powernorm' must be "
                                "at least 1 (or null for n_heads)")
        if self.opts.warmup < 0:
            raise ModbenchError(f"option warmup={self.opts.warmup} of method 'powernorm' must "
                                "be 0 or more steps")
        groups = self.opts.groups or cfg.n_heads
        warmup = self.opts.warmup

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return PowerNormLayer(dim, eps, groups, warmup)

        spec.fill("norm", factory, by=self.name, key=("powernorm", groups, warmup))

    def callbacks(self) -> list[Any]:
        return [StepCallback()]

    def extra_params(self, cfg: ModelConfig) -> int:
        return baseline_norm_count(cfg) * cfg.d_model  # beta; gamma replaces the gain

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
