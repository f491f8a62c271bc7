"""Sandwich norm and Peri-LN: a norm on both sides of every sublayer.

Equations (docs/sources.md#sandwich, C3), for each sublayer F (attention, FFN)::

    sandwich:  h = x + N_post(F(N_pre(x)))                       final norm kept
    peri_ln:   h = x + N_out(F(N_in(x))),  x_0 = N_emb(embed(t))  final norm kept

Citation: Ding et al. 2021, "CogView: Mastering Text-to-Image Generation via Transformers"
(sandwich); Kim et al. 2025, "Peri-LN: Revisiting Normalization Layer in the Transformer
Architecture" (ICML 2025).

Init: every gain 1 (the norm type's own init), weights as the baseline.

Slots: ``placement`` only (sites ``attn.pre``, ``attn.post``, ``ffn.pre``, ``ffn.post``,
``final``; Peri-LN adds ``embed``); the norm *type* is whatever fills the ``norm`` slot, so
``sandwich+layernorm`` or ``peri_ln+dyt`` work.

Choices of our own: the two are the same block; they differ only in the embedding norm,
which Peri-LN's paper configuration adds (recalled, not checked in code). CogView's PB-relax
(an fp16 trick) is not used. Sandwich keeps the final norm, as Gemma-2 does.
Parameters: sandwich +2 d per block (two output norms); Peri-LN also + d (embedding norm).
"""

from __future__ import annotations

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec

SANDWICH_SITES = ("attn.pre", "attn.post", "ffn.pre", "ffn.post", "final")
PERI_SITES = (*SANDWICH_SITES, "embed")


def sandwich_placement(site: str, layer: int, n_layers: int) -> bool:
    return site in SANDWICH_SITES


def peri_ln_placement(site: str, layer: int, n_layers: int) -> bool:
    return site in PERI_SITES


@register
class Sandwich(Method):
    name = "sandwich"
    category = "placement"
    citation = "Ding et al. 2021, CogView: Mastering Text-to-Image Generation via Transformers"
    summary = "Sandwich norm: h = x + N_post(F(N_pre(x))) for attention and FFN."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fill("placement", sandwich_placement, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # norms are element-wise


@register
class PeriLN(Method):
    name = "peri_ln"
    category = "placement"
    citation = ("Kim et al. 2025, Peri-LN: Revisiting Normalization Layer in the Transformer "
                "Architecture (ICML 2025)")
    summary = "Peri-LN: input and output norm on every sublayer plus an embedding norm."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fill("placement", peri_ln_placement, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model * cfg.n_layers + cfg.d_model

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
