"""The noise floor (seed study §3.3; docs/statistics.md, "Noise floor" and "z: the effect
size"): the baseline's mean and the per-seed sigma that z-scores and the verdict's |delta|
guard divide by, with the degrees of freedom of that sigma."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np

from modbench.analysis.stats.scores import NAN, Scores, finite, group

SigmaSource: TypeAlias = Literal["baseline", "pooled", "max"]


def sample_std(scores: Scores) -> float:
    """Unbiased (ddof=1) std of the finite scores; NaN with fewer than 2."""
    x = finite(scores)
    return float(np.std(x, ddof=1)) if x.size >= 2 else NAN


def pooled(groups: Iterable[Scores]) -> tuple[float, int]:
    """:func:`pooled_std` and its degrees of freedom ``sum(n_i - 1)``."""
    ss, dof = 0.0, 0
    for g in groups:
        x = finite(g)
        if x.size >= 2:
            ss += float(np.sum((x - x.mean()) ** 2))
            dof += x.size - 1
    return (math.sqrt(ss / dof) if dof else NAN), dof


def pooled_std(groups: Iterable[Scores]) -> float:
    """Pooled std ``sqrt(sum((n_i - 1) s_i^2) / sum(n_i - 1))`` over groups of seeds (groups
    with fewer than 2 finite seeds contribute nothing); NaN when no group has 2 seeds."""
    return pooled(groups)[0]


@dataclass(frozen=True)
class NoiseFloor:
    """The baseline's multi-seed reference: mean, n, the sigma that z-scores divide by, and
    ``df``, the degrees of freedom of that sigma (``n - 1`` for the baseline's own std, the
    pooled ``sum(n_i - 1)`` for ``"pooled"`` and ``"max"``; NaN without a floor)."""

    mean: float
    sigma: float
    n: int
    higher_is_better: bool = True
    sigma_source: str = "baseline"
    baseline_std: float = NAN
    reference_stds: Mapping[str, float] = field(default_factory=dict)
    n_diverged: int = 0
    df: float = NAN

    @property
    def defined(self) -> bool:
        """True when z-scores can be formed (>= 2 finite baseline seeds, finite sigma)."""
        return self.n >= 2 and math.isfinite(self.sigma) and math.isfinite(self.mean)

    @property
    def sign(self) -> float:
        """+1 if higher scores are better, -1 otherwise."""
        return 1.0 if self.higher_is_better else -1.0


def noise_floor(
    baseline: Scores,
    *,
    higher_is_better: bool = True,
    references: Mapping[str, Scores] | None = None,
    sigma: SigmaSource = "baseline",
) -> NoiseFloor:
    """Noise floor from the baseline's seeds (and optional reference configurations' seeds).

    ``sigma="baseline"`` (seed study): the baseline's ddof=1 std, ``n - 1`` degrees of freedom.
    ``"pooled"``: pooled std of the baseline and every reference (see :func:`pooled_std`).
    ``"max"``: the largest defined std among them. Both of the latter take the pooled degrees of
    freedom ``sum(n_i - 1)`` (for ``"max"`` a slightly generous choice: the largest std is
    conservative, its df are counted as if pooled). The floor is undefined (``defined`` False)
    when the baseline has fewer than 2 finite seeds, whatever the references: without a
    baseline spread there is no floor.
    """
    g = group(baseline)
    x = g.finite
    mean = float(x.mean()) if x.size else NAN
    base_std = sample_std(x)
    refs = dict(references or {})
    ref_stds = {name: sample_std(s) for name, s in refs.items()}
    pooled_s, pooled_df = pooled([x, *refs.values()])
    if sigma == "baseline":
        s, df = base_std, float(x.size - 1)
    elif sigma == "pooled":
        s, df = pooled_s, float(pooled_df)
    elif sigma == "max":
        cands = [v for v in (base_std, *ref_stds.values()) if math.isfinite(v)]
        s, df = (max(cands) if cands else NAN), float(pooled_df)
    else:
        raise ValueError(f"sigma must be baseline, pooled or max, not {sigma!r}")
    if x.size < 2:
        s, df = NAN, NAN
    return NoiseFloor(
        mean=mean,
        sigma=s,
        n=int(x.size),
        higher_is_better=higher_is_better,
        sigma_source=sigma,
        baseline_std=base_std,
        reference_stds=ref_stds,
        n_diverged=g.n_diverged,
        df=df,
    )


def z_score(scores: Scores | float, floor: NoiseFloor) -> float:
    """``z = sign * (mean(scores) - floor.mean) / floor.sigma`` (positive = better).

    NaN when the floor is undefined or there is no finite score. ``sigma == 0``: ±inf when the
    difference is non-zero, 0 when it is exactly zero.
    """
    x = finite([float(scores)] if isinstance(scores, int | float) else scores)
    if not floor.defined or x.size == 0:
        return NAN
    imp = floor.sign * (float(x.mean()) - floor.mean)
    if floor.sigma == 0.0:
        return 0.0 if imp == 0.0 else math.copysign(math.inf, imp)
    return imp / floor.sigma
