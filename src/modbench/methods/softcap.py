"""Softmax-Cap: element-wise capping of the pre-softmax attention logits.

Equation (docs/sources.md#softcap, arXiv 2605.20798 Appendix B.13), on the scaled logits
``s = q k^T / sqrt(d_h)`` before the causal mask and the softmax::

    hard (default):  s' = clamp(s, -c, c)
    soft (Gemma-2):  s' = c * tanh(s / c)
    y = softmax(s' + causal) v

Citation: Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size"
(attention logit soft-capping, c = 50); arXiv 2605.20798 Appendix B.13 (element-wise clipping).

Init: none; ``c`` is a fixed hyperparameter (no parameters, extra FLOPs 0: element-wise).

Syntax: ``softcap``, ``softcap(cap=30)``, ``softcap(form=soft)``, ``softcap(cap=30,form=hard)``.

Choices of our own:

- Default ``form=hard`` because Appendix B.13 says the study *clips* the logits; the cap value
  of the appendix is lost in our copy of the paper, and the study says method hyperparameters
  "follow original papers", so ``cap=50`` (Gemma-2's attention cap) is the default.
- Fast path for ``hard`` on every device: if ``max|q| * max|k| / sqrt(d_h) <= c`` (Cauchy-
  Schwarz bound over the batch) no logit can reach the cap, the clamp is the identity and
  the fused SDPA kernel gives the same values and gradients; otherwise the explicit path.
  The study notes the cap is almost never active, so the fast path is the common case.
  Under ``torch.compile`` on the CPU the fast path is left out (its bound is read on the
  host, which would break the graph) and the explicit path runs: one graph
  (``modbench bench --compile-check``). On CUDA FlexAttention stays outside the compiled
  graph (``methods/_flex.py`` says why): a graph break there.
- ``soft`` uses the explicit float32 score path on CPU; on CUDA both forms run through
  FlexAttention with a ``score_mod`` (``c tanh(s/c)`` or a clamp), falling back to the
  explicit path where FlexAttention is unavailable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, option_choice, register
from modbench.model.attention import ExplicitKernel, SDPAKernel
from modbench.model.spec import ModelSpec
from modbench.model.stream import ForwardContext


def _flex() -> ModuleType:
    """The FlexAttention helpers, imported on first use: their ``torch.compiler.disable``
    imports ``torch._dynamo`` (about 2 s of start-up), which a CPU process never needs. A
    kernel built where CUDA is available imports them at construction, eagerly, so that a
    compiled model's trace finds the module already loaded."""
    from modbench.methods import _flex as flex

    return flex


def soft_cap(s: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(s / cap)


def hard_cap(s: torch.Tensor, cap: float) -> torch.Tensor:
    return s.clamp(-cap, cap)


class _CapKernel(ExplicitKernel):
    """Capped scores ``cap_fn(s, c)`` before the causal softmax: FlexAttention on CUDA (the
    same function as ``score_mod``), else :meth:`shortcut` or the explicit path."""

    form = ""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap
        if torch.cuda.is_available():
            _flex()

    @staticmethod
    def cap_fn(s: torch.Tensor, cap: float) -> torch.Tensor:
        raise NotImplementedError

    def score(self, logits: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.cap_fn(logits, self.cap)

    def shortcut(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor | None:
        """A faster exact path for this input, if any (default: none)."""
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if q.is_cuda and (flex := _flex()).flex_usable(q):
            cap, fn = self.cap, self.cap_fn

            def score_mod(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
                return fn(s, cap)

            return flex.flex_causal_attention(q, k, v, score_mod)
        fast = self.shortcut(q, k, v, ctx)
        return fast if fast is not None else super().forward(q, k, v, ctx)

    def extra_repr(self) -> str:
        return f"cap={self.cap:g}, form={self.form}"


class SoftCapKernel(_CapKernel):
    """``softmax(c tanh(s / c) + causal) v``; FlexAttention on CUDA, explicit elsewhere."""

    form = "soft"
    cap_fn = staticmethod(soft_cap)


class HardCapKernel(_CapKernel):
    """``softmax(clamp(s, -c, c) + causal) v``; SDPA whenever the cap provably cannot bind."""

    form = "hard"
    cap_fn = staticmethod(hard_cap)

    def __init__(self, cap: float) -> None:
        super().__init__(cap)
        self.sdpa = SDPAKernel()

    def cap_cannot_bind(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        with torch.no_grad():
            qn = q.float().norm(dim=-1).amax()
            kn = k.float().norm(dim=-1).amax()
            bound = qn * kn / math.sqrt(q.shape[-1])
        return bool(bound <= self.cap)

    def shortcut(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            # the bound is read on the host, a graph break inside the block loop (Dynamo then
            # runs the whole forward eagerly); traced, the explicit path computes the same
            # function (the clamp is the identity where the shortcut would apply)
            return None
        return self.sdpa(q, k, v, ctx) if self.cap_cannot_bind(q, k) else None


@register
class SoftmaxCap(Method):
    name = "softcap"
    category = "attention"
    stackable = False
    stack_note = "its capped kernel branches on a tensor's value"
    citation = ("Gemma Team 2024, Gemma 2: Improving Open Language Models at a Practical "
                "Size (logit soft-capping)")
    summary = "Caps the pre-softmax attention logits at c: clamp (hard, default) or c*tanh(s/c)."

    @dataclass
    class Options:
        cap: float = 50.0
        form: str = "hard"  # hard | soft

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        form = option_choice(self.name, "form", self.opts.form, ("hard", "soft"))
        cap = float(self.opts.cap)
        if not cap > 0:
            raise ModbenchError(f"option cap={cap} of method 'softcap' must be positive")
        kernel = SoftCapKernel if form == "soft" else HardCapKernel

        def factory(c: ModelConfig, layer: int) -> nn.Module:
            return kernel(cap)

        spec.fill("attn.kernel", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # tanh / clamp are element-wise; scores and mixing as the baseline
