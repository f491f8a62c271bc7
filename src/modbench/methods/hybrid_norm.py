"""HybridNorm: QKV-normalised attention without an input norm, Post-LN around the FFN.

Equations (docs/sources.md#hybrid-norm)::

    attention:  x' = x + Attn_QKV(x),   q, k, v = N_h(x W_q), N_h(x W_k), N_h(x W_v)
                                         (per-head RMSNorm over d_h, then RoPE on q and k)
    FFN:        y  = N(x') + FFN(N(x'))  (post-norm, residual taken after the norm)

The FFN form is the ``attn.residual`` norm site: the stream after the attention merge is
normalised, and that normalised value is both the FFN input and its residual. The final
norm is kept. ``hybrid_norm_star`` (HybridNorm*) makes block 0 a full Pre-Norm block,
``x' = x + Attn_QKV(N(x)); y = x' + FFN(N(x'))``, as in the code's
``norm_pos_special_config "_{0:{'attn_norm':True,'ffn_residual':False}}_"``.

Citation: Zhuo et al. 2025, "HybridNorm: Towards Stable and Efficient Transformer Training
via Hybrid Normalization" (arXiv 2503.04598); code BryceZhuo/HybridNorm (OLMo config
``attn_norm: false, use_query_norm/use_key_norm/use_value_norm: true, ffn_norm: true,
ffn_residual_after_norm: true``).

Option ``form``: ``zhuo`` (the default, the form above) or ``seed002``, the form seed 002
trains and describes (its Appendix B.15: "the attention block uses Pre-LN (RMSNorm before
projection, residual add after), while the FFN block uses Post-LN (RMSNorm after residual
add)")::

    x' = x + Attn(N(x));   y = N(x' + FFN(x'))

with no q/k/v norms and the final norm kept (as ``post_ln`` keeps it); parameters as the
baseline (two d-wide norms per block). ``hybrid_norm_star`` has no seed-002 form.

Init: gains 1, weights as the baseline.

Slots: ``placement``; ``attn.q_norm`` and ``attn.k_norm`` with the same per-head RMSNorm as
``qknorm`` (same key ``rmsnorm-head``, so ``hybrid_norm+qknorm`` is allowed and adds
nothing); ``attn.v_path`` with a per-head RMSNorm on the values (block 0 of HybridNorm*
keeps its QKV norms). Choice of our own: the per-head q/k/v norms are always RMSNorm (as in
the paper and ``qknorm``); the ``norm`` slot's type (``hybrid_norm+layernorm``) applies to
the block-level sites. Parameters over the baseline: 3 d_h - d per layer (q, k, v gains;
one d-wide norm per block instead of two), and + d for HybridNorm* (its block 0 has two
input norms instead of the ``attn.residual`` one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.norms import RMSNorm
from modbench.model.spec import ModelSpec, Placement
from modbench.model.stream import ForwardContext


class HeadValueNorm(nn.Module):
    """The ``attn.v_path`` component: per-head RMSNorm of the values ``(B, H_kv, T, d_h)``."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.norm(v)


def hybrid_placement(star: bool) -> Placement:
    def placement(site: str, layer: int, n_layers: int) -> bool:
        if site == "final":
            return True
        if star and layer == 0:
            return site in ("attn.pre", "ffn.pre")
        return site == "attn.residual"

    return placement


SEED002_SITES = ("attn.pre", "ffn.residual", "final")
FORMS = ("zhuo", "seed002")


def seed002_placement(site: str, layer: int, n_layers: int) -> bool:
    return site in SEED002_SITES


def head_norm(c: ModelConfig, layer: int) -> nn.Module:
    return RMSNorm(c.head_dim, c.norm_eps)


def value_norm(c: ModelConfig, layer: int) -> nn.Module:
    return HeadValueNorm(c.head_dim, c.norm_eps)


@register
class HybridNorm(Method):
    name = "hybrid_norm"
    category = "placement"
    citation = ("Zhuo et al. 2025, HybridNorm: Towards Stable and Efficient Transformer "
                "Training via Hybrid Normalization")
    summary = "QKV-norm attention without input norm; FFN post-norm with residual after the norm."
    star = False

    @dataclass
    class Options:
        form: str = "zhuo"  # zhuo (Zhuo et al.'s code) | seed002 (seed 002's Appendix B.15)

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        if self.opts.form not in FORMS:
            raise ModbenchError(f"option form={self.opts.form!r} of method '{self.name}' must "
                                f"be one of {', '.join(FORMS)}")
        if self.opts.form == "seed002":
            if self.star:
                raise ModbenchError("hybrid_norm_star has no seed002 form; use "
                                    "hybrid_norm(form=seed002)")
            spec.fill("placement", seed002_placement, by=self.name)
            return
        spec.fill("placement", hybrid_placement(self.star), by=self.name)
        spec.fill("attn.q_norm", head_norm, by=self.name, key="rmsnorm-head")
        spec.fill("attn.k_norm", head_norm, by=self.name, key="rmsnorm-head")
        spec.fill("attn.v_path", value_norm, by=self.name, key="rmsnorm-head-v")

    def extra_params(self, cfg: ModelConfig) -> int:
        # baseline: 2 d per layer; HybridNorm: d (attn.residual) + 3 d_h per layer; the
        # seed-002 form: 2 d per layer (attn.pre, ffn.residual), as the baseline
        if self.opts.form == "seed002":
            return 0
        per_layer = 3 * cfg.head_dim - cfg.d_model
        star = cfg.d_model if self.star else 0  # block 0: two input norms instead of one
        return per_layer * cfg.n_layers + star

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # norms are element-wise


@register
class HybridNormStar(HybridNorm):
    name = "hybrid_norm_star"
    summary = "HybridNorm* : HybridNorm with a full Pre-Norm first block."
    star = True
