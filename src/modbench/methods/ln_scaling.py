"""LayerNorm Scaling ("The Curse of Depth"): scale each sublayer's normalised input by 1/sqrt(l).

Equation (docs/sources.md#ln-scaling), Pre-LN with l = layer index + 1 (1-based)::

    h = x + Attn(N(x) / sqrt(l)),   y = h + FFN(N(h) / sqrt(l))

The final norm is unchanged.

Citation: Sun et al. 2025, "The Curse of Depth in Large Language Models" (arXiv 2502.05795);
code lmsdss/LayerNorm-Scaling (``norm_type == 'LNS'``).

Init: nothing changes; the README warns against combining it with depth-scaled init, and the
lab's init is plain N(0, init_std^2).

Slots: the additive ``norm_wrappers`` slot: the norm at ``attn.pre`` and ``ffn.pre`` of
layer l is wrapped by a constant multiplication with 1/sqrt(l). It composes with any norm
type and with placements that have input norms (``sandwich``, ``peri_ln``, ``mix_ln``: only
its Pre-LN layers are scaled, at their absolute depth). A placement without any input norm
(``post_ln``, ``deepnorm``, ``hybrid_norm``) is refused: there is no normalised input to
scale. Parameters and FLOPs: unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec

PRE_SITES = ("attn.pre", "ffn.pre")


class ScaledNorm(nn.Module):
    """``norm(x) * scale`` with a constant scale."""

    def __init__(self, norm: nn.Module, scale: float) -> None:
        super().__init__()
        self.norm = norm
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4f}"


def ln_scale(layer: int) -> float:
    """1/sqrt(l) for 0-based ``layer`` (l = layer + 1)."""
    return 1.0 / math.sqrt(layer + 1)


@register
class LNScaling(Method):
    name = "ln_scaling"
    category = "placement"
    citation = "Sun et al. 2025, The Curse of Depth in Large Language Models"
    summary = "LayerNorm Scaling: each sublayer's input norm output is scaled by 1/sqrt(l)."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def wrap(module: nn.Module, site: str, layer: int, c: Any) -> nn.Module:
            if site not in PRE_SITES:
                return module
            placement = spec.get("placement")
            if not any(placement(s, i, c.n_layers) for i in range(c.n_layers)
                       for s in PRE_SITES):
                raise ModbenchError(
                    f"ln_scaling scales the output of each sublayer's input norm (Pre-LN), but "
                    f"the placement of '{spec.owner('placement')}' has no input norms; "
                    "combine it with a pre-norm placement (baseline, sandwich, peri_ln, mix_ln)"
                )
            if isinstance(module, nn.Identity):
                return module  # e.g. a Post-LN layer of Mix-LN
            return ScaledNorm(module, ln_scale(layer))

        spec.add("norm_wrappers", wrap, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
