"""ReLU^2: the non-gated two-matrix FFN of Primer, widened to the SwiGLU parameter count.

Equation (docs/sources.md#relu2, arXiv 2605.20798 Appendix B.16)::

    FFN(x) = W_down( ReLU(W_up x)^2 ),   hidden width h = 3/2 d_ff

so that 2 d h = 3 d d_ff: the same parameters and FLOPs as the three-matrix SwiGLU.

Citation: So et al. 2021, "Primer: Searching for Efficient Transformers for Language
Modeling" (arXiv 2109.08668).

Init: the baseline's N(0, init_std^2) for both matrices (the modded-nanogpt zero init of
W_down is not used: B.16 does not mention it).

Parameters over the baseline: 2 d h - 3 d d_ff per layer, 0 when d_ff is even.
Extra FLOPs: 4 d h - 6 d d_ff per token per layer (0 when d_ff is even).

Syntax: ``relu2``, ``relu2(hidden=1024)`` (a width of your own).

Choices of our own: h = ceil(3 d_ff / 2) when d_ff is odd; linear roles ``up`` and ``down``
(no ``gate``). Slot: ``ffn``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.spec import Builder, ModelSpec
from modbench.model.stream import ForwardContext


class ReLU2FFN(nn.Module):
    def __init__(self, cfg: ModelConfig, build: Builder, layer: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = build.linear("up", cfg.d_model, hidden, layer)
        self.down_proj = build.linear("down", hidden, cfg.d_model, layer)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


@register
class ReLU2(Method):
    name = "relu2"
    category = "ffn"
    citation = "So et al. 2021, Primer: Searching for Efficient Transformers for Language Modeling"
    summary = "Non-gated FFN W2 ReLU(W1 x)^2 at width 3/2 d_ff (parameter parity with SwiGLU)."

    @dataclass
    class Options:
        hidden: int | None = None  # None: ceil(3 d_ff / 2)

    def hidden(self, cfg: ModelConfig) -> int:
        h = self.opts.hidden if self.opts.hidden is not None else (3 * cfg.d_ff + 1) // 2
        if h <= 0:
            raise ModbenchError(f"option hidden={h} of method 'relu2' must be positive")
        return h

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        self.hidden(cfg)  # refuses a bad option before anything is built

        def factory(c: ModelConfig, build: Builder, layer: int) -> nn.Module:
            return ReLU2FFN(c, build, layer, self.hidden(c))  # c: the layer's d_ff (shape slot)

        spec.fill("ffn", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return (2 * cfg.d_model * self.hidden(cfg) - 3 * cfg.d_model * cfg.d_ff) * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(2 * self.extra_params(cfg))
