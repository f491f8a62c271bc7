"""nGPT: the normalized Transformer, complete (representation learning on the hypersphere).

Equations (docs/sources.md#ngpt; every fact from ``NVIDIA/ngpt`` ``model.py``), with
norm(x) = x / ||x||_2 over the last dimension::

    embeddings, matrices   unit norm along d: rows of E_in, W_q, W_k, W_v, W_gate, W_up and of
                           the head E_out (input-side, ``dim=1`` of an (out, in) weight);
                           columns of W_o and W_down (output-side, ``dim=0``)
    attention              q <- s_qk * norm(q),  k <- s_qk * norm(k)   per head, after RoPE
                           softmax(sqrt(d_h) q k^T) v                 (scale sqrt(d_h), not 1/..)
    residual (attention)   h <- norm(h + |alpha_A| * (norm(h_A) - h))
    residual (MLP)         h <- norm(h + |alpha_M| * (norm(h_M) - h))
    MLP                    u = s_u sqrt(d) (W_up h),  nu = s_nu sqrt(d) (W_gate h)
                           h_M = W_down(u * SiLU(nu))
    logits                 z = s_z * (E_out h)
    no norm layers, no final norm, no weight tying

Scaled parameters ("eigen learning rates"): each scaling vector is stored as p = s_scale 1 and
used as p (s_init / s_scale), base scale 1/sqrt(d) (the code hard-codes 1/sqrt(1024)):

    alpha_A, alpha_M   s_init 0.05   s_scale 1/sqrt(d)   (d entries each, per block)
    s_qk               s_init 1      s_scale 1/sqrt(d)   (H_kv d_h entries per block)
    s_u, s_nu          s_init 1      s_scale 1           (d_ff entries each, per block)
    s_z                s_init 1      s_scale 1/sqrt(d)   (V entries)

Citation: Loshchilov, Hsieh, Sun, Ginsburg 2025, "nGPT: Normalized Transformer with
Representation Learning on the Hypersphere" (ICLR 2025, arXiv 2410.01131); code
NVIDIA/ngpt.

Init: matrices and embeddings N(0, init_std^2) from the generic pass, then normalised
(``post_init``; the code draws N(0, 1/sqrt(d)) and normalises: the same directions in law).
The scaling vectors are set to s_scale by their own ``modbench_init`` (after the generic pass).
Every weight is re-normalised after **every** optimizer step by a trainer callback
(:class:`Renormalize`, from ``callbacks()``); outside the trainer call :func:`renormalize`.

Recipe exceptions (declared in ``recipe_exceptions``, recorded in the run's config):
``weight_decay: 0.0`` and ``warmup_steps: 0`` (the code's ``weight_decay=0``,
``warmup_iters=0``). The learning rate stays the shared recipe's (the repo uses 15e-4).

Slots: ``placement`` (no norm at any site), ``norm`` (a type that is never built, so a norm
type combined with nGPT is refused), ``linear`` (unit-norm linear layers that know their
normalisation axis), ``attn.qk_post`` (s_qk), ``attn.kernel`` (SDPA with scale sqrt(d_h)),
``ffn`` (the scaled SwiGLU core above; its activation is the ``ffn.act`` slot, SiLU),
``merge`` (the normalised interpolation), ``logits`` (s_z). Config edit:
``tie_embeddings = False`` (the code does not tie: "in the nGPT paper there was no weight
tying"). Methods that fill any of these slots are refused by the slot rules.

Choices of our own:

- GQA: s_qk has one entry per key channel (H_kv d_h); a query head uses the entries of its
  KV group, so q and k of a pair still share one scale per channel as in the code (which is
  MHA-only; with H_kv = H this is exactly the code's n_embd-sized s_qk).
- u is the ``up`` projection and nu the ``gate`` projection (the code's fused ``c_fc`` split in
  two halves, u first); both are scaled by sqrt(d) (the code; the paper text may put it on nu
  only).
- The residual update normalises h before the interpolation as the code does ("normally, not
  needed"), and norms are computed in (at least) float32.
- The embedding is not normalised in the forward (its rows are unit norm by construction, as
  in the code).

Parameters over the baseline (L blocks)::

    + L (2 d + H_kv d_h + 2 d_ff)    alpha_A, alpha_M, s_qk, s_u, s_nu
    + V                              s_z
    - (2 L + 1) d                    no RMSNorm gains
    + V d                            untied head (only when the baseline ties)

FLOPs: unchanged (the same matrix products; the scalings and norms are element-wise).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.attention import SDPAKernel
from modbench.model.spec import Builder, ModelSpec
from modbench.model.stream import ForwardContext, StreamState
from modbench.runtime.callback import Callback

OUTPUT_SIDE = ("o", "down")  # weights normalised along dim 0 (columns); all others dim 1
ALPHA_INIT = 0.05


def justnorm(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x / ||x||`` along ``dim``, computed in (at least) float32, cast back."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf / xf.norm(p=2, dim=dim, keepdim=True)).to(x.dtype)


@torch.no_grad()
def normalize_(w: torch.Tensor, dim: int) -> None:
    """In place: ``w <- w / ||w||`` along ``dim`` (norms in at least float32)."""
    if w.dtype in (torch.float32, torch.float64):
        w.div_(torch.linalg.vector_norm(w, dim=dim, keepdim=True))
    else:
        w.copy_(justnorm(w, dim))


class ScaledVector(nn.Module):
    """A scaling vector stored as ``p = s_scale * 1`` and used as ``p * (s_init / s_scale)``."""

    def __init__(self, n: int, s_init: float, s_scale: float, extra: float = 1.0) -> None:
        super().__init__()
        self.s_init, self.s_scale, self.extra = s_init, s_scale, extra
        self.weight = nn.Parameter(torch.full((n,), s_scale))

    def modbench_init(self) -> None:
        nn.init.constant_(self.weight, self.s_scale)

    def forward(self) -> torch.Tensor:
        """The effective vector (times ``extra``, e.g. sqrt(d) for s_u and s_nu)."""
        return self.weight * (self.s_init / self.s_scale * self.extra)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, s_init={self.s_init:g}, s_scale={self.s_scale:.4g}"


class UnitNormLinear(nn.Linear):
    """A bias-free linear layer whose weight vectors along d are kept at unit norm:
    rows (``dim=1``) for input-side roles, columns (``dim=0``) for ``o`` and ``down``."""

    def __init__(self, role: str, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, bias=False)
        self.role = role
        self.unit_dim = 0 if role in OUTPUT_SIDE else 1

    def renormalize(self) -> None:
        normalize_(self.weight, self.unit_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, role={self.role}, unit_dim={self.unit_dim}"


def unit_norm_linear(role: str, d_in: int, d_out: int, layer: int) -> nn.Module:
    return UnitNormLinear(role, d_in, d_out)


@torch.no_grad()
def renormalize(model: nn.Module) -> None:
    """Project the embedding rows and every :class:`UnitNormLinear` back to unit norm."""
    normalize_(model.embed.weight, 1)  # type: ignore[union-attr]
    for m in model.modules():
        if isinstance(m, UnitNormLinear):
            m.renormalize()


class Renormalize(Callback):
    """Trainer callback: :func:`renormalize` after every optimizer step."""

    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        renormalize(trainer.model)


def no_norm_sites(site: str, layer: int, n_layers: int) -> bool:
    return False


def never_built_norm(dim: int, eps: float, site: str, layer: int) -> nn.Module:
    raise ModbenchError(f"ngpt has no norm layers, but a norm was requested at site {site!r}")


class NGPTQK(nn.Module):
    """``q <- s_qk * norm(q)``, ``k <- s_qk * norm(k)`` per head (after RoPE)."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, base_scale: float) -> None:
        super().__init__()
        self.n_rep, self.n_kv_heads, self.head_dim = n_heads // n_kv_heads, n_kv_heads, head_dim
        self.s_qk = ScaledVector(n_kv_heads * head_dim, 1.0, base_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s_qk().view(self.n_kv_heads, 1, self.head_dim)  # (H_kv, 1, d_h)
        s_q = s.repeat_interleave(self.n_rep, dim=0) if self.n_rep > 1 else s
        return justnorm(q) * s_q.to(q.dtype), justnorm(k) * s.to(k.dtype)


class NGPTFFN(nn.Module):
    """``W_down(u * act(nu))``, ``u = s_u sqrt(d) W_up h``, ``nu = s_nu sqrt(d) W_gate h``."""

    def __init__(self, cfg: ModelConfig, build: Builder, layer: int) -> None:
        super().__init__()
        d, ff = cfg.d_model, cfg.d_ff
        self.gate_proj = build.linear("gate", d, ff, layer)
        self.up_proj = build.linear("up", d, ff, layer)
        self.down_proj = build.linear("down", ff, d, layer)
        self.act = build.optional("ffn.act", nn.SiLU, cfg, layer)
        self.s_u = ScaledVector(ff, 1.0, 1.0, extra=math.sqrt(d))
        self.s_nu = ScaledVector(ff, 1.0, 1.0, extra=math.sqrt(d))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        u = self.up_proj(x) * self.s_u().to(x.dtype)
        nu = self.gate_proj(x) * self.s_nu().to(x.dtype)
        return self.down_proj(u * self.act(nu))


class NGPTMerge(nn.Module):
    """``h' = norm(h + |alpha| * (norm(out) - h))`` with h normalised first (as the code)."""

    def __init__(self, dim: int, base_scale: float) -> None:
        super().__init__()
        self.alpha = ScaledVector(dim, ALPHA_INIT, base_scale)

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        h, o = justnorm(x.to(acc)), justnorm(out.to(acc))
        lr = self.alpha().abs().to(acc)
        return justnorm(h + lr * (o - h)).to(x.dtype)


class NGPTLogits(nn.Module):
    """``z = s_z * logits``."""

    def __init__(self, vocab_size: int, base_scale: float) -> None:
        super().__init__()
        self.s_z = ScaledVector(vocab_size, 1.0, base_scale)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.s_z().to(logits.dtype)


def base_scale(cfg: ModelConfig) -> float:
    return 1.0 / math.sqrt(cfg.d_model)


@register
class NGPT(Method):
    name = "ngpt"
    category = "architecture"
    citation = ("Loshchilov, Hsieh, Sun, Ginsburg 2025, nGPT: Normalized Transformer with "
                "Representation Learning on the Hypersphere (ICLR)")
    summary = ("Normalized Transformer: unit-norm embeddings, weights and hidden states, "
               "interpolating residual, eigen learning rates; no norm layers.")
    recipe_exceptions: ClassVar[dict[str, Any]] = {"weight_decay": 0.0, "warmup_steps": 0}

    def edit_config(self, cfg: ModelConfig) -> None:
        cfg.tie_embeddings = False

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        scale = base_scale(cfg)

        def qk_post(c: ModelConfig, layer: int) -> nn.Module:
            return NGPTQK(c.n_heads, c.n_kv_heads, c.head_dim, scale)

        def kernel(c: ModelConfig, layer: int) -> nn.Module:
            return SDPAKernel(scale=math.sqrt(c.head_dim))

        def ffn(c: ModelConfig, build: Builder, layer: int) -> nn.Module:
            return NGPTFFN(c, build, layer)

        def merge(c: ModelConfig, layer: int, sublayer: str) -> nn.Module:
            return NGPTMerge(c.d_model, scale)

        def logits(c: ModelConfig) -> nn.Module:
            return NGPTLogits(c.vocab_size, scale)

        spec.fill("placement", no_norm_sites, by=self.name)
        spec.fill("norm", never_built_norm, by=self.name)
        spec.fill("linear", unit_norm_linear, by=self.name)
        spec.fill("attn.qk_post", qk_post, by=self.name)
        spec.fill("attn.kernel", kernel, by=self.name)
        spec.fill("ffn", ffn, by=self.name)
        spec.fill("merge", merge, by=self.name)
        spec.fill("logits", logits, by=self.name)

    @torch.no_grad()
    def post_init(self, model: nn.Module) -> None:
        renormalize(model)

    def callbacks(self) -> list[Any]:
        return [Renormalize()]

    def extra_params(self, cfg: ModelConfig) -> int:
        d, n = cfg.d_model, cfg.n_layers
        scales = n * (2 * d + cfg.n_kv_heads * cfg.head_dim + 2 * cfg.d_ff) + cfg.vocab_size
        head = cfg.vocab_size * d if cfg.tie_embeddings else 0
        return scales + head - (2 * n + 1) * d

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
