"""The plain norm types: LayerNorm, RMSNorm (the baseline) and single-scale RMSNorm.

Equations (over the last dimension, d entries; docs/sources.md#ssnorm for SSNorm)::

    layernorm:  y = (x - mean(x)) / sqrt(var(x) + eps) * g + b      g, b in R^d
    rmsnorm:    y = x / sqrt(mean(x^2) + eps) * g                   g in R^d   (baseline)
    ssnorm:     y = x / sqrt(mean(x^2) + eps) * s                   s a single scalar

Citation: Ba, Kiros, Hinton 2016, "Layer Normalization"; Zhang & Sennrich 2019, "Root Mean
Square Layer Normalization"; Park et al. 2025, "Outlier-Safe Pre-Training for Robust 4-Bit
Quantization of Large Language Models" (SSNorm, Flax ``nn.RMSNorm(feature_axes=())``).

Init: g = 1, b = 0, s = 1.

Slots: ``norm`` (the norm type at every site the placement enables; any placement composes,
e.g. ``post_ln+layernorm``). ``rmsnorm`` fills the slot with the baseline component: it is
the baseline, listed so that studies can name it and so that ``rmsnorm+dyt`` is refused.
SSNorm is applied to every norm including the final one, as in OSP; the rest of OSP (Muon,
the embedding projection) is not part of this method. ``layernorm(bias=false)`` drops b.
Parameters over the baseline, counted for the baseline placement (2 L + 1 norms):
layernorm + d per norm with bias (0 without); rmsnorm 0; ssnorm (1 - d) per norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods._common import baseline_norm_count
from modbench.methods.base import Method, register
from modbench.model.norms import inv_rms, rmsnorm_factory
from modbench.model.spec import ModelSpec


class LayerNorm(nn.Module):
    """LayerNorm computed in (at least) float32 and cast back, like the baseline RMSNorm.
    ``affine=False`` drops gain and bias (TokenFormer's non-parametric LayerNorm)."""

    def __init__(self, dim: int, eps: float, bias: bool = True, affine: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        w = None if self.weight is None else self.weight.to(xf.dtype)
        b = None if self.bias is None else self.bias.to(xf.dtype)
        return nn.functional.layer_norm(xf, (self.dim,), w, b, self.eps).to(x.dtype)

    def modbench_init(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, affine={self.weight is not None}, "
                f"bias={self.bias is not None}")


class SingleScaleRMSNorm(nn.Module):
    """``x / RMS(x) * s`` with one learnable scalar ``s``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf, inv = inv_rms(x, self.eps)
        return (xf * inv * self.scale.to(xf.dtype)).to(x.dtype)

    def modbench_init(self) -> None:
        nn.init.ones_(self.scale)


@register
class LayerNormType(Method):
    name = "layernorm"
    category = "norm"
    citation = "Ba, Kiros, Hinton 2016, Layer Normalization"
    summary = "LayerNorm (re-centre and re-scale, gain and bias) at every norm site."

    @dataclass
    class Options:
        bias: bool = True

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        bias = self.opts.bias

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return LayerNorm(dim, eps, bias)

        spec.fill("norm", factory, by=self.name, key=("layernorm", bias))

    def extra_params(self, cfg: ModelConfig) -> int:
        return baseline_norm_count(cfg) * cfg.d_model if self.opts.bias else 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0


@register
class RMSNormType(Method):
    name = "rmsnorm"
    category = "norm"
    citation = "Zhang & Sennrich 2019, Root Mean Square Layer Normalization"
    summary = "RMSNorm with a per-channel gain (the baseline norm type, named explicitly)."
    starts_as_baseline = True

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fill("norm", rmsnorm_factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0


@register
class SSNorm(Method):
    name = "ssnorm"
    category = "norm"
    citation = ("Park et al. 2025, Outlier-Safe Pre-Training for Robust 4-Bit Quantization of "
                "Large Language Models")
    summary = "Single-scale RMSNorm: x / RMS(x) times one learnable scalar per norm."
    starts_as_baseline = True

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return SingleScaleRMSNorm(dim, eps)

        spec.fill("norm", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return baseline_norm_count(cfg) * (1 - cfg.d_model)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
