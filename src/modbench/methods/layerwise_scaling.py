"""Layer-wise scaling (OpenELM): each layer its own number of attention heads and FFN width,
growing linearly with depth.

Equations (Mehta et al. 2024, Section 2.1), for layer i = 0 .. L-1 of width d, head size d_h::

    t_i    = i / (L - 1)                           (t_0 = 0 when L = 1)
    alpha_i = alpha_min + (alpha_max - alpha_min) t_i
    beta_i  = beta_min + (beta_max - beta_min) t_i
    n_h^i  = alpha_i d / d_h                       query heads
    m^i    = beta_i d                              FFN hidden width (SwiGLU, 3 matrices)

rounded as the reference code (corenet ``GPTConfig``, ``FeedForwardNetwork``) rounds them,
with its ``make_divisible`` (MobileNet's rule): ``r(v, D) = max(D, floor(v + D/2) // D * D)``,
plus ``D`` when that lost more than 10 % (``r < 0.9 v``)::

    n_h^i  = r(alpha_i d, d_h g) / d_h             g = n_heads / n_kv_heads (baseline group)
    n_kv^i = n_h^i / g                             GQA group size kept: heads in whole groups
    m^i    = r(beta_i d, ffn_divisor)

d_h is the baseline's head size (``cfg.head_dim``) in every layer; the KV heads keep the
baseline's GQA group size, as corenet's ``num_kv_heads = num_query_heads // num_gqa_groups``.
Layer i is built from its own config (the ``shape`` slot, ``model/spec.py``): ``n_heads =
n_h^i``, ``n_kv_heads = n_kv^i``, ``d_ff = m^i``, ``attn_head_dim = d_h``.

Matched size (``match=true``, the default): the benchmark compares at equal parameters, so the
alpha range is multiplied by one factor s_a and the beta range by one factor s_b
(``alpha_i(s) = s (alpha_min + (alpha_max - alpha_min) t_i)``; the ratio max/min and the
linear shape are kept). Attention parameters of layer i are ``2 d d_h (n_h^i + n_kv^i) = 2 d
d_h (1 + 1/g) n_h^i`` and FFN parameters ``3 d m^i``, so matching them means matching the
sums: ``H(s) = sum_i n_h^i(s)`` to ``L n_heads`` and ``F(s) = sum_i m^i(s)`` to ``L d_ff``.
Both sums are non-decreasing step functions of s (``r`` is monotone); s is found by bisection
(from ``[0, 1]``, the upper end doubled until the sum reaches the target) down to two
adjacent floats ``s_lo < s_hi`` with ``H(s_lo) < target <= H(s_hi)``, and the one whose sum is
closer to the target is taken (a tie: ``s_lo``, the smaller model). With ``match=false`` s = 1
(the options' ranges as given). :meth:`LayerwiseScaling.shapes` reports the per-layer
multipliers, heads and widths.

Parameters over the baseline (exact, from the rounded shapes; embeddings and norms
unchanged)::

    sum_i [2 d d_h (n_h^i + n_kv^i) + 3 d m^i]  -  L [2 d d_h (H + H_kv) + 3 d d_ff]

Extra forward FLOPs per token: 2 x the extra parameters (projections) plus the attention
scores and mixing of the extra heads, ``4 T d_h (sum_i n_h^i - L H)``.

Citation: Mehta et al. 2024, "OpenELM: An Efficient Language Model Family with Open-source
Training and Inference Framework" (arXiv 2404.14619); code: apple/corenet
(``corenet/modeling/models/language_modeling/general_gpt.py``).

Init: the baseline's (N(0, init_std^2) for every projection); only the shapes change. OpenELM's
defaults alpha in [0.5, 1.0], beta in [0.5, 4.0].

Choices of our own (the source is silent or works at other scales):

- ``match=true`` rescales the ranges (see above); OpenELM instead picks d and L per model
  size. The raw ranges are ``match=false``.
- FFN rounding divisor: ``ffn_divisor=8`` (``make_divisible``'s own default divisor); OpenELM
  uses 256 at d = 1280 .. 3072, which at this lab's widths (d = 64 .. 768) would round most
  layers to one size.
- corenet first rounds each multiplier to two decimals (``round(v, 2)``, its ``GPTConfig``
  ramps); ``round_multipliers=true`` does the same to the ramps before they are scaled and
  rounded to whole heads and widths, which OpenELM's released shapes need (OpenELM-270M's
  layer 5 has alpha 0.6667: unrounded it gets 12 query heads, rounded to 0.67 it gets 16 as
  released, 271,527,168 parameters with ``qknorm`` and a tied head, ``match=false,
  ffn_divisor=256``). Off by default (with matching the multipliers are not round numbers).
- Query heads are rounded in whole GQA groups (corenet's divisor ``head_dim * num_gqa_groups``,
  where its ``num_gqa_groups`` is the group size); the baseline's group size g is kept.
- OpenELM also uses QK-norm and a tied head; those are separate methods here (``qknorm``),
  so ``layerwise_scaling`` changes the shapes only.
- Any positive ranges are accepted (alpha_max < alpha_min gives shrinking layers).

Combinations: the other methods' cores and parts read the layer's config, so per-head and
per-width parameters (``qknorm``, ``ssmax``, ``gated_attn``, ...) follow the layer's sizes;
their ``extra_params`` formulas assume the baseline shape and are not exact in combination.
Cannot be combined with a ``tie`` plan that shares differently shaped layers (refused).

Syntax: ``layerwise_scaling``, ``layerwise_scaling(match=false)``,
``layerwise_scaling(alpha_min=0.25,alpha_max=1.0,beta_min=1,beta_max=4)``,
``qknorm+layerwise_scaling(match=false,ffn_divisor=256,round_multipliers=true)`` (OpenELM).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods._common import block_projection_params
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec


def make_divisible(v: float, divisor: int) -> int:
    """corenet's (MobileNet's) rounding: the nearest multiple of ``divisor`` (half up), at
    least ``divisor``, one ``divisor`` more when rounding down lost over 10 %."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new < 0.9 * v:
        new += divisor
    return new


