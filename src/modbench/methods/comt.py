"""CoMT / Transponder: token-wise contextual modulators on the linear projections.

Equation (docs/sources.md#comt), for each modulated linear layer y = W x::

    y' = m(x) * y,    m(x) = 2 sigmoid(W_2 silu(W_1 x))
    W_1: d_in -> hidden,   W_2: hidden -> d_out   (per token and per output channel)

Citation: CoMT, preprints.org 202506.0120 (v1 "CoMT", v2 "Transponder"; OpenReview
GJ9gHw8kan); Tables 3-5 of the preprint's v1.

Init: W_2 = 0, so m(x) = 2 sigmoid(0) = 1 and the modulated model equals the unmodulated one
at initialisation; W_1 ~ N(0, init_std^2). The modulator weights are plain parameters drawn
in the component pass (``modbench_init``) *after* the generic pass, so a ``comt`` model at a
given seed has exactly the baseline's weights (same seed, same draws) plus its modulators.

Options: ``modules`` (the preprint's Table 4): ``all`` (q k v o gate up down), ``self_attention``
(q k v o; ``self-attention`` is accepted), ``mlp`` (gate up down), ``only_first`` (q k v gate
up), ``only_last`` (o down), ``only_qk`` (q k); ``hidden`` (Table 5): the modulator width,
2 by default (4, 8, 16, 32 in the ablation). The LM head is never modulated.

Choices of our own (no code or exact equation is public; an unverified reading): the
modulator reads the projection's input x; SiLU between the two maps; no biases; the gate
2 sigmoid(.) (range (0, 2)); channel-wise output (``hidden -> d_out``), since the paper
rescales "at token and channel granularity".

Slots: the additive ``linear_wrappers`` slot (composes with any placement and norm type:
``post_ln+comt``). Parameters: hidden (d_in + d_out) per modulated projection per layer.
FLOPs: 2 hidden (d_in + d_out) per token per modulated projection (two small matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import unreached_sublayer
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec

MODULE_ROLES: dict[str, tuple[str, ...]] = {
    "all": ("q", "k", "v", "o", "gate", "up", "down"),
    "self_attention": ("q", "k", "v", "o"),
    "mlp": ("gate", "up", "down"),
    "only_first": ("q", "k", "v", "gate", "up"),
    "only_last": ("o", "down"),
    "only_qk": ("q", "k"),
}


def _modules(value: str) -> str:
    v = value.replace("-", "_")
    if v not in MODULE_ROLES:
        raise ModbenchError(
            f"option modules={value!r} of method 'comt' must be one of: {', '.join(MODULE_ROLES)}"
        )
    return v


class ModulatedLinear(nn.Module):
    """``m(x) * inner(x)`` with ``m(x) = 2 sigmoid(W_2 silu(W_1 x))``."""

    def __init__(self, inner: nn.Module, d_in: int, d_out: int, hidden: int,
                 init_std: float) -> None:
        super().__init__()
        self.inner = inner
        self.init_std = init_std
        self.mod_in = nn.Parameter(torch.empty(hidden, d_in))
        self.mod_out = nn.Parameter(torch.zeros(d_out, hidden))

    def modbench_init(self) -> None:
        nn.init.normal_(self.mod_in, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.mod_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        h = F.silu(F.linear(x, self.mod_in.to(x.dtype)))
        m = 2.0 * torch.sigmoid(F.linear(h, self.mod_out.to(h.dtype)))
        return m.to(y.dtype) * y

    def extra_repr(self) -> str:
        return f"hidden={self.mod_in.shape[0]}"


@register
class CoMT(Method):
    name = "comt"
    category = "architecture"
    citation = ("CoMT / Transponder: contextual modulation of Transformer sublayers, "
                "preprints.org 202506.0120 (OpenReview GJ9gHw8kan)")
    summary = "Token- and channel-wise modulators m(x) = 2 sigmoid(W2 silu(W1 x)) on projections."
    starts_as_baseline = True

    @dataclass
    class Options:
        modules: str = "all"  # all | self_attention | mlp | only_first | only_last | only_qk
        hidden: int = 2  # modulator hidden width

    def _roles(self) -> tuple[str, ...]:
        return MODULE_ROLES[_modules(self.opts.modules)]

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        roles, hidden = self._roles(), self.opts.hidden
        if hidden < 1:
            raise ModbenchError(f"option hidden={hidden} of method 'comt' must be >= 1")

        def wrap(module: nn.Module, role: str, d_in: int, d_out: int, layer: int,
                 c: ModelConfig) -> nn.Module:
            if role not in roles:
                return module
            return ModulatedLinear(module, d_in, d_out, hidden, c.init_std)

        spec.add("linear_wrappers", wrap, by=self.name)

    def post_init(self, model: nn.Module) -> None:
        """Refuse a combination that leaves a sublayer ``modules`` names unmodulated: a core
        that makes its projections itself (``moe``'s experts, TokenFormer's Pattention) is
        never wrapped, so ``comt(modules=mlp)+moe`` would train the plain model."""
        missed = unreached_sublayer(model, self._roles())
        if missed is not None:
            layer, sublayer, wanted = missed
            raise ModbenchError(
                f"comt(modules={self.opts.modules}) modulates the {sublayer}'s "
                f"{'/'.join(wanted)} projections, but block {layer}'s {sublayer} has none "
                "made through the linear slot (another method builds them itself); these "
                "methods cannot be combined, or choose modules="
                + ("self_attention" if sublayer == "FFN" else "mlp"))

    def _widths(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        d, dh = cfg.d_model, cfg.head_dim
        return {"q": (d, cfg.n_heads * dh), "k": (d, cfg.n_kv_heads * dh),
                "v": (d, cfg.n_kv_heads * dh), "o": (cfg.n_heads * dh, d),
                "gate": (d, cfg.d_ff), "up": (d, cfg.d_ff), "down": (cfg.d_ff, d)}

    def extra_params(self, cfg: ModelConfig) -> int:
        w = self._widths(cfg)
        per_layer = sum(self.opts.hidden * sum(w[r]) for r in self._roles())
        return per_layer * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 2.0 * self.extra_params(cfg)
