"""Pre-CRMSNorm: a Pre-LN Transformer with a zero-mean residual stream stored in d - 1 dims.

Equation (docs/sources.md#crmsnorm; Jiang et al.'s ``customized_layer.py``)::

    CRMSNorm(x) = x / sqrt((||x||^2 + (sum_i x_i)^2) / d + eps),     x in R^(d-1)

A zero-mean vector z in R^d is stored losslessly as its first d - 1 entries x (the last is
-sum x), and CRMSNorm(x) is then LayerNorm(z) without affine, compressed: a Pre-LN model
converted by (1) re-centring the embedding and the output projections (W_o, W_down) over
their output features and dropping the last row, (2) folding each LayerNorm gain into the
next linear layer, W diag(g), and (3) replacing every input weight W by W[:, :-1] - W[:, -1:]
gives the same logits (tests/methods/test_crmsnorm.py). LayerNorm biases would fold into
biases of the next layers, which the lab's linears do not have, so the equivalence is with
``layernorm(bias=false)``.

Citation: Jiang et al. 2023, "Pre-RMSNorm and Pre-CRMSNorm Transformers: Equivalent and
Efficient Pre-LN Transformers" (NeurIPS 2023); code ZixuanJiang/pre-rmsnorm-transformer.

Init: no affine parameters (the paper's from-scratch ``model.py`` sets ``dim -= 1`` and uses
CRMSNorm without affine: gains are folded into the following linear layers); the linear and
embedding weights are drawn as in the baseline at the reduced width.

Slots and config: ``edit_config`` sets ``model.d_model = d - 1`` and fixes the attention head
size at the original d / H (``model.attn_head_dim``), so the attention keeps its shape and
only the residual stream narrows; ``norm`` is CRMSNorm (d inferred as width + 1) at every
site the placement enables. The equivalence to LayerNorm holds for pre-norm placements;
with other placements the model is a d - 1 wide model with CRMSNorm (still well defined).
Choices of our own: with tied embeddings the head is the (d - 1)-wide embedding (a
from-scratch model; the conversion test uses an untied head). The FFN width is unchanged.

Parameters over the baseline: -(2 L + 1) d (no gains), -V (embedding column; -2 V untied),
-L (2 H d_h + 2 H_kv d_h + 3 d_ff) (one input/output row less in every matrix).
FLOPs: 2 x the removed matrix parameters per token, head included (-2 V even when tied).
"""

from __future__ import annotations

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import baseline_norm_count
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec


class CRMSNorm(nn.Module):
    """Compressed RMSNorm on a (d - 1)-dim input that stands for a zero-mean d-dim vector."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        sq = xf.pow(2).sum(-1, keepdim=True) + xf.sum(-1, keepdim=True).pow(2)
        return (xf * torch.rsqrt(sq / (self.dim + 1) + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim} (represents {self.dim + 1}), eps={self.eps}"


def crmsnorm_factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
    return CRMSNorm(dim, eps)


@register
class PreCRMSNorm(Method):
    name = "crmsnorm"
    category = "norm"
    citation = ("Jiang et al. 2023, Pre-RMSNorm and Pre-CRMSNorm Transformers: Equivalent and "
                "Efficient Pre-LN Transformers (NeurIPS)")
    summary = "Pre-CRMSNorm: residual stream d-1 wide (compressed zero-mean), CRMSNorm, no gains."

    def edit_config(self, cfg: ModelConfig) -> None:
        if cfg.d_model < 3:
            raise ModbenchError("crmsnorm needs model.d_model >= 3 (it narrows the stream to d-1)")
        if cfg.attn_head_dim is None:
            if cfg.d_model % cfg.n_heads:
                raise ModbenchError(
                    f"model.d_model={cfg.d_model} is not divisible by model.n_heads="
                    f"{cfg.n_heads}; crmsnorm keeps the head size d / H while the stream "
                    "narrows to d - 1"
                )
            cfg.attn_head_dim = cfg.d_model // cfg.n_heads
        cfg.d_model -= 1

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fill("norm", crmsnorm_factory, by=self.name)

    def _removed_matrix_params(self, cfg: ModelConfig) -> int:
        dh = cfg.head_dim  # unchanged by edit_config
        per_layer = 2 * cfg.n_heads * dh + 2 * cfg.n_kv_heads * dh + 3 * cfg.d_ff
        return cfg.n_layers * per_layer

    def extra_params(self, cfg: ModelConfig) -> int:
        emb = cfg.vocab_size * (1 if cfg.tie_embeddings else 2)
        return -(baseline_norm_count(cfg) * cfg.d_model + emb + self._removed_matrix_params(cfg))

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return -2.0 * (self._removed_matrix_params(cfg) + cfg.vocab_size)
