"""Sigmoid attention: element-wise sigmoid of the logits instead of a row softmax.

Equation (docs/sources.md#sigmoid, arXiv 2605.20798 Appendix B.5)::

    y_i = sum_{j <= i} sigmoid(q_i . k_j / sqrt(d_h) + b - log n) v_j

with ``n`` the training sequence length (a constant, as Apple's configs use -ln 2048 at
T = 2048), ``b`` a learnable scalar per layer, causal-masked entries 0 and no row
normalisation.

Citation: Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention" (arXiv 2409.04431).

Init: b = 0 (B.5), so the bias starts at -log n; weights as the baseline.
Parameters: one scalar per layer, L in total (none with ``learnable_bias=false``).
Extra FLOPs: 0 (the sigmoid is element-wise; scores and mixing as the baseline).

Syntax: ``sigmoid``, ``sigmoid(n=2048)``, ``sigmoid(learnable_bias=false)``.

Choices of our own: ``n`` defaults to the training sequence length ``train.seq_len`` (the
model config's ``trained_seq_len``; ``model.max_seq_len`` in a run folder written before
that key existed, as such a run trained); the paper's stabilisers (hybrid-norm or
LayerScale, QK-Norm in Apple's configs) are not added: B.5 describes the bare
replacement, and they compose as separate methods (``sigmoid+qknorm``,
``sigmoid+layerscale``). Explicit float32 score path on every device (SDPA and
FlexAttention always apply a softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.attention import ExplicitKernel
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext


class SigmoidKernel(ExplicitKernel):
    """``sigmoid(s + b - log n)`` masked causally, no normalisation."""

    def __init__(self, n: int, learnable_bias: bool) -> None:
        super().__init__()
        self.log_n = math.log(n)
        self.bias = nn.Parameter(torch.zeros(())) if learnable_bias else None

    def weights(
        self, logits: torch.Tensor, mask: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        b = -self.log_n if self.bias is None else self.bias.to(logits.dtype) - self.log_n
        return torch.sigmoid(logits + b).masked_fill(~mask, 0.0)

    def modbench_init(self) -> None:
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"log_n={self.log_n:.3f}, learnable_bias={self.bias is not None}"


@register
class SigmoidAttention(Method):
    name = "sigmoid"
    category = "attention"
    citation = ("Ramapuram et al. 2024, Theory, Analysis, and Best Practices for Sigmoid "
                "Self-Attention")
    summary = "Sigmoid instead of softmax, bias b - log n (b learnable, init 0), no row sum."

    @dataclass
    class Options:
        n: int | None = None  # None: the training sequence length (train.seq_len)
        learnable_bias: bool = True

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        n = self.opts.n if self.opts.n is not None else cfg.trained_seq_len
        if n < 1:
            raise ModbenchError(f"option n={n} of method 'sigmoid' must be at least 1 (the "
                                "sequence length of the bias -log n; null: train.seq_len)")
        learnable = self.opts.learnable_bias

        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return SigmoidKernel(n, learnable)

        spec.fill("attn.kernel", factory, by=self.name)

    def reads_train_seq_len(self) -> bool:
        return self.opts.n is None

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.n_layers if self.opts.learnable_bias else 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
