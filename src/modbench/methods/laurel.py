"""LAUREL: learned augmented residual connections (``laurel_rw``, ``laurel_lr``, ``laurel_pa``
and any combination of them, e.g. ``laurel_rw+laurel_lr``).

Equations (docs/sources.md#laurel; Menghani et al. 2025, Sections 2.1-2.4), for sublayer i with
input x_i (the stream value), branch output f(x_i) and merge result x_{i+1}::

    RW:        x_{i+1} = alpha f(x_i) + beta x_i                          (2.1)
    LR:        x_{i+1} = f(x_i) + x_i + B A x_i                           (2.2, eq. 3)
    PA:        x_{i+1} = f(x_i) + x_i + sum_{j=1..k} gamma_{i,j} h_i(x_{i-j})     (2.3)
    combined:  x_{i+1} = alpha f(x_i) + beta (x_i + [LR] B A x_i
                                              + [PA] sum_{j=1..k} gamma_{i,j} h_i(x_{i-j}))

with A in R^{r x d}, B in R^{d x r}, h_i(z) = B_i A_i z (rank r; ``rank=0`` in ``laurel_pa``
makes h_i the identity, the paper's other option), and (alpha, beta) = 1 when RW is off. RW+LR
is the paper's eq. (5), x' = alpha f + beta (x + B A x); RW+LR+PA is eq. (6) with the j = 0
term of its sum given by LR's B A x_i.

Citation: Menghani, Kumar, Kumar 2025, "LAuReL: Learned Augmented Residual Layer" (ICML 2025,
arXiv 2411.07501). No official code; Gemma 3n's ``Gemma3nTextLaurelBlock`` is a production
LR variant (rank 64).

Init (every variant equals the baseline x + f(x) at initialisation, exactly):

- RW: (alpha, beta) = 2 softmax(a, b) with a = b = 0, i.e. alpha = beta = 1. The paper: "we
  cannot let alpha and beta grow unbounded, and using a normalization function such as softmax
  or sigmoid helps". Option ``norm``: ``softmax`` (default; alpha + beta = 2), ``sigmoid``
  (alpha = 2 sigmoid(a), beta = 2 sigmoid(b), each in (0, 2)) or ``none`` (raw scalars, init 1).
  The factor 2 is our choice, so that the init is the plain residual.
- LR: B = 0 (as in the paper and LoRA); A is the paper's LLM init (its footnote 2, "column
  orthogonal"): A[j, c] = 1/sqrt(r d) if c mod r = j, else 0.
- PA: B_i = 0 and A_i as for LR, gamma_{i,j} = 1 (gamma = 0 with B = 0 would leave both without
  gradient); with ``rank=0`` (identity h_i) gamma_{i,j} = 0.

Options: ``laurel_rw(norm=softmax|sigmoid|none)``; ``laurel_lr(rank=16)``;
``laurel_pa(rank=16, k=3)``. Rank 16 is the middle of the paper's best range on ResNet-50
(r in {16, 32}); its LLM runs used r = 4, 32 and 64 (r in {32, 48, 64} recommended at
d >= 512), so set ``rank`` for larger widths. k = 3 is the paper's ablation value;
``k=null`` uses every earlier sublayer's input.

Choices of our own:

- Granularity: one LAUREL instance per residual connection, i.e. per *sublayer* (attention
  and FFN each have their own alpha, beta, A, B, gamma); the "activations" x_{i-j} of PA are
  the inputs of the previous sublayers (the stream values, ``state.inputs[-j]``, back
  to the embedding), so one block holds two PA steps. A PA merge declares how many it reads
  (``inputs_kept``), and the model's state keeps that many (``model/stream.py``).
- PA sums over the k *previous* activations x_{i-1} ... x_{i-k} (a sum over
  j < i); the paper's sum also has a j = 0 term gamma_{i,0} h_i(x_i), which here is LR's
  job, so that PA and LR combine without two terms doing the same thing. Sublayer i has
  min(k, i) gamma's (the first sublayer none, and no h_i), so every parameter is used.
- One h_i per sublayer, shared by its k terms (the paper's 2rD + k parameters per layer);
  because h_i is linear it is applied once, to sum_j gamma_{i,j} x_{i-j}.
- With RW, beta multiplies the whole linear part (x_i, LR and PA terms), as eq. (5).
- A, B, gamma, alpha, beta are plain parameters (not ``nn.Linear``): the generic init pass
  does not touch them; matrices get the recipe's weight decay like every matrix.

Combination: all three methods fill the exclusive ``merge`` slot with the same key
(``"laurel"``); each one reads what the previous LAUREL fill recorded (a :class:`LaurelFactory`)
and adds its variant, so the order of the terms does not matter. Any other merge (``layerscale``,
``deepnorm``, ``ngpt``) is refused by the slot rules with a one-line message.

Parameters over the baseline (L blocks, 2L sublayers, width d):

    RW:  2 per sublayer                               = 4 L
    LR:  2 r d per sublayer                           = 4 L r d
    PA:  sum_{i=1..2L-1} (min(k, i) + 2 r d)          (2 r d -> 0 when rank = 0)

FLOPs (forward, per token; matmuls only, 2 per multiply-add): LR 2 (r d + d r) = 4 r d per
sublayer (8 L r d); PA 4 r d per sublayer that has earlier activations ((2L - 1) 4 r d;
0 with rank = 0). RW and the gamma-weighted sums are element-wise (not counted).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, option_choice, register
from modbench.model.spec import ModelSpec
from modbench.model.stream import StreamState, sublayer_index

KEY = "laurel"
RW_NORMS = ("softmax", "sigmoid", "none")
CITATION = "Menghani, Kumar, Kumar 2025, LAuReL: Learned Augmented Residual Layer (ICML)"


def pa_terms(k: int | None, index: int) -> int:
    """How many earlier activations PA mixes into sublayer ``index``: min(k, index)."""
    return index if k is None else min(k, index)


def laurel_down_init(rank: int, dim: int) -> torch.Tensor:
    """The paper's LLM init of the down factor (footnote 2): 1/sqrt(r d) where c mod r = j."""
    a = torch.zeros(rank, dim)
    cols = torch.arange(dim)
    a[cols % rank, cols] = 1.0 / math.sqrt(rank * dim)
    return a


