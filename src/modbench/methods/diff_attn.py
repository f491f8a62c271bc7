"""Differential Transformer: the difference of two softmax attention maps per head.

Equation (docs/sources.md#diff-attn, arXiv 2605.20798 Appendix B.7), layout of the official
``multihead_diffattn.py``: the baseline's H query heads of width d_h form H/2 differential
heads, q heads (2i, 2i+1) being the two halves of diff-head i; likewise the KV heads form
H_kv/2 pairs, and the values of a pair are concatenated to width 2 d_h::

    A_1 = softmax(q_{2i} k_{2j}^T / sqrt(d_h) + causal)
    A_2 = softmax(q_{2i+1} k_{2j+1}^T / sqrt(d_h) + causal)       j = KV pair of diff-head i
    lam = exp(lam_q1 . lam_k1) - exp(lam_q2 . lam_k2) + lam_init    (float32, per layer)
    O_i = (A_1 - lam A_2) [v_{2j} | v_{2j+1}]                        width 2 d_h
    O_i = RMSNorm_{2 d_h}(O_i) * (1 - lam_init)                      ("subln", gain shared)
    out = W_o concat_i O_i

Projections keep the baseline's shapes (B.7: q and k split into two halves per differential
head, v at full width), so the only new parameters are the four lambda vectors and the norm.

Citation: Ye et al. 2024, "Differential Transformer" (arXiv 2410.05258).

Init: lam_q1, lam_k1, lam_q2, lam_k2 ~ N(0, 0.1^2), shape (d_h,); lam_init = 0.8 - 0.6
exp(-0.3 l) with l the 0-based layer index (0.2 at layer 0); subln gain 1, eps 1e-5.
Parameters: 4 d_h + 2 d_h = 6 d_h per layer.
Extra FLOPs: the value mixing is at width 2 d_h for both maps: ``2 T d`` per token per layer
on top of the baseline's ``4 T d`` (scores unchanged).

Fast path: two SDPA calls (``SDPA(q_1, k_1, V)`` and ``SDPA(q_2, k_2, V)`` with values of
width 2 d_h), GQA-aware.

Choices of our own: with GQA, component 1 of a diff-head uses KV head 2j and component 2
uses KV head 2j+1 (the official code, indexing its repeated keys per q head, gives both
components the same key head when H/H_kv >= 2); H and H_kv must be even. The paper's
"use >= 8 differential heads" is advice, not enforced.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.norms import RMSNorm
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext


def lambda_init(layer: int) -> float:
    """The official depth schedule, ``layer`` 0-based."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


class DiffKernel(nn.Module):
    def __init__(self, head_dim: int, layer: int) -> None:
        super().__init__()
        self.lambda_init = lambda_init(layer)
        self.lambda_q1 = nn.Parameter(torch.zeros(head_dim))
        self.lambda_k1 = nn.Parameter(torch.zeros(head_dim))
        self.lambda_q2 = nn.Parameter(torch.zeros(head_dim))
        self.lambda_k2 = nn.Parameter(torch.zeros(head_dim))
        self.subln = RMSNorm(2 * head_dim, eps=1e-5)

    def modbench_init(self) -> None:
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=0.1)

    def lam(self) -> torch.Tensor:
        acc = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        l1 = torch.exp(torch.dot(self.lambda_q1.to(acc), self.lambda_k1.to(acc)))
        l2 = torch.exp(torch.dot(self.lambda_q2.to(acc), self.lambda_k2.to(acc)))
        return l1 - l2 + self.lambda_init

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        b, h, t, d = q.shape
        h_kv = k.shape[1]
        v2 = v.view(b, h_kv // 2, 2, t, d).transpose(2, 3).reshape(b, h_kv // 2, t, 2 * d)
        gqa = h != h_kv
        a1 = F.scaled_dot_product_attention(q[:, 0::2], k[:, 0::2], v2, is_causal=True,
                                            enable_gqa=gqa)
        a2 = F.scaled_dot_product_attention(q[:, 1::2], k[:, 1::2], v2, is_causal=True,
                                            enable_gqa=gqa)
        acc = torch.promote_types(a1.dtype, torch.float32)
        lam = self.lam().to(acc)
        o = (a1.to(acc) - lam * a2.to(acc)).to(a1.dtype)
        o = self.subln(o) * (1.0 - self.lambda_init)  # (B, H/2, T, 2 d_h)
        return o.view(b, h // 2, t, 2, d).transpose(2, 3).reshape(b, h, t, d)

    def extra_repr(self) -> str:
        return f"lambda_init={self.lambda_init:.4f}"


@register
class DiffAttention(Method):
    name = "diff_attn"
    category = "attention"
    citation = "Ye et al. 2024, Differential Transformer"
    summary = "Difference of two softmax maps per head, lambda reparameterised, per-head RMSNorm."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        if cfg.n_heads % 2 or cfg.n_kv_heads % 2:
            raise ModbenchError(
                f"diff_attn pairs heads: model.n_heads={cfg.n_heads} and "
                f"model.n_kv_heads={cfg.n_kv_heads} must both be even"
            )

        def factory(c: ModelConfig, layer: int) -> nn.Module:
            if c.n_heads % 2 or c.n_kv_heads % 2:  # a layer's own shape (the shape slot)
                raise ModbenchError(
                    f"diff_attn pairs heads, but layer {layer} has n_heads={c.n_heads} and "
                    f"n_kv_heads={c.n_kv_heads} under the shape slot; choose per-layer head "
                    "counts that are even")
            return DiffKernel(c.head_dim, layer)

        spec.fill("attn.kernel", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 6 * cfg.head_dim * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(2 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers)
