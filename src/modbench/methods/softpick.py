"""Softpick: rectified softmax, no renormalisation.

Equation (docs/sources.md#softpick, arXiv 2605.20798 Appendix B.2), row-wise over the visible
keys j::

    softpick(x)_i = ReLU(exp(x_i) - 1) / (sum_j |exp(x_j) - 1| + eps),   eps = 1e-8
    y = softpick(q k^T / sqrt(d_h), causal) v

computed in the numerically stable form of the official code, multiplying numerator and
denominator by exp(-m)::

    num_i = ReLU(exp(x_i - m) - exp(-m))
    den   = sum_j [j visible] |exp(x_j - m) - exp(-m)| + eps

Masked keys contribute 0 to both. Rows may be all zero (no attention sink, by design), and
the weights are not renormalised after the ReLU (the "rectified softmax" of B.2).

Citation: Zuhri, Fuadi, Aji 2025, "Softpick: No Attention Sink, No Massive Activations with
Rectified Softmax".

Init: no parameters; the baseline init. Extra FLOPs 0 (element-wise on the explicit scores).

Choices of our own: ``m = max(0, max_j visible x_j)`` instead of the plain row maximum. For
``m >= 0`` this is the official form; when every visible logit is negative, the official
``exp(-m)`` overflows for very negative rows, whereas with m = 0 the numerator is exactly 0
(as it is mathematically) and the denominator is finite. A fully masked row gives zeros.
As in the official code, ``eps`` is added after the rescaling by exp(-m). The explicit-score
path is used on every device (SDPA and FlexAttention always normalise with a softmax).
"""

from __future__ import annotations

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.attention import ExplicitKernel
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext

EPS = 1e-8


def softpick(x: torch.Tensor, mask: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Stable softpick over the last dimension; ``mask`` is True where the key is visible."""
    m = x.masked_fill(~mask, float("-inf")).amax(dim=-1, keepdim=True).clamp_min(0.0)
    xs = x.masked_fill(~mask, 0.0)
    e = torch.exp(xs - m) - torch.exp(-m)
    num = torch.relu(e).masked_fill(~mask, 0.0)
    den = e.abs().masked_fill(~mask, 0.0).sum(dim=-1, keepdim=True) + eps
    return num / den


class SoftpickKernel(ExplicitKernel):
    def weights(
        self, logits: torch.Tensor, mask: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return softpick(logits, mask)


@register
class Softpick(Method):
    name = "softpick"
    category = "attention"
    citation = ("Zuhri, Fuadi, Aji 2025, Softpick: No Attention Sink, No Massive Activations "
                "with Rectified Softmax")
    summary = "Rectified softmax ReLU(e^x - 1) / sum|e^x - 1|: exact zeros, no sink."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return SoftpickKernel()

        spec.fill("attn.kernel", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # element-wise on the explicit scores