class LaurelMerge(nn.Module):
    """``x' = alpha out + beta (x + B A x + B_p A_p sum_j gamma_j x_{i-j})``, each term optional
    (see the module docstring)."""

    def __init__(self, dim: int, rw: str | None, lr_rank: int | None,
                 pa: tuple[int, int] | None) -> None:
        super().__init__()
        self.dim, self.rw, self.lr_rank = dim, rw, lr_rank
        self.pa_rank, self.pa_terms = pa if pa is not None else (0, 0)
        self.inputs_kept = self.pa_terms  # the earlier sublayer inputs the state must keep
        if rw is not None:
            self.rw_weight = nn.Parameter(torch.empty(2))  # (alpha, beta) before normalisation
        if lr_rank is not None:
            self.lr_down = nn.Parameter(torch.empty(lr_rank, dim))  # A
            self.lr_up = nn.Parameter(torch.empty(dim, lr_rank))  # B
        if self.pa_terms:
            self.pa_gamma = nn.Parameter(torch.empty(self.pa_terms))  # gamma_{i,1..k}
            if self.pa_rank:
                self.pa_down = nn.Parameter(torch.empty(self.pa_rank, dim))
                self.pa_up = nn.Parameter(torch.empty(dim, self.pa_rank))
        self.modbench_init()

    @torch.no_grad()
    def modbench_init(self) -> None:
        if self.rw is not None:
            self.rw_weight.fill_(1.0 if self.rw == "none" else 0.0)
        if self.lr_rank is not None:
            self.lr_down.copy_(laurel_down_init(self.lr_rank, self.dim))
            self.lr_up.zero_()
        if self.pa_terms:
            self.pa_gamma.fill_(1.0 if self.pa_rank else 0.0)
            if self.pa_rank:
                self.pa_down.copy_(laurel_down_init(self.pa_rank, self.dim))
                self.pa_up.zero_()

    def residual_weights(self) -> torch.Tensor:
        """(alpha, beta) as used in the forward."""
        if self.rw == "softmax":
            return 2.0 * torch.softmax(self.rw_weight, dim=0)
        if self.rw == "sigmoid":
            return 2.0 * torch.sigmoid(self.rw_weight)
        return self.rw_weight

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        lin = x
        if self.lr_rank is not None:
            lin = lin + F.linear(F.linear(x, self.lr_down.to(x.dtype)), self.lr_up.to(x.dtype))
        if self.pa_terms:
            if len(state.inputs) < self.pa_terms:
                raise ModbenchError(
                    f"laurel_pa needs the inputs of the {self.pa_terms} previous sublayers, but "
                    f"the stream kept {len(state.inputs)}; combine it with the standard "
                    "residual stream only"
                )
            gamma = self.pa_gamma.to(x.dtype)
            mix = sum(gamma[j] * state.inputs[-1 - j] for j in range(self.pa_terms))
            if self.pa_rank:
                mix = F.linear(F.linear(mix, self.pa_down.to(x.dtype)), self.pa_up.to(x.dtype))
            lin = lin + mix
        if self.rw is None:
            return out + lin
        w = self.residual_weights().to(out.dtype)
        return w[0] * out + w[1] * lin

    def extra_repr(self) -> str:
        return (f"{self.dim}, rw={self.rw}, lr_rank={self.lr_rank}, pa_rank={self.pa_rank}, "
                f"pa_terms={self.pa_terms}")


