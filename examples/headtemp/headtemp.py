"""Learned per-head attention temperature: each head scales its queries by exp(tau_h).

Equation::

    q_h <- exp(tau_h) * q_h          (after RoPE, before the scores)
    softmax(exp(tau_h) q_h k^T / sqrt(d_h))

so tau_h > 0 sharpens head h's attention and tau_h < 0 flattens it; one scalar per head and
layer, learned with the rest of the model.

Citation: a per-head learned temperature in the spirit of Henry et al. 2020, "Query-Key
Normalization for Transformers" (arXiv 2010.04245), which learns one scale g for the whole
layer; here one per head, and on the raw logits (no q/k normalisation). Not in modbench's
catalogue: this file is the worked example of docs/methods.md, "Your own method".
Init: tau_h = 0, so the model starts as the baseline (exp(0) = 1). Parameters: H per layer.
Extra FLOPs: 0 (an element-wise scaling of q, which the FLOP convention does not count).
Slot: ``attn.qk_post`` (after RoPE), as SSMax uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext


class HeadTemperature(nn.Module):
    """``q <- exp(tau_h) q`` for each head h; keys unchanged."""

    def __init__(self, n_heads: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.tau = nn.Parameter(torch.full((n_heads,), init))

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (batch, heads, tokens, head_dim)
        return q * self.tau.exp()[:, None, None].to(q.dtype), k

    def modbench_init(self) -> None:  # called when the model initialises its weights
        nn.init.constant_(self.tau, self.init)


@register
class HeadTemp(Method):
    name = "headtemp"
    category = "attention"
    citation = "Henry et al. 2020, arXiv 2010.04245 (per layer); per head here"
    summary = "Learned per-head attention temperature: q_h <- exp(tau_h) q_h, tau_h = 0 at init."
    starts_as_baseline = True  # exp(0) = 1: the conformance kit checks it

    @dataclass
    class Options:
        init: float = 0.0  # tau_h at init

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return HeadTemperature(c.n_heads, self.opts.init)

        spec.fill("attn.qk_post", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.n_layers * cfg.n_heads

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
