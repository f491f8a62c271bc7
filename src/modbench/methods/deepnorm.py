"""DeepNorm (DeepNet): Post-LN with an up-weighted residual and down-scaled initialisation.

Equation (docs/sources.md#deepnorm), for each sublayer F::

    x_{l+1} = N(alpha * x_l + F(x_l)),   alpha = (2 N)^(1/4)      (decoder-only, N = L blocks)

Init: after the generic N(0, init_std^2) draw, the weights of the value and output
projections and of all FFN matrices are multiplied by beta = (8 N)^(-1/4) (torchscale divides
``v_proj``, ``out_proj``, ``fc1``, ``fc2`` by (8N)^(1/4)); in the SwiGLU block that is W_v,
W_o, W_gate, W_up and W_down; W_q, W_k, the embedding and the head are left alone.
Norm gains 1.

Citation: Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers";
code microsoft/torchscale ``architecture/decoder.py`` (``deepnorm`` alpha and init scale).

Slots: ``placement`` (Post-LN: norms after each merge and the final norm, as ``post_ln``),
``merge`` (``alpha x + out``) and ``post_init`` (the beta scaling). Any norm type composes
(``deepnorm+layernorm`` is the published form). Combining with another placement or merge
(``mix_ln``, ``layerscale``) is refused by the slot rules. If a linear wrapper (CoMT) wraps
the projections, the wrapped plain linear is scaled.

Choices of our own: N is the number of decoder blocks L (torchscale's ``decoder_layers``);
the base init is the lab's plain normal (torchscale's is Xavier), so beta scales 0.02.
"All FFN matrices" are the linear layers the FFN core makes (roles ``gate``, ``up``, ``down``,
found through ``model.parts``): with a two-matrix FFN (``deepnorm+relu2``) that is W_up and
W_down. W_v, W_o and at least one FFN matrix must be linear layers with a ``weight`` in every
block; a method that replaces them (``deepnorm+tokenformer``'s Pattention) is refused.
Parameters and FLOPs: unchanged (the scalar alpha is a constant, not learned).
"""

from __future__ import annotations

from typing import NoReturn

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import inner_linear
from modbench.methods.base import Method, register
from modbench.methods.post_ln import post_ln_placement
from modbench.model.spec import ModelSpec, parts_of
from modbench.model.stream import StreamState

ATTN_SCALED = ("v", "o")  # linear roles scaled by beta; every block must have both
FFN_SCALED = ("gate", "up", "down")  # scaled where the FFN core made them (at least one)


def deepnorm_alpha(n_layers: int) -> float:
    return (2.0 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    return (8.0 * n_layers) ** -0.25


class ScaledResidualMerge(nn.Module):
    """``x' = alpha x + out`` with a constant alpha."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        return self.alpha * x + out

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.4f}"


def refuse_combination(what: str, layer: int) -> NoReturn:
    raise ModbenchError(
        f"deepnorm scales the {what} of every block at init, but block {layer} has no such "
        "linear layer (another method replaced it); these methods cannot be combined"
    )


def linear_weight(m: nn.Module | None, role: str, layer: int) -> torch.Tensor:
    """The weight of the plain linear layer inside ``m`` (under any linear wrappers)."""
    weight = getattr(inner_linear(m), "weight", None) if m is not None else None
    if not isinstance(weight, torch.Tensor):
        refuse_combination(f"W_{role} projection", layer)
    return weight


@register
class DeepNorm(Method):
    name = "deepnorm"
    category = "placement"
    citation = "Wang et al. 2022, DeepNet: Scaling Transformers to 1,000 Layers"
    summary = "Post-LN with x' = N(alpha x + F(x)), alpha=(2L)^1/4; W_v,W_o,FFN init x (8L)^-1/4."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        alpha = deepnorm_alpha(cfg.n_layers)

        def merge(c: ModelConfig, layer: int, sublayer: str) -> nn.Module:
            return ScaledResidualMerge(alpha)

        spec.fill("placement", post_ln_placement, by=self.name)
        spec.fill("merge", merge, by=self.name)

    @torch.no_grad()
    def post_init(self, model: nn.Module) -> None:
        parts = parts_of(model)
        cfg: ModelConfig = model.cfg  # type: ignore[assignment]
        n_layers = cfg.n_layers
        weights = []
        for i in range(n_layers):
            ffn = [r for r in FFN_SCALED if parts.has_linear(r, i)]
            for role in ATTN_SCALED:
                weights.append(linear_weight(parts.linear(role, i)
                                             if parts.has_linear(role, i) else None, role, i))
            if not ffn:
                refuse_combination("FFN projections (W_gate, W_up or W_down)", i)
            weights += [linear_weight(parts.linear(r, i), r, i) for r in ffn]
        beta = deepnorm_beta(n_layers)
        for w in weights:
            w.mul_(beta)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