@dataclass(frozen=True)
class LaurelFactory:
    """The ``merge`` factory of the LAUREL variants requested so far (combined by the methods)."""

    rw: str | None = None  # RW normalisation, None: no RW
    lr_rank: int | None = None  # None: no LR
    pa: tuple[int, int | None] | None = None  # (rank, k), None: no PA
    owners: tuple[str, ...] = ()

    def __call__(self, cfg: ModelConfig, layer: int, sublayer: str) -> nn.Module:
        pa = None
        if self.pa is not None:
            rank, k = self.pa
            pa = (rank, pa_terms(k, sublayer_index(layer, sublayer)))
        return LaurelMerge(cfg.d_model, self.rw, self.lr_rank, pa)


def add_variant(spec: ModelSpec, name: str, **variant: Any) -> None:
    """Fill ``merge`` with the LAUREL factory of the previous LAUREL fill plus this variant."""
    cur = spec.fills.get("merge")
    base = cur.value if cur is not None and isinstance(cur.value, LaurelFactory) else (
        LaurelFactory())
    new = dataclasses.replace(base, owners=(*base.owners, name), **variant)
    spec.fill("merge", new, by="+".join(new.owners), key=KEY)


def check_rank(method: str, rank: int, dim: int, allow_zero: bool = False) -> int:
    low = 0 if allow_zero else 1
    if not low <= rank <= dim:
        raise ModbenchError(
            f"option rank={rank} of method '{method}' must be between {low} and d_model={dim}"
        )
    return rank


@register
class LaurelRW(Method):
    name = "laurel_rw"
    category = "residual"
    citation = CITATION
    summary = "Learned residual weights: x' = alpha f(x) + beta x, (alpha, beta) = 2 softmax."
    starts_as_baseline = True

    @dataclass
    class Options:
        norm: str = "softmax"  # softmax | sigmoid | none

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        add_variant(spec, self.name, rw=option_choice(self.name, "norm", self.opts.norm,
                                                      RW_NORMS))

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * 2 * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0


@register
class LaurelLR(Method):
    name = "laurel_lr"
    category = "residual"
    citation = CITATION
    summary = "Low-rank learned residual: x' = f(x) + x + B A x (rank r, B = 0 at init)."
    starts_as_baseline = True

    @dataclass
    class Options:
        rank: int = 16

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        add_variant(spec, self.name, lr_rank=check_rank(self.name, self.opts.rank, cfg.d_model))

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.n_layers * 2 * self.opts.rank * cfg.d_model

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(2 * cfg.n_layers * 4 * self.opts.rank * cfg.d_model)


@register
class LaurelPA(Method):
    name = "laurel_pa"
    category = "residual"
    citation = CITATION
    summary = ("Previous activations: x' = f(x) + x + sum_j gamma_j h(x_{i-j}) over the k "
               "previous sublayer inputs, low-rank h.")
    starts_as_baseline = True

    @dataclass
    class Options:
        rank: int = 16  # rank of h_i; 0: h_i is the identity
        k: int | None = 3  # previous activations per sublayer; None (k=null): all of them

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        rank = check_rank(self.name, self.opts.rank, cfg.d_model, allow_zero=True)
        k = self.opts.k
        if k is not None and k < 1:
            raise ModbenchError(
                f"option k={k} of method 'laurel_pa' must be at least 1 (or null for all "
                "previous sublayers)"
            )
        add_variant(spec, self.name, pa=(rank, k))

    def _steps(self, cfg: ModelConfig) -> list[int]:
        """min(k, i) for every sublayer i that has earlier activations."""
        return [pa_terms(self.opts.k, i) for i in range(1, 2 * cfg.n_layers)]

    def extra_params(self, cfg: ModelConfig) -> int:
        low_rank = 2 * self.opts.rank * cfg.d_model
        return sum(n + low_rank for n in self._steps(cfg))

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(len(self._steps(cfg)) * 4 * self.opts.rank * cfg.d_model)
