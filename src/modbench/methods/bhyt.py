"""BHyT (Bounded Hyperbolic Tanh): tanh of an input bounded by its own RMS.

Citation: Byun, Choi, Kim, Park, Song 2026, "Bounded Hyperbolic Tangent: A Stable and
Efficient Alternative to Pre-Layer Normalization in Large Language Models", arXiv 2601.09719;
official code github.com/MLAI-Yonsei/BHyT (``models/hf_src/llama/modeling_llama.py``).

Equation (both forms; the paper's ``lambda``, ``kappa``, ``gamma`` are our ``alpha``, ``k``,
``g``)::

    u       = x / (k * RMS(x)),          RMS(x) = sqrt(mean(x^2) + eps)
    BHyT(x) = g * tanh(alpha * u)        alpha a learnable scalar, g in R^d

This was first reconstructed from the abstract alone (``form=abstract``, the default, kept
bit for bit so existing run keys keep their meaning). The official code has the same
per-norm equation up to naming (``tanh(lam * rsqrt(var + eps) / kappa * x) * weight``, ``var``
the mean of ``x^2``), so the default form changes nothing; ``form=paper`` adds what the paper
does beyond it:

- its constants: ``kappa = 10`` (``bhyt_kappa``), ``lambda`` initialised per site, 2 before
  attention and 1 before the FFN (``input_layer_lam`` / ``post_layer_lam``, the first pair of
  the released pretraining sweep ``pt_bhyt_sweep.sh``; the other pair is 3 / 3), learnable;
- the final norm stays RMSNorm (``last_layer_lam = 0`` in both released pairs; ``lam_final >
  0`` makes it a BHyT with that ``lambda`` init, as the code does);
- the per-block statistic sharing (``share=true``, the paper's BHyT; ``share=false`` is the
  code's ``bhytstar``, exact statistics at every norm). The attention-input norm of block l
  computes the exact mean square ``s = mean(x^2)`` of the block input x; the FFN-input norm of
  the same block does not reduce over its own input ``h = x + Attn(BHyT_1(x))`` but uses the
  variance approximation of the code's ``LayerWiseVarApprox`` (baseline method)::

      var(h) ~= s + c * lambda_1^2 / kappa^2,   c = ||W_V W_O||_F^2 / (T * d)
      BHyT_2(h) = g_2 * tanh(lambda_2 * h / (kappa * sqrt(var(h) + eps)))

  ``lambda_1`` is the attention-input norm's lambda (detached, as in the code); ``W_V`` is
  expanded over the query heads of each key/value group (GQA), ``T`` the training sequence
  length (the code's ``seq_len = model_max_length``), ``d`` the model width. Our reading of
  the constant (the method section's text was not reachable, only the code): the attention
  branch's variance when tanh is near-linear (mean square ``lambda_1^2 / kappa^2`` after the
  bounded tanh, ``g_1 = 1``), attention averages T independent values and the branch is
  independent of x. ``c`` carries no gradient (the code computes it under
  ``torch.no_grad``).

Init: ``g = 1``; ``form=abstract``: ``alpha = alpha`` (default 1), ``k = bound`` (default 2, a
constant); ``form=paper``: ``lambda = lam_attn`` (2) at the attention-input norm (and the
other ``attn.*`` / ``embed`` sites), ``lam_ffn`` (1) at the FFN-input norm (and the other
``ffn.*`` sites), ``kappa`` = 10 (a constant); the final norm an RMSNorm (g = 1) unless
``lam_final > 0``.

Choices of our own where the sources are silent or where we differ:

- ``form=abstract``: k = 2 and alpha = 1 are ours (the abstract gives no constants); every
  norm computes its exact per-token RMS. The final norm is a BHyT.
- ``c`` is recomputed from the current W_V, W_O at every forward. The code refreshes it from
  the weights every ``max(1, min(1000, steps // 50))`` optimizer steps (its
  ``UpdateScalerCallback``); every forward is the limit of that schedule, needs no state
  (checkpoints and stacked seeds are unaffected) and costs one ``d x (h_kv d_h) x d`` matrix
  product per layer per forward, not per token (``extra_flops`` counts per-token work: 0).
- ``eps`` is ``model.norm_eps`` (the code's BHyT adds 1e-6 inside the square root).
- ``T`` is ``train.seq_len`` (``model.trained_seq_len``), so the key of a ``form=paper``
  run includes it.
- The code's research switches (``var_approx_method`` beta / eta / residual_aware,
  ``use_gamma_var``, exact early layers, kappa schedules, the decode fast paths) are left
  out: the released scripts do not set them.

Slots: ``norm`` (every site with a norm). ``form=paper, share=true`` also adds an
identity ``linear_wrappers`` filler that records each block's ``v`` and ``o`` linear layers
while the model is built, so the FFN-input norm holds references to W_V, W_O and to the
block's attention-input norm (plain attributes, not submodules: parameters and state-dict
keys are those of the baseline layout). It needs no change to the block: the attention-input
norm leaves ``s`` in a cell it shares with the FFN-input norm of its block, which reads and
clears it. This assumes the Pre-LN block (``attn.pre`` runs before ``ffn.pre`` in each block,
the FFN input is ``x + attention output``): a placement that puts a norm at ``attn.post`` or
``attn.residual``, or lacks ``attn.pre`` / ``ffn.pre``, is refused with ``share=true``, and so is
a block whose attention core the model reuses from another layer (the ``tie`` slot); a layer
that reuses another layer's norms (``tie``) reuses its W_V, W_O references with them. With
another stream or merge (DenseFormer, Hyper-Connections, LayerScale) it still runs but the
approximation's premise ``h = x + out`` no longer holds.

Parameters over the baseline, counted for the baseline placement (2 L + 1 norms):
``form=abstract``: + 1 per norm (alpha), 2 L + 1; ``form=paper``: + 1 per BHyT norm (lambda),
2 L (+ 1 with ``lam_final > 0``).

Syntax: ``bhyt``, ``bhyt(bound=3)``, ``bhyt(form=paper)``, ``bhyt(form=paper,share=false)``,
``bhyt(form=paper,lam_attn=3,lam_ffn=3)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import baseline_norm_count, inner_linear
from modbench.methods.base import Method, option_choice, register
from modbench.model.norms import RMSNorm
from modbench.model.spec import ModelSpec

FORMS = ("abstract", "paper")
# sites that must not hold a norm when the FFN-input norm shares the block's statistic: the
# approximation takes the attention branch as it leaves the core, added to the block input
_NOT_WITH_SHARE = ("attn.post", "attn.residual")


class BoundedTanh(nn.Module):
    def __init__(self, dim: int, eps: float, bound: float, alpha: float) -> None:
        super().__init__()
        self.eps, self.bound, self.alpha0 = eps, bound, alpha
        self.alpha = nn.Parameter(torch.full((), alpha))
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        u = xf * torch.rsqrt(self.variance(xf) + self.eps) / self.bound
        y = torch.tanh(self.alpha.to(xf.dtype) * u) * self.weight.to(xf.dtype)
        return y.to(x.dtype)

    def variance(self, xf: torch.Tensor) -> torch.Tensor:
        """The statistic the input is divided by (before eps): the exact mean square here."""
        return xf.pow(2).mean(-1, keepdim=True)

    def modbench_init(self) -> None:
        nn.init.constant_(self.alpha, self.alpha0)
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, bound={self.bound}, alpha0={self.alpha0}"


class _BlockCell:
    """What a block's attention-input norm hands to its FFN-input norm within one forward:
    the exact mean square of the block input (``None`` outside that window)."""

    def __init__(self) -> None:
        self.ms: torch.Tensor | None = None


class StatBoundedTanh(BoundedTanh):
    """The attention-input BHyT of a block with shared statistics: the same output as
    :class:`BoundedTanh`, and it leaves ``mean(x^2)`` in the block's cell."""

    def __init__(self, dim: int, eps: float, bound: float, alpha: float) -> None:
        super().__init__(dim, eps, bound, alpha)
        self.cell = _BlockCell()  # a plain attribute (no tensors until a forward)

    def variance(self, xf: torch.Tensor) -> torch.Tensor:
        ms = super().variance(xf)
        self.cell.ms = ms
        return ms