def ramp(lo: float, hi: float, n_layers: int) -> list[float]:
    """``lo + (hi - lo) i / (L - 1)`` for i = 0 .. L-1 (``[lo]`` when L = 1)."""
    if n_layers == 1:
        return [lo]
    return [lo + (hi - lo) * i / (n_layers - 1) for i in range(n_layers)]


def closest_scale(total: Callable[[float], int], target: int) -> float:
    """The scale s >= 0 whose rounded ``total(s)`` (non-decreasing in s) is closest to
    ``target``: bisection to adjacent floats s_lo < s_hi around the first s reaching the
    target; a tie goes to s_lo (the smaller total)."""
    lo, hi = 0.0, 1.0
    while total(hi) < target:
        hi *= 2.0
    while True:
        mid = (lo + hi) / 2.0
        if not lo < mid < hi:
            break
        if total(mid) >= target:
            hi = mid
        else:
            lo = mid
    below = total(lo)
    if below >= target or target - below > total(hi) - target:
        return hi
    return lo


@dataclass(frozen=True)
class LayerShapes:
    """Per-layer multipliers and sizes of one model (index = layer)."""

    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    d_ff: tuple[int, ...]
    alpha_scale: float  # s_a (1 with match=false)
    beta_scale: float  # s_b


@register
class LayerwiseScaling(Method):
    name = "layerwise_scaling"
    category = "architecture"
    citation = ("Mehta et al. 2024, OpenELM: An Efficient Language Model Family with "
                "Open-source Training and Inference Framework (arXiv 2404.14619)")
    summary = ("OpenELM's layer-wise scaling: heads and FFN width grow linearly with depth "
               "(alpha, beta ramps), rescaled to the baseline's parameter count.")

    @dataclass
    class Options:
        alpha_min: float = 0.5  # attention multiplier of the first layer (heads = alpha d/d_h)
        alpha_max: float = 1.0  # ... of the last layer
        beta_min: float = 0.5  # FFN multiplier of the first layer (width = beta d)
        beta_max: float = 4.0  # ... of the last layer
        match: bool = True  # rescale both ranges to the baseline's attention / FFN parameters
        ffn_divisor: int = 8  # FFN widths are multiples of this (make_divisible)
        round_multipliers: bool = False  # round each ramp value to 2 decimals, as corenet

    def _check(self) -> None:
        o = self.opts
        for key in ("alpha_min", "alpha_max", "beta_min", "beta_max"):
            v = getattr(o, key)
            if not (math.isfinite(v) and v > 0):
                raise ModbenchError(f"option {key}={v} of method 'layerwise_scaling' must be a "
                                    "positive number")
        if o.ffn_divisor < 1:
            raise ModbenchError(f"option ffn_divisor={o.ffn_divisor} of method "
                                "'layerwise_scaling' must be at least 1")

    def shapes(self, cfg: ModelConfig) -> LayerShapes:
        """The per-layer sizes for the model config ``cfg`` (the formulas above)."""
        self._check()
        o, n, d, dh = self.opts, cfg.n_layers, cfg.d_model, cfg.head_dim
        g = cfg.n_heads // cfg.n_kv_heads
        a0, b0 = ramp(o.alpha_min, o.alpha_max, n), ramp(o.beta_min, o.beta_max, n)
        if o.round_multipliers:
            a0, b0 = [round(a, 2) for a in a0], [round(b, 2) for b in b0]

        def heads(s: float) -> list[int]:
            return [make_divisible(s * a * d, dh * g) // dh for a in a0]

        def widths(s: float) -> list[int]:
            return [make_divisible(s * b * d, o.ffn_divisor) for b in b0]

        sa = sb = 1.0
        if o.match:
            sa = closest_scale(lambda s: sum(heads(s)), n * cfg.n_heads)
            sb = closest_scale(lambda s: sum(widths(s)), n * cfg.d_ff)
        h = heads(sa)
        return LayerShapes(tuple(sa * a for a in a0), tuple(sb * b for b in b0), tuple(h),
                           tuple(x // g for x in h), tuple(widths(sb)), sa, sb)

    def layer_cfgs(self, cfg: ModelConfig) -> list[ModelConfig]:
        """Each layer's config under the plan (what the ``shape`` slot gives the builder)."""
        p = self.shapes(cfg)
        return [dataclasses.replace(cfg, n_heads=h, n_kv_heads=kv, d_ff=m,
                                    attn_head_dim=cfg.head_dim)
                for h, kv, m in zip(p.heads, p.kv_heads, p.d_ff, strict=True)]

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        layers = self.layer_cfgs(cfg)

        def shape(c: ModelConfig, layer: int) -> ModelConfig:
            return layers[layer]

        spec.fill("shape", shape, by=self.name)

    def _delta(self, cfg: ModelConfig) -> tuple[int, int]:
        """(extra parameters, extra query heads summed over layers)."""
        layers = self.layer_cfgs(cfg)
        params = sum(block_projection_params(c) for c in layers)
        return (params - cfg.n_layers * block_projection_params(cfg),
                sum(c.n_heads for c in layers) - cfg.n_layers * cfg.n_heads)

    def extra_params(self, cfg: ModelConfig) -> int:
        return self._delta(cfg)[0]

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        params, heads = self._delta(cfg)
        return float(2 * params + 4 * seq_len * cfg.head_dim * heads)
