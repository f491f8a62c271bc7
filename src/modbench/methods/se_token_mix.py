"""SE + token mixing decoder layer: adaptive RMSNorm, causal depthwise token mixing before
attention, and causal squeeze-and-excitation on the MLP output.

Equations (docs/sources.md#se-token-mix; our causal reading of the model card), per block,
positions t::

    norm:   N(x)_t = g (1 + tanh(W_c c_t)) x_hat_t,  c_t = mean_{s<=t} x_hat_s   (adaptive
            RMSNorm, the ``adaptive_rmsnorm`` module, at every norm site)
    mix:    u_t = h_t + sum_{j=0}^{k-1} w_j (.) h_{t-k+1+j}      h = N(x), h_{<1} = 0
            (depthwise Conv1d, groups = d, left padding k - 1, kernel k = ``kernel``,
            weight of Conv1d's shape (d, 1, k))
    attn:   x' = x + Attn(u)
    MLP:    y = MLP(N(x'))                                        (post-attention norm)
    SE:     p_t = (1/t) sum_{s<=t} y_s                            (causal mean pool)
            y'_t = y_t (.) gate(W_2 ReLU(W_1 p_t)),  W_1: d -> d/r,  W_2: d/r -> d
            gate(z) = 2 sigmoid(z) (``gate=sigmoid``) or 1 + tanh(z) (``gate=tanh``)
    out:    x'' = x' + y'

Citation: the Hugging Face model card ``Josephgflowers/Liquid-Metal-Tinyllama-Test-1``
(the model card: ``ModifiedLlamaDecoderLayer``: "Adaptive RMSNorm" -> "Token Mixing" (a
depthwise convolution across tokens) -> attention and "Post-Attention Adaptive RMSNorm" ->
MLP -> "SEBlock" (channel recalibration ``x * sigma(W_2 ReLU(W_1 pool(x)))``)); its script is
not public and there is no paper. Squeeze-and-excitation: Hu, Shen, Sun 2018.

Init: identity at initialisation, so the model equals the baseline Llama block (up to the
weights the extra parts draw): the adaptive norms have W_c = 0 (RMSNorm), the token-mixing
kernel is zero in the residual form ``h + conv(h)``, and W_2 = 0 so the SE gate is
2 sigmoid(0) = 1 + tanh(0) = 1; W_1 ~ N(0, init_std^2). The mixing kernel, W_1 and W_2 are
plain parameters drawn in the component pass, after the generic pass, so
``se_token_mix(norm=false)`` has exactly the baseline's weights at a given seed, plus its own.
All three parts still get gradients at init (the kernel's and W_2's are non-zero; W_1's once
W_2 has moved).

Parts (each usable alone; all default on): ``norm`` fills the ``norm`` slot with the
``adaptive_rmsnorm`` module under that method's key, so ``se_token_mix+adaptive_rmsnorm`` is
allowed (the same component) and equals ``se_token_mix``; ``mix`` is a ``norm_wrappers``
wrapper at site ``attn.pre`` (after the attention input norm, before attention); ``se`` is a
``norm_wrappers`` wrapper at site ``ffn.post`` (the MLP output, before the residual add).
The card's post-attention norm is Llama's FFN input norm (site ``ffn.pre``). Under another
placement the wrappers stay at the same sites (wrapping whatever is there, Identity
included).

Parameters over the baseline (L layers, k = kernel, h = max(1, d // r)): norm
(2 L + 1) d^2 (one d x d context map per norm of the baseline placement, the final norm
included); mix L d k; SE L 2 d h. FLOPs per token (forward, matmuls only, 2 per
multiply-add): norm (2 L + 1) 2 d^2; SE L 4 d h; mix 0: a depthwise convolution is
element-wise per channel (d k multiply-adds per token and layer, like a norm's), computed as
k shifted multiply-adds and, like the cumulative-sum pools, not counted. (Through
``F.conv1d`` the FLOP counter would count its weight gradient as a full, ungrouped
convolution, d times too much.)

Choices of our own (nothing public settles them): every "global" pool is causal (the mean of
positions 1..t), so no output depends on a later token, in training mode too; the token mixer
is a residual form with a zero kernel (identity at init; weight decay pulls it towards the
identity, not towards a zero input) and has no bias; the SE block has no biases, pools the
SE input itself, uses h = max(1, d // r) hidden units, computes its pool and gate in at least
float32, and scales the MLP output (the branch), not the whole residual stream; the adaptive
norm is also the final norm (the ``norm`` slot's reach, as ``adaptive_rmsnorm``). Options:
``norm``, ``mix``, ``se`` (true), ``kernel`` (3), ``reduction`` (16), ``gate`` (``sigmoid``
for 2 sigmoid, ``tanh`` for 1 + tanh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import baseline_norm_count
from modbench.methods.adaptive_rmsnorm import AdaptiveRMSNormLayer
from modbench.methods.base import Method, option_choice, register
from modbench.model.spec import ModelSpec

GATES = ("sigmoid", "tanh")
MIX_SITE, SE_SITE = "attn.pre", "ffn.post"
ADAPTIVE_KEY = "adaptive_rmsnorm"  # the key adaptive_rmsnorm fills the norm slot with


def causal_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over positions 1..t for each t, along dimension -2 of (..., T, d)."""
    t = x.shape[-2]
    counts = torch.arange(1, t + 1, device=x.device, dtype=x.dtype).unsqueeze(-1)
    return x.cumsum(dim=-2) / counts


