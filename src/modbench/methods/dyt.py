"""Dynamic Tanh (DyT): an element-wise replacement for the norm layers.

Equation (docs/sources.md#dyt)::

    DyT(x) = g * tanh(alpha * x) (+ b)      alpha a learnable scalar per norm, g (b) in R^d

Citation: Zhu, Chen, He, LeCun, Liu 2025, "Transformers without Normalization"
(arXiv 2503.10622); code jiachenzhu/DyT (``dynamic_tanh.py``, LLaMA ``fms_fsdp`` model).

Init: g = 1, b = 0; alpha = ``alpha_attn`` at the attention-input sites (``attn.pre``) and
``alpha_other`` everywhere else (FFN input, final, and any other site a placement enables).
Both default to the paper's generic 0.5; the LLaMA code uses 0.8 / 0.2 at 7B, 0.6 / 0.15 at
13B, 0.2 / 0.05 at 34B-70B (``dyt(alpha_attn=0.8,alpha_other=0.2)``).

Slots: ``norm`` (composes with every placement: ``post_ln+dyt`` puts DyT after each merge).
The LLaMA recipe also multiplies the embedding output by a learnable scalar initialised to
sqrt(d) (``shared_scale``); ``embed_scale=true`` (default) does the same through the additive
``norm_wrappers`` slot at the ``embed`` site (before the embedding norm, if a placement has
one). Without it the tiny CPU models barely train: N(0, 0.02^2) embeddings pass through
tanh(0.5 x) as ~0.01-sized signals.

Choices of our own: the LLaMA variant has no bias, so ``bias`` defaults to false.
Parameters over the baseline, counted for the baseline placement (2 L + 1 norms): + 1 per
norm (alpha), + d per norm with ``bias=true``, + 1 for the embedding scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods._common import baseline_norm_count
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec


class DynamicTanh(nn.Module):
    def __init__(self, dim: int, alpha: float, bias: bool = False) -> None:
        super().__init__()
        self.alpha0 = alpha
        self.alpha = nn.Parameter(torch.full((), alpha))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = torch.tanh(self.alpha.to(xf.dtype) * xf) * self.weight.to(xf.dtype)
        if self.bias is not None:
            y = y + self.bias.to(xf.dtype)
        return y.to(x.dtype)

    def modbench_init(self) -> None:
        nn.init.constant_(self.alpha, self.alpha0)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, alpha0={self.alpha0}, bias={self.bias is not None}"


class EmbedScale(nn.Module):
    """``module(s * x)`` with a learnable scalar ``s`` (init sqrt(d))."""

    def __init__(self, module: nn.Module, dim: int) -> None:
        super().__init__()
        self.module = module
        self.init = math.sqrt(dim)
        self.scale = nn.Parameter(torch.full((), self.init))

    def modbench_init(self) -> None:
        nn.init.constant_(self.scale, self.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x * self.scale.to(x.dtype))


@register
class DyT(Method):
    name = "dyt"
    category = "norm"
    citation = "Zhu, Chen, He, LeCun, Liu 2025, Transformers without Normalization"
    summary = "Dynamic Tanh g * tanh(alpha x) in place of every norm (alpha a learnable scalar)."

    @dataclass
    class Options:
        alpha_attn: float = 0.5  # alpha init at attention-input norms
        alpha_other: float = 0.5  # alpha init at every other norm
        bias: bool = False
        embed_scale: bool = True  # learnable scalar on the embedding output, init sqrt(d)

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        o = self.opts

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            alpha = o.alpha_attn if site == "attn.pre" else o.alpha_other
            return DynamicTanh(dim, alpha, o.bias)

        spec.fill("norm", factory, by=self.name, key=("dyt", o.alpha_attn, o.alpha_other, o.bias))
        if o.embed_scale:

            def wrap(module: nn.Module, site: str, layer: int, c: Any) -> nn.Module:
                return EmbedScale(module, c.d_model) if site == "embed" else module

            spec.add("norm_wrappers", wrap, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        per_norm = 1 + (cfg.d_model if self.opts.bias else 0)  # alpha (+ b); g replaces the gain
        return baseline_norm_count(cfg) * per_norm + (1 if self.opts.embed_scale else 0)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # element-wise
