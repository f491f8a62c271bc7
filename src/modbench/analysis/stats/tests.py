"""Tests and intervals (docs/statistics.md, "The test per method", "Welch's t", "Failures
judged as rates", "Effect sizes, intervals and the detectable effect"): Welch's t, the
prediction test, the Brown–Forsythe check, Fisher's exact test of failure rates, the
minimum detectable effect and the decision threshold. Each is a ``scipy.stats`` call with this
package's documented edge cases around it; the verdict rule
(:mod:`modbench.analysis.stats.verdict`) chooses among them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

import numpy as np
from scipy import stats as _sps

from modbench.analysis.stats.corrections import Correction
from modbench.analysis.stats.distributions import Alternative, normal_isf, t_isf, t_p
from modbench.analysis.stats.floor import NoiseFloor
from modbench.analysis.stats.scores import NAN, Scores, finite

#: The Brown–Forsythe check's level: the pooled test is used when it does not reject.
HOMOGENEITY_ALPHA: Final = 0.05
#: The power at which :func:`~modbench.analysis.stats.compare` states each method's minimum
#: detectable effect.
MDE_POWER: Final = 0.8


# --------------------------------------------------------------------------------------------
# Welch's t


@dataclass(frozen=True)
class WelchResult:
    """Welch's unequal-variance t-test of ``mean(a) - mean(b)``."""

    t: float
    df: float
    p: float
    alternative: str
    n_a: int
    n_b: int
    mean_diff: float


def welch_t(a: Scores, b: Scores, *, alternative: Alternative = "two-sided") -> WelchResult:
    """Welch's t for the finite seeds of ``a`` against those of ``b``
    (``scipy.stats.ttest_ind(equal_var=False)``).

    Needs >= 2 finite seeds per group, else t, df and p are NaN. When both groups have zero
    variance the test is undefined: t = ±inf (or NaN if the means are equal), df and p NaN
    (scipy reports p = 0 with df = 1 there; we deliberately do not). scipy's "precision loss"
    warning for (nearly) constant groups is silenced: a constant group is a valid input here.
    """
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative must be two-sided, greater or less, not {alternative!r}")
    xa, xb = finite(a), finite(b)
    na, nb = int(xa.size), int(xb.size)
    diff = float(xa.mean() - xb.mean()) if na and nb else NAN
    if na < 2 or nb < 2:
        return WelchResult(NAN, NAN, NAN, alternative, na, nb, diff)
    if np.var(xa) == 0.0 and np.var(xb) == 0.0:
        t = NAN if diff == 0.0 else math.copysign(math.inf, diff)
        return WelchResult(t, NAN, NAN, alternative, na, nb, diff)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        r = _sps.ttest_ind(xa, xb, equal_var=False, alternative=alternative)
    return WelchResult(float(r.statistic), float(r.df), float(r.pvalue), alternative, na, nb,
                       diff)


# --------------------------------------------------------------------------------------------
# One method's test on its own: the prediction test or Welch's


@dataclass(frozen=True)
class MethodTest:
    """The test of one method's seeds against the floor (see :func:`method_test`)."""

    test: str
    t: float
    df: float
    p: float
    welch: WelchResult | None = None  # Welch's result as welch_t gives it (raw sign)


def zero_spread_t(improvement: float) -> float:
    """The t of a difference over a zero standard error: ±inf, or 0 for no difference."""
    return 0.0 if improvement == 0.0 else math.copysign(math.inf, improvement)


def method_test(scores: Scores, floor: NoiseFloor, baseline: Scores = None) -> MethodTest:
    """The two-sided test :func:`~modbench.analysis.stats.compare` applies to a method with
    these seeds when the groups do not share an error term.

    * no finite seed, or no floor: ``"none"`` (t, df, p NaN);
    * one finite seed: ``"prediction"``, is it outside the baseline's prediction interval?
      ``t = improvement / (sigma * sqrt(1 + 1/n_b))`` with the floor's ``df`` (``n_b - 1``
      for the baseline's sigma, pooled for ``"pooled"`` / ``"max"``);
    * two or more: ``"welch"``, Welch's t of the method's finite seeds against ``baseline``'s
      (required then), t signed so that positive = better.

    Zero spread (sigma = 0 for the prediction test; both groups constant for Welch, where
    :func:`welch_t` gives p NaN): ``t = ±inf``, p = 0 when the means differ, ``t = 0``, p = 1
    when they are equal, as for z.
    """
    x = finite(scores)
    if not floor.defined or x.size == 0:
        return MethodTest("none", NAN, NAN, NAN)
    imp = floor.sign * (float(x.mean()) - floor.mean)
    if x.size == 1:
        se = floor.sigma * math.sqrt(1.0 + 1.0 / floor.n)
        t = zero_spread_t(imp) if se == 0.0 else imp / se
        return MethodTest("prediction", t, floor.df, t_p(t, floor.df, "two-sided"))
    if baseline is None:
        raise ValueError("Welch's test (>= 2 seeds) needs the baseline's seeds")
    w = welch_t(x, baseline)
    if math.isnan(w.p) and w.n_b >= 2:  # both groups constant
        t = zero_spread_t(imp)
        return MethodTest("welch", t, NAN, 1.0 if t == 0.0 else 0.0, w)
    return MethodTest("welch", floor.sign * w.t, w.df, w.p, w)


# --------------------------------------------------------------------------------------------
# Equal variances: the Brown–Forsythe check