class CausalTokenMix(nn.Module):
    """``h + DWConv(h)`` after ``inner`` (h = inner(x)), the depthwise convolution left-padded
    by k - 1 so that position t sees positions t - k + 1 .. t only."""

    def __init__(self, inner: nn.Module, dim: int, kernel: int) -> None:
        super().__init__()
        self.inner = inner
        self.kernel = kernel
        self.mix_kernel = nn.Parameter(torch.zeros(dim, 1, kernel))  # Conv1d(groups=d) layout

    def modbench_init(self) -> None:
        nn.init.zeros_(self.mix_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        t, k = h.shape[-2], self.kernel
        hp = F.pad(h, (0, 0, k - 1, 0))  # (..., k - 1 + T, d): k - 1 zero rows in front
        w = self.mix_kernel.to(h.dtype)
        # Conv1d(groups=d) as k shifted multiply-adds: tap j meets position t - k + 1 + j
        y = h
        for j in range(k):
            y = y + hp[..., j : j + t, :] * w[:, 0, j]
        return y

    def extra_repr(self) -> str:
        return f"{self.mix_kernel.shape[0]}, kernel={self.kernel}, causal"


class CausalSE(nn.Module):
    """``y * gate(W_2 ReLU(W_1 p_t))`` after ``inner`` (y = inner(x)), p_t the causal mean."""

    def __init__(self, inner: nn.Module, dim: int, hidden: int, gate: str,
                 init_std: float) -> None:
        super().__init__()
        self.inner = inner
        self.gate, self.init_std = gate, init_std
        self.squeeze = nn.Parameter(torch.empty(hidden, dim))  # W_1
        self.excite = nn.Parameter(torch.zeros(dim, hidden))  # W_2, zero: gate 1 at init

    def modbench_init(self) -> None:
        nn.init.normal_(self.squeeze, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.excite)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        yf = y.to(torch.promote_types(y.dtype, torch.float32))
        p = causal_mean(yf)
        z = F.linear(F.relu(F.linear(p, self.squeeze.to(p.dtype))), self.excite.to(p.dtype))
        z = z.to(yf.dtype)
        g = 2.0 * torch.sigmoid(z) if self.gate == "sigmoid" else 1.0 + torch.tanh(z)
        return (yf * g).to(y.dtype)

    def extra_repr(self) -> str:
        return f"{self.excite.shape[0]} -> {self.squeeze.shape[0]}, gate={self.gate}, causal"


@register
class SETokenMix(Method):
    name = "se_token_mix"
    category = "architecture"
    citation = ("Josephgflowers/Liquid-Metal-Tinyllama-Test-1 model card (Hugging Face); "
                "Hu et al. 2018, Squeeze-and-Excitation Networks")
    summary = ("Adaptive RMSNorm, causal depthwise token mixing before attention, causal SE "
               "gate on the MLP output; identity at init.")

    @dataclass
    class Options:
        norm: bool = True  # adaptive RMSNorm at every norm site
        mix: bool = True  # causal depthwise token mixing before attention
        se: bool = True  # causal squeeze-and-excitation on the MLP output
        kernel: int = 3  # token-mixing kernel size k
        reduction: int = 16  # SE reduction r (hidden = max(1, d // r))
        gate: str = "sigmoid"  # sigmoid: 2 sigmoid(z) | tanh: 1 + tanh(z)

    def _check(self) -> None:
        o = self.opts
        if not (o.norm or o.mix or o.se):
            raise ModbenchError(
                "se_token_mix with norm, mix and se all false is the baseline; enable at "
                "least one part (e.g. se_token_mix(mix=false))"
            )
        if o.kernel < 1:
            raise ModbenchError(f"option kernel={o.kernel} of method 'se_token_mix' must be >= 1")
        if o.reduction < 1:
            raise ModbenchError(
                f"option reduction={o.reduction} of method 'se_token_mix' must be >= 1"
            )
        option_choice(self.name, "gate", o.gate, GATES)

    @staticmethod
    def hidden(cfg: ModelConfig, reduction: int) -> int:
        return max(1, cfg.d_model // reduction)

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        self._check()
        o = self.opts
        if o.norm:
            def norm(dim: int, eps: float, site: str, layer: int) -> nn.Module:
                return AdaptiveRMSNormLayer(dim, eps)

            spec.fill("norm", norm, by=self.name, key=ADAPTIVE_KEY)
        hidden, gate, kernel = self.hidden(cfg, o.reduction), o.gate, o.kernel

        def wrap(module: nn.Module, site: str, layer: int, c: Any) -> nn.Module:
            if o.mix and site == MIX_SITE:
                return CausalTokenMix(module, c.d_model, kernel)
            if o.se and site == SE_SITE:
                return CausalSE(module, c.d_model, hidden, gate, c.init_std)
            return module

        if o.mix or o.se:
            spec.add("norm_wrappers", wrap, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        o, d, n = self.opts, cfg.d_model, cfg.n_layers
        total = baseline_norm_count(cfg) * d * d if o.norm else 0
        total += n * d * o.kernel if o.mix else 0
        total += n * 2 * d * self.hidden(cfg, o.reduction) if o.se else 0
        return total

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        o, d, n = self.opts, cfg.d_model, cfg.n_layers
        total = baseline_norm_count(cfg) * 2 * d * d if o.norm else 0
        total += n * 4 * d * self.hidden(cfg, o.reduction) if o.se else 0
        return float(total)
