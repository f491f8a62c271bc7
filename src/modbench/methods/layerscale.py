"""LayerScale: a learnable per-channel gate on each residual branch.

Equation (docs/sources.md#layerscale, arXiv 2605.20798 Appendix B.10)::

    x' = x + diag(lambda) F(N(x)),   lambda in R^d, one vector per sublayer

Citation: Touvron et al. 2021, "Going deeper with Image Transformers" (CaiT).

Init: lambda = eps everywhere, with CaiT's depth rule when ``init`` is not given:
eps = 0.1 for depth <= 18, 1e-5 for depth <= 24, 1e-6 deeper (the rule as recalled
from the paper; arXiv 2605.20798 B.10 says only that the value "matches the CaiT paper").
Depth is the number of blocks, L.

Slots: fills ``merge`` (the residual merge of each sublayer). Parameters: 2 d per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec
from modbench.model.stream import StreamState


def cait_init(depth: int) -> float:
    """CaiT's LayerScale init by depth."""
    if depth <= 18:
        return 0.1
    if depth <= 24:
        return 1e-5
    return 1e-6


class LayerScaleMerge(nn.Module):
    """``x + lambda * out`` with a per-channel ``lambda``."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        return x + self.scale.to(out.dtype) * out

    def modbench_init(self) -> None:
        nn.init.constant_(self.scale, self.init)

    def extra_repr(self) -> str:
        return f"{self.scale.shape[0]}, init={self.init:g}"


@register
class LayerScale(Method):
    name = "layerscale"
    category = "residual"
    citation = "Touvron et al. 2021, Going deeper with Image Transformers (CaiT)"
    summary = "Per-channel learnable gate on every residual branch: x + diag(lambda) F(x)."

    @dataclass
    class Options:
        init: float | None = None  # None: CaiT's rule by depth

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        init = self.opts.init if self.opts.init is not None else cait_init(cfg.n_layers)

        def factory(c: ModelConfig, layer: int, sublayer: str) -> nn.Module:
            return LayerScaleMerge(c.d_model, init)

        spec.fill("merge", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # an element-wise product per sublayer
