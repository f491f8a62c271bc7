"""Scalable-Softmax (SSMax): logits scaled by s * log n, n the number of visible keys.

Equation (docs/sources.md#ssmax, arXiv 2605.20798 Appendix B.6)::

    SSMax(z)_j = n^(s z_j) / sum_j' n^(s z_j') = softmax((s_h log n) z)_j
    y_i = softmax(s_h log(i + 1) * q_i k^T / sqrt(d_h) + causal) v

In causal attention query i (0-based) sees n = i + 1 keys. Implemented as the paper says,
by multiplying the query (after RoPE) by ``s_h log(i + 1)`` and keeping the fused SDPA
kernel.

Citation: Nakanishi 2025, "Scalable-Softmax Is Superior for Attention" (arXiv 2501.19399).

Init: s_h = 1 / log(T_train) for every head (B.6: the scaling is 1 at the training length,
matching the baseline temperature there). Parameters: H per layer.
Extra FLOPs: 0 (an element-wise scaling of q).

Syntax: ``ssmax``, ``ssmax(init=0.43)`` (the paper's illustration value).

Choices of our own: T_train is the training sequence length ``train.seq_len`` (the model
config's ``trained_seq_len``; ``model.max_seq_len`` in a run folder written before that key
existed, as such a run trained); ``log n`` is computed in float32; position 0 gets scale 0
(log 1), a uniform softmax over its single key, which changes nothing. The optional bias variant
(s log n + b) of the paper is not implemented (the study does not use it). Slot:
``attn.qk_post``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext


class SSMaxQuery(nn.Module):
    """``q <- q * s_h * log(i + 1)``; keys unchanged."""

    def __init__(self, n_heads: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.s = nn.Parameter(torch.full((n_heads,), init))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.shape[-2]
        log_n = torch.log(torch.arange(1, t + 1, device=q.device, dtype=torch.float32))
        scale = self.s.float()[:, None] * log_n[None, :]  # (H, T)
        return q * scale[None, :, :, None].to(q.dtype), k

    def modbench_init(self) -> None:
        nn.init.constant_(self.s, self.init)

    def extra_repr(self) -> str:
        return f"heads={self.s.shape[0]}, init={self.init:.4f}"


@register
class SSMax(Method):
    name = "ssmax"
    category = "attention"
    citation = "Nakanishi 2025, Scalable-Softmax Is Superior for Attention"
    summary = "Logits times s_h log n (n = visible keys), per-head learnable s; SDPA kept."

    @dataclass
    class Options:
        init: float | None = None  # None: 1 / log(train.seq_len)

    def init_value(self, cfg: ModelConfig) -> float:
        if self.opts.init is not None:
            return float(self.opts.init)
        return 1.0 / math.log(max(cfg.trained_seq_len, 2))

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        init = self.init_value(cfg)

        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return SSMaxQuery(c.n_heads, init)

        spec.fill("attn.qk_post", factory, by=self.name)

    def reads_train_seq_len(self) -> bool:
        return self.opts.init is None

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.n_heads * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
