"""Selective Attention: a token can mask earlier tokens for all later queries.

Equation (docs/sources.md#selective, the paper's reference listing; arXiv 2605.20798 Appendix
B.4), per layer, with ``A_h = q_h k^T / sqrt(d_h)`` the scaled logits of head h::

    S      = ReLU(A_0)                 selection logits of query head 0, causal entries only
    S[:, 0] = 0                        the BOS column is never masked
    S[i, i] = 0                        a token does not mask itself
    F[i, j] = sum_{k < i} S[k, j]      accumulated strictly over earlier queries
                                       (roll by +1 along queries, zero row 0, cumsum)
    y_h    = softmax(A_h - F + causal) v      for every head h, head 0 included

Citation: Leviathan, Kalman, Matias 2024, "Selective Attention Improves Transformer"
(arXiv 2410.02703).

Init: no new parameters (head 0 doubles as the masking head); the baseline init.
Extra FLOPs: the head-0 logits are computed once more outside the fused kernel:
``2 T d_h`` per token per layer.

Choices of our own / adaptations:

- As B.4: the mask F is computed and applied within each layer, from that layer's head 0
  (no accumulation across layers). With GQA, head 0 is a query head (it uses KV head 0).
- Gradients flow through F into head 0's q and into k (the paper's listing does not stop
  them).
- B.4 describes the heads as split into an "attention group" and a "masking group"; we follow
  the paper's listing (one masking head, every head masked, head 0 included). The study's
  table lists 2% fewer parameters than its baseline for this method, which B.4's "adds zero
  new parameters" does not explain; we keep the baseline's parameters (overhead 0).
- Path: the (B, T, T) head-0 logits are explicit (float32); all heads then go through SDPA
  with the float mask ``causal - F`` (no flash backend with a float mask: the memory-
  efficient or math backend, O(B T^2) memory for F).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.attention import causal_mask
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext


def selection_mask(a0: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """F from head-0 logits ``a0`` (B, T, T); ``visible`` (T, T) is the causal mask."""
    t = a0.shape[-1]
    s = torch.relu(a0.masked_fill(~visible, 0.0))
    keep = visible & ~torch.eye(t, dtype=torch.bool, device=a0.device)
    keep[:, 0] = False  # BOS column
    s = s.masked_fill(~keep, 0.0)
    # F[i] = sum_{k < i} S[k]: exclusive cumulative sum along the query axis
    f = torch.cumsum(s, dim=-2) - s
    return f


class SelectiveKernel(nn.Module):
    """Selective attention: explicit head-0 logits, then SDPA with the float mask -F."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t, d = q.shape[-2], q.shape[-1]
        acc = torch.promote_types(q.dtype, torch.float32)
        a0 = torch.matmul(q[:, 0].to(acc), k[:, 0].to(acc).transpose(-1, -2)) / math.sqrt(d)
        visible = causal_mask(t, t, q.device)
        f = selection_mask(a0, visible)
        bias = (-f).masked_fill(~visible, float("-inf")).unsqueeze(1).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                              enable_gqa=q.shape[1] != k.shape[1])


@register
class SelectiveAttention(Method):
    name = "selective"
    category = "attention"
    stackable = False
    stack_note = ("its selection mask carries a gradient into SDPA, which the vmapped CPU "
                  "kernel cannot differentiate")
    citation = "Leviathan, Kalman, Matias 2024, Selective Attention Improves Transformer"
    summary = "Head 0's ReLU logits, accumulated over later queries, are subtracted as a mask."

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return SelectiveKernel()

        spec.fill("attn.kernel", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(2 * seq_len * cfg.head_dim * cfg.n_layers)
