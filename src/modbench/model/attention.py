"""The attention core: projections from the linear factory, slots for every variable piece,
and two kernels, the fused fast path and an explicit-score path.

Data flow of :class:`Attention` (shapes ``B`` batch, ``T`` time, ``H``/``H_kv`` heads)::

    q, k, v = W_q x, W_k x, W_v x          -> (B, H, T, d_h), (B, H_kv, T, d_h) x2
    q, k    = q_norm(q), k_norm(k)         slot attn.q_norm / attn.k_norm (Identity)
    q, k    = RoPE(q), RoPE(k)
    q, k    = qk_post(q, k, ctx)           slot attn.qk_post (pass-through)
    v       = v_path(v, ctx)               slot attn.v_path (pass-through)
    y       = kernel(q, k, v, ctx)         slot attn.kernel (causal softmax via SDPA)
    y       = out_gate(y, x)               slot attn.out_gate (pass-through)
    return W_o concat_heads(y)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.model.rope import apply_rope
from modbench.model.spec import Builder
from modbench.model.stream import ForwardContext


class PassQK(nn.Module):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class PassV(nn.Module):
    def forward(self, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return v


class PassGate(nn.Module):
    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y


class SDPAKernel(nn.Module):
    """Fast path: causal softmax attention through ``scaled_dot_product_attention`` (GQA-aware).

    ``scale`` defaults to ``1/sqrt(d_h)``.
    """

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa
        )


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, d) -> (B, H_kv * n_rep, T, d), each KV head serving n_rep query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """Boolean (T_q, T_k) mask, True where the key is visible (key index <= query index)."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(t_k - t_q)


class ExplicitKernel(nn.Module):
    """Explicit-score path: materialises the ``(B, H, T, T)`` logits in float32.

    Subclasses override :meth:`score` (transform the scaled logits, e.g. soft-capping) and/or
    :meth:`weights` (turn masked logits into mixing weights, e.g. sigmoid or softpick). With
    the defaults it computes exactly causal softmax attention, equal to :class:`SDPAKernel`.
    """

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale

    def score(self, logits: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return logits

    def weights(
        self, logits: torch.Tensor, mask: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)
        logits = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
        w = self.weights(self.score(logits, ctx), mask, ctx)
        return torch.matmul(w.to(v.dtype), v)


def sdpa_kernel_factory(cfg: ModelConfig, layer: int) -> nn.Module:
    return SDPAKernel()


class Attention(nn.Module):
    """Multi-head causal self-attention with GQA and RoPE; every variable piece is a slot."""

    def __init__(self, cfg: ModelConfig, build: Builder, layer: int) -> None:
        super().__init__()
        d, h, h_kv, d_h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, h_kv, d_h
        self.q_proj = build.linear("q", d, h * d_h, layer)
        self.k_proj = build.linear("k", d, h_kv * d_h, layer)
        self.v_proj = build.linear("v", d, h_kv * d_h, layer)
        self.o_proj = build.linear("o", h * d_h, d, layer)
        self.q_norm = build.optional("attn.q_norm", nn.Identity, cfg, layer)
        self.k_norm = build.optional("attn.k_norm", nn.Identity, cfg, layer)
        self.qk_post = build.optional("attn.qk_post", PassQK, cfg, layer)
        self.v_path = build.optional("attn.v_path", PassV, cfg, layer)
        self.kernel = build.slot("attn.kernel", cfg, layer)
        self.out_gate = build.optional("attn.out_gate", PassGate, cfg, build, layer)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        q, k = self.qk_post(q, k, ctx)
        v = self.v_path(v, ctx)
        y = self.kernel(q, k, v, ctx)
        y = self.out_gate(y, x)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def attention_factory(cfg: ModelConfig, build: Builder, layer: int) -> nn.Module:
    return Attention(cfg, build, layer)
