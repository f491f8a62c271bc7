"""Adaptive RMSNorm: an RMSNorm whose gain is modulated by a causal context of the sequence.

Equation (docs/sources.md#se-token-mix, our causal reading of the model card)::

    x_hat_t = x_t / sqrt(mean(x_t^2) + eps)
    c_t     = (1 / t) sum_{s <= t} x_hat_s            causal (cumulative) mean over positions
    y_t     = g * (1 + tanh(W c_t)) * x_hat_t         W in R^(d x d), g in R^d

Citation: the Hugging Face model card ``Josephgflowers/Liquid-Metal-Tinyllama-Test-1``
(the model card: "Adaptive RMSNorm normalizes the input while applying an adaptive scaling based
on the global context of each input"); its script is not public and there is no paper.

Init: g = 1 and W = 0, so the layer equals RMSNorm at initialisation (1 + tanh(0) = 1); W
still gets gradients there (d(1 + tanh(Wc))/dW = c at W = 0).

Choices of our own (nothing public settles them): the card's "global context" is a mean over
the whole input, which in a causal LM would leak future tokens; we pool causally (the mean of
positions 1..t for position t), so changing a later token never changes an earlier output;
the context is pooled from the normalised input x_hat (bounded, independent of the stream's
scale); the gate is 1 + tanh(.) (range (0, 2), identity at 0) through a full d x d linear map
without bias. The card's token-mixing convolution and SE block are separate modifications,
not part of this norm type.

Slots: ``norm`` (every placement composes). Parameters over the baseline, counted for the
baseline placement (2 L + 1 norms): + d^2 per norm. FLOPs: + 2 d^2 per token and norm (the
W c_t matrix multiplication; the cumulative mean is element-wise).
"""

from __future__ import annotations

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods._common import baseline_norm_count
from modbench.methods.base import Method, register
from modbench.model.norms import inv_rms
from modbench.model.spec import ModelSpec


class AdaptiveRMSNormLayer(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.context = nn.Linear(dim, dim, bias=False)

    def modbench_init(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.context.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf, inv = inv_rms(x, self.eps)
        xn = xf * inv
        t = xn.shape[-2]
        counts = torch.arange(1, t + 1, device=xn.device, dtype=xn.dtype).unsqueeze(-1)
        ctx = xn.cumsum(dim=-2) / counts  # (..., T, d): mean over positions <= t
        gate = 1.0 + torch.tanh(self.context(ctx.to(self.context.weight.dtype)).to(xf.dtype))
        return (self.weight.to(xf.dtype) * gate * xn).to(x.dtype)


@register
class AdaptiveRMSNorm(Method):
    name = "adaptive_rmsnorm"
    category = "norm"
    citation = "Josephgflowers/Liquid-Metal-Tinyllama-Test-1 model card (Hugging Face)"
    summary = "RMSNorm with gain g * (1 + tanh(W c_t)), c_t the causal mean of earlier positions."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return AdaptiveRMSNormLayer(dim, eps)

        spec.fill("norm", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return baseline_norm_count(cfg) * cfg.d_model ** 2

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(baseline_norm_count(cfg) * 2 * cfg.d_model ** 2)
