"""BHyT (Bounded Hyperbolic Tanh), reconstructed from its abstract.

Equation (our reconstruction; METHODS.md D3, the abstract in seeds/001_*)::

    u       = x / (k * RMS(x)),          RMS(x) = sqrt(mean(x^2) + eps)
    BHyT(x) = g * tanh(alpha * u)        alpha a learnable scalar, g in R^d

Citation: Byun et al. 2026, "Bounded Hyperbolic Tangent: A Stable and Efficient Alternative
to Pre-Layer Normalization in Large Language Models" (abstract only; no equations or code
were found).

Init: g = 1, alpha = 1, k = ``bound`` (default 2; a constant, not learned).

What the abstract says and how each point is realised here (all choices our own):

- "couples a tanh nonlinearity with explicit, data-driven input bounding to keep
  activations within a non-saturating range": the input is divided by k times its own
  per-token RMS (the data-driven bound), so about 95 % of entries of a Gaussian-like vector
  have |u| <= 1, where tanh is close to linear; the output is bounded by |g| whatever the
  scale of the residual stream, which is the stated protection against depth-wise growth.
  We chose a per-token RMS (not a batch statistic) so the model stays causal.
- "computes exact statistics once per block and replaces a second normalization with a
  lightweight variance approximation": an efficiency device that we do *not* reproduce;
  every BHyT layer computes its exact per-token RMS. The function class is the same; only
  the speed claim is outside this implementation.

Slots: ``norm`` (a drop-in for Pre-LN's norms; it composes with every placement, though the
paper targets Pre-LN). Parameters over the baseline, counted for the baseline placement
(2 L + 1 norms): + 1 per norm (alpha).
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


class BoundedTanh(nn.Module):
    def __init__(self, dim: int, eps: float, bound: float, alpha: float) -> None:
        super().__init__()
        self.eps, self.bound, self.alpha0 = eps, bound, alpha
        self.alpha = nn.Parameter(torch.full((), alpha))
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        u = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) / self.bound
        y = torch.tanh(self.alpha.to(xf.dtype) * u) * self.weight.to(xf.dtype)
        return y.to(x.dtype)

    def modbench_init(self) -> None:
        nn.init.constant_(self.alpha, self.alpha0)
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, bound={self.bound}, alpha0={self.alpha0}"


@register
class BHyT(Method):
    name = "bhyt"
    category = "norm"
    citation = ("Byun et al. 2026, Bounded Hyperbolic Tangent: A Stable and Efficient "
                "Alternative to Pre-Layer Normalization in LLMs (abstract)")
    summary = "g * tanh(alpha x / (k RMS(x))): tanh on a data-bounded input (from the abstract)."

    @dataclass
    class Options:
        bound: float = 2.0  # k: input divided by k * RMS(x)
        alpha: float = 1.0  # init of the learnable scalar alpha

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        o = self.opts
        if not o.bound > 0:
            raise ModbenchError(f"option bound={o.bound} of method 'bhyt' must be positive")

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return BoundedTanh(dim, eps, o.bound, o.alpha)

        spec.fill("norm", factory, by=self.name, key=("bhyt", o.bound, o.alpha))

    def extra_params(self, cfg: ModelConfig) -> int:
        return baseline_norm_count(cfg)  # alpha; g replaces the RMSNorm gain

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
