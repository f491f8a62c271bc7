"""Normalization layers of the baseline and the norm-site factory."""

from __future__ import annotations

import torch
from torch import nn


def inv_rms(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in (at least) float32 and ``1 / sqrt(mean(x^2) + eps)`` over its last dimension:
    the shared core of every RMS-based norm and of the streams' depth/lane scores."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * g`` over the last dimension (Zhang & Sennrich 2019).

    Computed in (at least) float32 and cast back, as in Llama. ``g`` starts at 1.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf, inv = inv_rms(x, self.eps)
        return (xf * inv * self.weight.to(xf.dtype)).to(x.dtype)

    def modbench_init(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rmsnorm_factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
    """The baseline norm type: RMSNorm at every site that has a norm."""
    return RMSNorm(dim, eps)


def pre_norm_placement(site: str, layer: int, n_layers: int) -> bool:
    """Llama's Pre-LN: a norm before each sublayer and a final norm."""
    return site in ("attn.pre", "ffn.pre", "final")
