"""QK-Norm: RMSNorm on queries and keys before RoPE.

Equation (docs/sources.md#qknorm, arXiv 2605.20798 Appendix B.3)::

    q = N_q(x W_q),  k = N_k(x W_k),  then RoPE,  then softmax(q k^T / sqrt(d_h)) v

Citation: Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters";
Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities".

Two variants (option ``scope``):

- ``head`` (default; Qwen3 and the gated-attention code): RMSNorm over d_h, one gain vector
  shared by all heads, applied to the ``(B, H, T, d_h)`` tensors. Parameters: 2 d_h per layer.
- ``full`` (OLMo-2): RMSNorm over the whole projection, H d_h for q and H_kv d_h for k,
  before the split into heads. Parameters: (H + H_kv) d_h per layer.

Init: gains 1; the 1/sqrt(d_h) softmax scale is kept. With GQA the key norm acts on the
KV heads. The fast SDPA path is unchanged. Slots: ``attn.q_norm`` and ``attn.k_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, option_choice, register
from modbench.model.norms import RMSNorm
from modbench.model.spec import ModelSpec


class FullProjectionNorm(nn.Module):
    """RMSNorm over all heads of a ``(B, H, T, d_h)`` tensor at once."""

    def __init__(self, n_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(n_heads * head_dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, t, d = x.shape
        y = self.norm(x.transpose(1, 2).reshape(b, t, h * d))
        return y.view(b, t, h, d).transpose(1, 2)


@register
class QKNorm(Method):
    name = "qknorm"
    category = "attention"
    citation = ("Dehghani et al. 2023, Scaling Vision Transformers to 22B Parameters; "
                "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer "
                "training instabilities")
    summary = "RMSNorm on queries and keys (per head, before RoPE) to bound attention logits."

    @dataclass
    class Options:
        scope: str = "head"  # head | full

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        scope = option_choice(self.name, "scope", self.opts.scope, ("head", "full"))

        def q_norm(c: ModelConfig, layer: int) -> nn.Module:
            if scope == "head":
                return RMSNorm(c.head_dim, c.norm_eps)
            return FullProjectionNorm(c.n_heads, c.head_dim, c.norm_eps)

        def k_norm(c: ModelConfig, layer: int) -> nn.Module:
            if scope == "head":
                return RMSNorm(c.head_dim, c.norm_eps)
            return FullProjectionNorm(c.n_kv_heads, c.head_dim, c.norm_eps)

        key = f"rmsnorm-{scope}"
        spec.fill("attn.q_norm", q_norm, by=self.name, key=key)
        spec.fill("attn.k_norm", k_norm, by=self.name, key=key)

    def extra_params(self, cfg: ModelConfig) -> int:
        if self.opts.scope == "head":
            return 2 * cfg.head_dim * cfg.n_layers
        return (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # norms are element-wise