def homogeneity(groups: Iterable[Scores]) -> float:
    """Brown–Forsythe p that the groups' variances are equal (``scipy.stats.levene`` with
    ``center="median"``, robust to heavy tails) over the groups with >= 2 finite seeds; NaN
    with fewer than 2 such groups or when every such group is constant."""
    xs = [x for x in (finite(g) for g in groups) if x.size >= 2]
    if len(xs) < 2 or all(float(np.ptp(x)) == 0.0 for x in xs):
        return NAN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(_sps.levene(*xs, center="median").pvalue)
    return p


# --------------------------------------------------------------------------------------------
# Failure rates: Fisher's exact test


def fisher(k: int, n: int, k_b: int, n_b: int) -> float:
    """Two-sided Fisher exact p of k failures of n against k_b of n_b (``scipy``)."""
    return float(_sps.fisher_exact([[k, n - k], [k_b, n_b - k_b]]).pvalue)


@lru_cache(maxsize=1024)
def fisher_min_p(n: int, n_b: int, total: int) -> float:
    """The smallest two-sided Fisher p any table with these margins (n and n_b seeds, ``total``
    failures between them) can give: a test whose smallest p exceeds alpha can never reject,
    so it is left out of the family (Tarone 1990, "A modified Bonferroni method for discrete
    data", Biometrics 46: the family counts only tests that can reach the level)."""
    ks = range(max(0, total - n_b), min(n, total) + 1)
    return min(fisher(k, n, total - k, n_b) for k in ks)


# --------------------------------------------------------------------------------------------
# The detectable effect and the decision threshold


def _power(d: float, n: int, n_baseline: int, df: float, alpha: float) -> float:
    """Two-sided t test's power at effect d (sigmas): the noncentral t of
    ``statsmodels.stats.power.TTestIndPower`` written with ``scipy.stats.nct``, whose far tail
    (NaN in both libraries at large noncentrality, scipy 1.17 / statsmodels 0.15) is taken as
    0."""
    nc = d / math.sqrt(1.0 / n + 1.0 / n_baseline)
    c = float(_sps.t.isf(alpha / 2.0, df))
    upper = float(_sps.nct.sf(c, df, nc))
    lower = float(_sps.nct.cdf(-c, df, nc))
    return (upper if math.isfinite(upper) else 1.0) + (lower if math.isfinite(lower) else 0.0)


@lru_cache(maxsize=512)
def _detectable_d(n: int, n_baseline: int, df: float, alpha: float, power: float) -> float:
    from scipy.optimize import brentq

    def gap(d: float) -> float:
        return _power(d, n, n_baseline, df, alpha) - power

    hi = 1.0
    while gap(hi) < 0.0:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return float(brentq(gap, 0.0, hi, xtol=1e-6))


def detectable_effect(n: int, n_baseline: int, df: float, *, alpha: float = 0.05,
                      n_tests: int = 1, power: float = MDE_POWER,
                      floor_sigmas: float = 1.0) -> float:
    """Minimum detectable effect, in sigmas, of a method of ``n`` seeds against a baseline of
    ``n_baseline`` seeds by a two-sided t test with ``df`` degrees of freedom at level
    ``alpha / n_tests`` (Holm's first step, Bonferroni's every step: conservative for Holm) with
    probability ``power``: the noncentral-t power (noncentrality
    ``d / sqrt(1/n + 1/n_baseline)``, see :func:`_power`) solved for d, and at least
    ``floor_sigmas`` (the verdict's |delta| guard). NaN for undefined inputs. ``n = 1`` with
    ``df = n_baseline - 1`` is exactly the prediction test."""
    if n < 1 or n_baseline < 2 or not math.isfinite(df) or df <= 0 or n_tests < 1:
        return NAN
    d = _detectable_d(int(n), int(n_baseline), float(df), alpha / n_tests, power)
    return max(d, floor_sigmas)


def decision_threshold(
    sigma: float,
    n_tests: int = 1,
    *,
    alpha: float = 0.05,
    correction: Correction = "holm",
    floor_sigmas: float = 1.0,
    n: int = 1,
    n_baseline: int | None = None,
    df: float | None = None,
) -> float:
    """The |improvement| (metric units) a method's mean over ``n`` seeds must exceed to be
    decided against a baseline of ``n_baseline`` seeds.

    ``sigma * max(floor_sigmas, q * sqrt(1/n + 1/n_baseline))`` with ``q`` the Student-t
    quantile ``t^-1(1 - alpha / (2 m))`` with ``df`` degrees of freedom (default
    ``n_baseline - 1``: the baseline's sigma; pass the floor's ``df`` for a pooled floor).
    ``m = n_tests`` for bonferroni, holm and bh (Holm's and BH's thresholds depend on the other
    p-values; the Bonferroni one is the strictest step of both, hence conservative) and m = 1
    for ``"none"``. For ``n = 1`` this is exactly the prediction test of
    :func:`~modbench.analysis.stats.compare`; for ``n >= 2`` it approximates Welch's test by
    taking the method's seeds as spread like the baseline's. ``n_baseline=None`` takes the
    baseline's mean and sigma as exact (normal quantile, factor ``sqrt(1/n)``): the reference
    of earlier versions, which overstates certainty with a few baseline seeds. NaN if sigma is
    undefined.
    """
    if not math.isfinite(sigma):
        return NAN
    m = 1 if correction == "none" else max(1, n_tests)
    n = max(1, n)
    if n_baseline is None:
        q, spread = normal_isf(alpha / (2.0 * m)), math.sqrt(1.0 / n)
    else:
        dof = float(n_baseline - 1) if df is None else float(df)
        q, spread = t_isf(alpha / (2.0 * m), dof), math.sqrt(1.0 / n + 1.0 / n_baseline)
    return sigma * max(floor_sigmas, q * spread)
