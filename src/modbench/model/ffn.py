"""The FFN core: the gated (SwiGLU) feed-forward network of Llama, activation in a slot."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.model.spec import Builder
from modbench.model.stream import ForwardContext


class GatedFFN(nn.Module):
    """``FFN(x) = W_down(act(W_gate x) * W_up x)``; ``act`` fills slot ``ffn.act`` (SiLU).

    ``linear`` makes the three projections, ``(role, d_in, d_out, layer) -> module``: the
    builder's (recorded in ``model.parts``, wrapped) by default; a core holding several FFNs
    per layer (MoE experts) passes the bare ``linear`` slot."""

    def __init__(self, cfg: ModelConfig, build: Builder, layer: int,
                 linear: Callable[[str, int, int, int], nn.Module] | None = None) -> None:
        super().__init__()
        make = build.linear if linear is None else linear
        self.gate_proj = make("gate", cfg.d_model, cfg.d_ff, layer)
        self.up_proj = make("up", cfg.d_model, cfg.d_ff, layer)
        self.down_proj = make("down", cfg.d_ff, cfg.d_model, layer)
        self.act = build.optional("ffn.act", nn.SiLU, cfg, layer)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def gated_ffn_factory(cfg: ModelConfig, build: Builder, layer: int) -> nn.Module:
    return GatedFFN(cfg, build, layer)
