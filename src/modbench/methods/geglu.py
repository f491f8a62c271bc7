"""GeGLU: the gated FFN with GELU in place of SiLU.

Equation (docs/sources.md#geglu, arXiv 2605.20798 Appendix B.12)::

    FFN(x) = W_down( GELU(W_gate x) * W_up x )

at the SwiGLU width (``model.d_ff``), so parameters and FLOPs equal the baseline's.

Citation: Shazeer 2020, "GLU Variants Improve Transformer" (arXiv 2002.05202).

Init: the baseline init (no new parameters; extra FLOPs 0).

Syntax: ``geglu`` (exact erf GELU), ``geglu(approximate=tanh)``; the study's combination is
``qknorm+geglu``.

Choices of our own: exact GELU by default (Shazeer's definition; T5 v1.1 checkpoints use the
tanh approximation, available as an option). Slot: ``ffn.act``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, option_choice, register
from modbench.model.spec import ModelSpec


@register
class GeGLU(Method):
    name = "geglu"
    category = "ffn"
    citation = "Shazeer 2020, GLU Variants Improve Transformer"
    summary = "Gated FFN with GELU instead of SiLU, same width as SwiGLU."

    @dataclass
    class Options:
        approximate: str = "none"  # none | tanh

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        approx = option_choice(self.name, "approximate", self.opts.approximate,
                               ("none", "tanh"))

        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return nn.GELU(approximate=approx)

        spec.fill("ffn.act", factory, by=self.name, key=f"gelu-{approx}")

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
