"""Value Residual (ResFormer): every layer's values mixed with the first layer's values.

Equation (docs/sources.md#value-residual, arXiv 2605.20798 Appendix B.8)::

    layer 1:      V_1 = x_1 W_v^1                   (stored for the later layers)
    layer n > 1:  V_n <- lam_n V_1 + (1 - lam_n) V_n,   then attention as usual

``V`` are the projected values in KV space (``(B, H_kv, T, d_h)``; no RoPE on values, so
the order with RoPE does not matter). Layer 1 is plain attention (B.8: no first-layer
reference exists yet).

Citation: Zhou et al. 2024/2025, "Value Residual Learning For Alleviating Attention
Concentration In Transformers" (ResFormer, arXiv 2410.17897).

Init: lam_n = 0.5 (B.8's learnable scalar; at init this is the official code's fixed
``0.5 * V_1 + 0.5 * V_n``). Parameters: one scalar per layer after the first, L - 1 in
total (0 with ``learnable=false``). Extra FLOPs: 0 (element-wise).

Syntax: ``value_residual``, ``value_residual(init=0.3)``, ``value_residual(learnable=false)``.

Choices of our own: the convex form ``lam V_1 + (1 - lam) V_n`` with one learnable scalar
(B.8 names one learnable scalar; the official code's two fixed 0.5 weights are the init);
V_1 travels between layers in the forward context's ``shared`` scratch dict. The fast SDPA
path is unchanged. Slot: ``attn.v_path``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext

KEY = "value_residual.v1"


class StoreFirstValues(nn.Module):
    """Layer 1: keep V_1 for the later layers, return it unchanged."""

    def forward(self, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ctx.shared[KEY] = v
        return v


class MixFirstValues(nn.Module):
    """Layers n > 1: ``lam V_1 + (1 - lam) V_n``."""

    def __init__(self, init: float, learnable: bool) -> None:
        super().__init__()
        self.init = init
        if learnable:
            self.lam = nn.Parameter(torch.tensor(float(init)))
        else:
            self.register_buffer("lam", torch.tensor(float(init)), persistent=False)

    def forward(self, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        v1 = ctx.shared.get(KEY)
        if v1 is None:
            raise ModbenchError("value_residual: the first layer's values are missing")
        if v1.shape != v.shape:  # layers of other shapes (the shape slot: layerwise_scaling)
            raise ModbenchError(f"value_residual needs the first layer's value shape in every "
                                f"layer; got {tuple(v1.shape)} and {tuple(v.shape)}: do not "
                                "combine it with per-layer head counts (layerwise_scaling)")
        lam = self.lam.to(v.dtype)
        return lam * v1 + (1 - lam) * v

    def modbench_init(self) -> None:
        with torch.no_grad():
            self.lam.fill_(self.init)

    def extra_repr(self) -> str:
        return f"init={self.init:g}, learnable={isinstance(self.lam, nn.Parameter)}"


@register
class ValueResidual(Method):
    name = "value_residual"
    category = "attention"
    citation = ("Zhou et al. 2025, Value Residual Learning For Alleviating Attention "
                "Concentration In Transformers (ResFormer)")
    summary = "Values of layer n mixed with layer 1's: lam V_1 + (1 - lam) V_n, lam = 0.5."

    @dataclass
    class Options:
        init: float = 0.5
        learnable: bool = True

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        init, learnable = float(self.opts.init), self.opts.learnable

        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return StoreFirstValues() if layer == 0 else MixFirstValues(init, learnable)

        spec.fill("attn.v_path", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.n_layers - 1 if self.opts.learnable else 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