def attention_scale(w_v: torch.Tensor, w_o: torch.Tensor, head_dim: int, seq_len: int
                    ) -> torch.Tensor:
    """``c = ||W_V W_O||_F^2 / (T d)`` (the code's ``update_scaler``), W_V expanded over the
    query heads of each key/value group. ``w_v``: (h_kv d_h, d), ``w_o``: (d, h d_h) as
    ``nn.Linear`` stores them. Summing W_O's columns over each group first gives the same
    product as expanding W_V, at 1/group of the cost."""
    d = w_o.shape[0]
    n_kv, n_h = w_v.shape[0] // head_dim, w_o.shape[1] // head_dim
    w_o_grouped = w_o.reshape(d, n_kv, n_h // n_kv, head_dim).sum(2).reshape(d, -1)
    vo = w_o_grouped @ w_v  # (d, d) = W_O W_V_expanded, the transpose of the code's product
    return vo.pow(2).sum() / (seq_len * d)


class SharedStatBoundedTanh(BoundedTanh):
    """The FFN-input BHyT of a block with shared statistics (``form=paper``): its variance
    is the block input's exact mean square plus ``c lambda_1^2 / kappa^2``."""

    def __init__(self, dim: int, eps: float, bound: float, alpha: float, seq_len: int,
                 head_dim: int, layer: int) -> None:
        super().__init__(dim, eps, bound, alpha)
        self.seq_len, self.head_dim, self.layer = seq_len, head_dim, layer
        # (attention-input norm, v linear, o linear): a tuple, so not submodules
        self.source: tuple[StatBoundedTanh, nn.Module, nn.Module] | None = None

    def link(self, attn_norm: StatBoundedTanh, v: nn.Module, o: nn.Module) -> None:
        self.source = (attn_norm, v, o)

    def variance(self, xf: torch.Tensor) -> torch.Tensor:
        if self.source is None:
            raise RuntimeError(f"bhyt: the FFN-input norm of layer {self.layer} was never "
                               "linked to its block's attention-input norm")
        attn_norm, v, o = self.source
        ms = attn_norm.cell.ms
        if ms is None:
            raise RuntimeError(f"bhyt: the FFN-input norm of layer {self.layer} ran before "
                               "its block's attention-input norm; share=true needs Pre-LN order")
        attn_norm.cell.ms = None  # read once: no tensor outlives the forward
        ms = ms.to(xf.dtype)
        c = attention_scale(v.weight.detach().to(xf.dtype), o.weight.detach().to(xf.dtype),
                            self.head_dim, self.seq_len)
        lam1 = attn_norm.alpha.detach().to(xf.dtype)
        return ms + c * lam1 * lam1 / (self.bound * self.bound)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", shared statistic (T={self.seq_len})"


def _plain_weight(m: nn.Module, role: str, layer: int, shape: tuple[int, int]) -> nn.Module:
    """The plain linear layer under ``m``'s wrappers, checked to hold a (d_out, d_in) weight."""
    base = inner_linear(m)
    w = getattr(base, "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
        raise ModbenchError(
            f"bhyt(form=paper) with share=true computes its variance approximation from "
            f"W_{role.upper()}, but layer {layer}'s {role!r} layer is a "
            f"{type(base).__name__} without a {shape} weight; use "
            "bhyt(form=paper,share=false)")
    return base


@register
class BHyT(Method):
    name = "bhyt"
    category = "norm"
    citation = ("Byun et al. 2026, Bounded Hyperbolic Tangent: A Stable and Efficient "
                "Alternative to Pre-Layer Normalization in LLMs, arXiv 2601.09719")
    summary = ("g * tanh(alpha x / (k RMS(x))); form=paper: kappa 10, lambda 2/1, FFN norm "
               "from the block's statistic + a variance approximation.")

    @dataclass
    class Options:
        form: str = "abstract"  # abstract (our first reconstruction) | paper (arXiv 2601.09719)
        bound: float = 2.0  # form=abstract: k, input divided by k * RMS(x)
        alpha: float = 1.0  # form=abstract: init of the learnable scalar alpha
        kappa: float = 10.0  # form=paper: the constant kappa
        lam_attn: float = 2.0  # form=paper: lambda init before attention (attn.*, embed)
        lam_ffn: float = 1.0  # form=paper: lambda init before the FFN (ffn.*)
        lam_final: float = 0.0  # form=paper: final norm a BHyT with this init (0: RMSNorm)
        share: bool = True  # form=paper: FFN norm from the block's statistic (false: exact)

    def _check(self) -> None:
        o, default = self.opts, self.Options()
        option_choice(self.name, "form", o.form, FORMS)
        own = ("bound", "alpha") if o.form == "abstract" else (
            "kappa", "lam_attn", "lam_ffn", "lam_final", "share")
        for f in ("bound", "alpha", "kappa", "lam_attn", "lam_ffn", "lam_final", "share"):
            if f not in own and getattr(o, f) != getattr(default, f):
                other = "paper" if o.form == "abstract" else "abstract"
                raise ModbenchError(f"option {f} of method 'bhyt' applies to form={other}, "
                                    f"not form={o.form}; drop it or set form={other}")
        if not o.bound > 0:
            raise ModbenchError(f"option bound={o.bound} of method 'bhyt' must be positive")
        if not o.kappa > 0:
            raise ModbenchError(f"option kappa={o.kappa} of method 'bhyt' must be positive")
        if o.lam_final < 0:
            raise ModbenchError(f"option lam_final={o.lam_final} of method 'bhyt' must be 0 "
                                "(final norm RMSNorm) or positive (a BHyT with that init)")

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        self._check()
        o = self.opts
        if o.form == "abstract":
            def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
                return BoundedTanh(dim, eps, o.bound, o.alpha)

            spec.fill("norm", factory, by=self.name, key=("bhyt", o.bound, o.alpha))
            return
        self._configure_paper(spec, cfg)

    def _configure_paper(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        o = self.opts
        seq_len, head_dim, d = cfg.trained_seq_len, cfg.head_dim, cfg.d_model
        # per build, per layer: the v / o linear layers and the attention-input norm, filled
        # in build order (a block's attention core, then its attn.* norms, then ffn.pre)
        pending: dict[int, dict[str, Any]] = {}

        def record(module: nn.Module, role: str, d_in: int, d_out: int, layer: int,
                   c: ModelConfig) -> nn.Module:
            if role in ("v", "o"):
                if role == "v":
                    pending[layer] = {}
                pending.setdefault(layer, {})[role] = _plain_weight(
                    module, role, layer, (d_out, d_in))
            return module

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            if site == "final":
                if o.lam_final > 0:
                    return BoundedTanh(dim, eps, o.kappa, o.lam_final)
                return RMSNorm(dim, eps)
            lam = o.lam_ffn if site.startswith("ffn.") else o.lam_attn
            if not o.share:
                return BoundedTanh(dim, eps, o.kappa, lam)
            if site in _NOT_WITH_SHARE:
                raise ModbenchError(
                    f"bhyt(form=paper) with share=true approximates the FFN input's variance "
                    f"for Pre-LN blocks, but the placement puts a norm at {site}; use "
                    "bhyt(form=paper,share=false) with this placement")
            if site == "attn.pre":
                m = StatBoundedTanh(dim, eps, o.kappa, lam)
                pending.setdefault(layer, {})["attn"] = m
                return m
            if site == "ffn.pre":
                got = pending.pop(layer, {})
                if "attn" not in got:
                    raise ModbenchError(
                        f"bhyt(form=paper) with share=true takes the FFN-input norm's statistic "
                        f"from the attention-input norm of the same block, but layer {layer} "
                        "has no BHyT at attn.pre (a placement without it, or norms reused from "
                        "another layer); use bhyt(form=paper,share=false)")
                if "v" not in got or "o" not in got:
                    raise ModbenchError(
                        f"bhyt(form=paper) with share=true needs W_V and W_O of layer {layer}, "
                        "which built none (its attention core is reused from another layer or "
                        "has no v/o projections); use bhyt(form=paper,share=false)")
                m = SharedStatBoundedTanh(dim, eps, o.kappa, lam, seq_len, head_dim, layer)
                m.link(got["attn"], got["v"], got["o"])
                return m
            return BoundedTanh(dim, eps, o.kappa, lam)  # embed, ffn.post, ffn.residual

        key = ("bhyt-paper", o.kappa, o.lam_attn, o.lam_ffn, o.lam_final, o.share, seq_len, d)
        spec.fill("norm", factory, by=self.name, key=key)
        if o.share:
            spec.add("linear_wrappers", record, by=self.name)

    def reads_train_seq_len(self) -> bool:
        return self.opts.form == "paper" and self.opts.share

    def extra_params(self, cfg: ModelConfig) -> int:
        n = baseline_norm_count(cfg)  # alpha / lambda per BHyT; g replaces the RMSNorm gain
        if self.opts.form == "paper" and self.opts.lam_final == 0:
            return n - 1  # the final norm stays RMSNorm
        return n

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
