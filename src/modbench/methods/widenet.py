"""WideNet: one attention core and one mixture-of-experts FFN shared by every layer, with
individual (per-layer) norms.

Equations (Xue et al. 2022, Section "WideNet"), for layers l = 1 .. L::

    x' = x + Attn( N_l^attn(x) )            Attn:  one attention core for all L layers
    y  = x' + MoE( N_l^ffn(x') )            MoE:   one router and E experts for all L layers
    loss = l_main + lambda sum_{l=1..L} l_balance^l

The norms N_l (and the final norm) are each layer's own: "instead of sharing normalization
layers, we propose to use individual layernorms to transform various semantic
representations". The router is shared with the experts, but its assignments differ per
layer because its inputs do, so each of the L routing calls adds its own balance loss (the
sum above; ``methods/moe.py`` has the MoE layer, its gates and l_balance). With ``moe=false``
the shared FFN is the baseline SwiGLU (parameter sharing alone, ALBERT-style but with
individual norms).

Citation: Xue, Shi, Wei, Lou, Liu, You 2022, "Go Wider Instead of Deeper" (AAAI 2022,
arXiv 2107.11817).

Init: as the baseline and ``moe``: the shared cores are initialised once (N(0, init_std^2));
the per-layer norms start at one.

Implementation: the ``tie`` slot (docs/architecture.md, "Weight sharing across layers") maps
kind ``core`` of every layer to layer 0, and every linear layer and norm to its own layer:
layer 0 builds the attention and FFN cores, every later layer reuses those modules (one set of
parameters, counted and optimised once, its gradient the sum over the layers), and the
builder makes each layer's norms. The MoE core is ``moe``'s (``fill_moe``, same options and
logging callback).

Options: ``moe`` (default true, the paper's WideNet), ``experts`` (4), ``top_k`` (2),
``balance`` (0.01), the last three as in ``moe``.

Parameters over the baseline (the papers' count: one set of core weights, L sets of norms)::

    - (L - 1) (P_attn + 3 d d_ff)  +  [moe] ((E - 1) 3 d d_ff + d E)
    P_attn = d (H d_h) + 2 d (H_kv d_h) + (H d_h) d     (W_q, W_k, W_v, W_o)

Extra forward FLOPs per token: sharing changes none; with ``moe``, L ((k - 1) 6 d d_ff + 2 d E)
as for ``moe``.

Choices of our own: the paper's models are ViT / ALBERT encoders with LayerNorm and a GELU
MLP; here the shared cores are the decoder's (GQA attention with RoPE, SwiGLU experts) and the
per-layer norms are whatever the norm slot holds (RMSNorm at the baseline). The paper's
token dropping, router noise and renormalisation choices are ``moe``'s (documented there).
Anything a combined method puts *inside* a core (QK-Norm's norms, a gated-attention gate) is
shared with the core; what it puts outside (merges, norm wrappers) stays per layer.

Syntax: ``widenet``, ``widenet(moe=false)``, ``widenet(experts=8,top_k=1)``.
Slots: ``tie`` and, with ``moe``, ``ffn``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modbench.config import ModelConfig
from modbench.methods._common import block_projection_params
from modbench.methods.base import Method, register
from modbench.methods.moe import (
    BalanceLogging,
    MoEOptions,
    check_options,
    fill_moe,
    moe_extra_flops,
    moe_extra_params,
)
from modbench.model.spec import ModelSpec


def share_cores(kind: str, name: str, layer: int) -> int:
    """The tie plan: every layer's attention and FFN core is layer 0's; every linear layer
    and norm (made by the cores of layer 0, or at the norm sites) is its own layer's."""
    return 0 if kind == "core" else layer


@register
class WideNet(Method):
    name = "widenet"
    category = "architecture"
    citation = "Xue et al. 2022, Go Wider Instead of Deeper (AAAI 2022)"
    summary = ("One attention core and one MoE FFN shared by all layers, individual norms per "
               "layer; balance loss summed over the L routing calls.")
    stackable = False
    stack_note = ("its MoE dispatch reads the number of tokens per expert on the host, which a "
                  "vmapped forward cannot")
    compile_graph_breaks = ("MoE's dropless dispatch: each expert's token count is read on the "
                            "host (data-dependent split sizes)")

    @dataclass
    class Options:
        moe: bool = True  # the shared FFN is the mixture of experts (False: the baseline FFN)
        experts: int = 4
        top_k: int = 2
        balance: float = 0.01

    def moe_options(self) -> MoEOptions:
        return MoEOptions(experts=self.opts.experts, top_k=self.opts.top_k,
                          balance=self.opts.balance)

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        if self.opts.moe:
            fill_moe(spec, self.moe_options(), by=self.name)
        else:
            check_options(self.moe_options(), self.name)
        spec.fill("tie", share_cores, by=self.name)

    def callbacks(self) -> list[Any]:
        return [BalanceLogging()] if self.opts.moe else []

    def extra_params(self, cfg: ModelConfig) -> int:
        shared = -(cfg.n_layers - 1) * block_projection_params(cfg)
        return shared + (moe_extra_params(cfg, self.moe_options(), 1) if self.opts.moe else 0)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return moe_extra_flops(cfg, self.moe_options()) if self.opts.moe else 0.0
