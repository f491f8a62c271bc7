"""Post-LN: the original Transformer's norm placement.

Equation (docs/sources.md#post-ln)::

    h = N(x + Attn(x))
    y = N(h + FFN(h))

Citation: Vaswani et al. 2017, "Attention Is All You Need"; its instability at depth is
analysed by Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture".

Slots: fills ``placement`` only. The sublayers get no input norm; a norm follows each
residual merge (sites ``attn.residual`` and ``ffn.residual``). The norm *type* is whatever
fills the ``norm`` slot (RMSNorm in the baseline), so ``post_ln+layernorm`` works later.

Choice of our own: the final norm is kept, as in the Mix-LN / LayerNorm-Scaling scripts'
``post`` mode (it is redundant after the last post-residual norm but harmless: a norm of a
norm only rescales by the second gain). Init: gains 1, weights as the baseline.
"""

from __future__ import annotations

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec

POST_LN_SITES = ("attn.residual", "ffn.residual", "final")


def post_ln_placement(site: str, layer: int, n_layers: int) -> bool:
    return site in POST_LN_SITES


@register
class PostLN(Method):
    name = "post_ln"
    category = "placement"
    citation = ("Vaswani et al. 2017, Attention Is All You Need; Xiong et al. 2020, "
                "On Layer Normalization in the Transformer Architecture")
    summary = "Post-LN placement: h = N(x + F(x)) after each sublayer, no input norms."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fill("placement", post_ln_placement, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0  # two norms per layer move from the inputs to after the merges

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # norms are element-wise
