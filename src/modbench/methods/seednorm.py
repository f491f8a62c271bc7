"""SeeDNorm: self-rescaled dynamic normalization.

Equation (docs/sources.md#seednorm)::

    SeeDNorm(x) = [tanh(x . beta) * alpha + gamma] * x / RMS(x)

with beta, alpha, gamma in R^d: ``x . beta`` is one scalar per token, spread over the
channels by alpha. With ``heads = h > 1`` (the paper's multi-head form) x is split into h
equal chunks, each with its own scalar ``x_c . beta_c`` and its own slice of alpha.
RMS(x) = sqrt(mean(x^2) + eps) over the whole vector.

Citation: Cai, Zhu et al. 2026, "SeeDNorm: Self-Rescaled Dynamic Normalization" (ICLR 2026,
arXiv 2510.22777); no public code.

Init (not stated in public sources; our choice, unverified): gamma = 1,
beta = 0, alpha = 1, so SeeDNorm equals RMSNorm at initialisation while both beta (through
alpha) and alpha (through tanh) get gradients; alpha = beta = 0 would give zero gradients.

Slots: ``norm`` (every placement composes). Choices of our own: the tanh argument uses the
raw input x (the equation as written), computed in float32; no special weight decay or
learning rate on alpha and beta (the paper discusses such remedies; weight decay here only
touches matrices). Parameters over the baseline, counted for the baseline placement
(2 L + 1 norms): + 2 d per norm (alpha, beta).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import baseline_norm_count
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec


class SeeDNormLayer(nn.Module):
    def __init__(self, dim: int, eps: float, heads: int = 1) -> None:
        super().__init__()
        if dim % heads:
            raise ModbenchError(f"seednorm heads={heads} must divide the norm width {dim}")
        self.eps, self.heads = eps, heads
        self.gamma = nn.Parameter(torch.ones(dim))
        self.alpha = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        d, h = xf.shape[-1], self.heads
        xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        chunks = xf.unflatten(-1, (h, d // h))  # (..., h, d/h)
        s = (chunks * self.beta.to(xf.dtype).view(h, d // h)).sum(-1, keepdim=True)
        alpha = self.alpha.to(xf.dtype).view(h, d // h)
        scale = (torch.tanh(s) * alpha).flatten(-2) + self.gamma.to(xf.dtype)
        return (scale * xn).to(x.dtype)

    def modbench_init(self) -> None:
        nn.init.ones_(self.gamma)
        nn.init.ones_(self.alpha)
        nn.init.zeros_(self.beta)

    def extra_repr(self) -> str:
        return f"{self.gamma.shape[0]}, eps={self.eps}, heads={self.heads}"


@register
class SeeDNorm(Method):
    name = "seednorm"
    category = "norm"
    citation = "Cai, Zhu et al. 2026, SeeDNorm: Self-Rescaled Dynamic Normalization (ICLR)"
    summary = "RMSNorm whose gain is gamma + alpha tanh(x . beta), a per-token dynamic scale."
    starts_as_baseline = True

    @dataclass
    class Options:
        heads: int = 1  # >1: multi-head form, one scalar per chunk of d/heads channels

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        heads = self.opts.heads
        if heads < 1:
            raise ModbenchError(f"option heads={heads} of method 'seednorm' must be >= 1")

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return SeeDNormLayer(dim, eps, heads)

        spec.fill("norm", factory, by=self.name, key=("seednorm", heads))

    def extra_params(self, cfg: ModelConfig) -> int:
        return baseline_norm_count(cfg) * 2 * cfg.d_model

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        # x . beta is a per-token reduction (implemented element-wise, not as a matmul)
        return 0.0
