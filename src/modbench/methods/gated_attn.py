"""Gated Attention: a sigmoid gate on each head's attention output, before W_o.

Equation (docs/sources.md#gated-attn, arXiv 2605.20798 Appendix B.17)::

    Y'_h = Y_h * sigmoid(X W_theta)_h          Y_h: head h's SDPA output, (B, T, d_h)
    out  = W_o concat_h Y'_h

``X`` is the same pre-normed hidden state that feeds ``q_proj``. Two forms (option ``form``):

- ``head`` (default, B.17): one scalar gate per query head, W_theta in R^{d x H};
  parameters d H per layer, extra FLOPs 2 d H per token per layer.
- ``elementwise`` (the paper's best, G1): one gate per channel, W_theta in R^{d x H d_h};
  parameters d H d_h per layer, extra FLOPs 2 d H d_h per token per layer.

Citation: Qiu et al. 2025, "Gated Attention for Large Language Models: Non-linearity,
Sparsity, and Attention-Sink-Free" (arXiv 2505.06708).

Init: default linear init (N(0, init_std^2) like every linear here), no bias, so the gates
start near sigmoid(0) = 0.5.

Syntax: ``gated_attn``, ``gated_attn(form=elementwise)``; the study's combination is
``gated_attn+qknorm``.

Choices of our own: W_theta is a separate bias-free ``nn.Linear`` instead of being fused into
q_proj as in the official code (same function and parameter count; the linear-factory
roles are fixed, so method wrappers of role ``q`` do not see it). Under GQA the gate stays
per query head. The fast SDPA path is unchanged. Slot: ``attn.out_gate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, option_choice, register
from modbench.model.spec import Builder, ModelSpec


class OutputGate(nn.Module):
    """``y * sigmoid(x W_theta)`` per head (``per=1``) or per channel (``per=d_h``)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, elementwise: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.per = head_dim if elementwise else 1
        self.proj = nn.Linear(d_model, n_heads * self.per, bias=False)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        g = torch.sigmoid(self.proj(x)).view(b, t, self.n_heads, self.per).transpose(1, 2)
        return y * g.to(y.dtype)


@register
class GatedAttention(Method):
    name = "gated_attn"
    category = "attention"
    citation = ("Qiu et al. 2025, Gated Attention for Large Language Models: Non-linearity, "
                "Sparsity, and Attention-Sink-Free")
    summary = "Sigmoid gate from the layer input on each head's output (per head or per channel)."

    @dataclass
    class Options:
        form: str = "head"  # head | elementwise

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        form = option_choice(self.name, "form", self.opts.form, ("head", "elementwise"))

        def factory(c: ModelConfig, build: Builder, layer: int) -> nn.Module:
            return OutputGate(c.d_model, c.n_heads, c.head_dim, form == "elementwise")

        spec.fill("attn.out_gate", factory, by=self.name)

    def _width(self, cfg: ModelConfig) -> int:
        return cfg.n_heads * (cfg.head_dim if self.opts.form == "elementwise" else 1)

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.d_model * self._width(cfg) * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(2 * cfg.d_model * self._width(cfg) * cfg.n_layers)
