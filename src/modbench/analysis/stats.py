"""Statistics for deciding which methods beat the baseline against a multi-seed noise floor.

Implements the protocol of the seed study (arXiv 2605.20798, docs/sources.md#seed-002) §3.3
(noise floor), §4-§5 (tests, corrections, Spearman across scales) and Appendix E.4 (per-task
Welch + Stouffer), with one deliberate change: the verdict accounts for the noise floor being
*estimated* from a few seeds (a t reference, not a normal one). Pure functions and small frozen
dataclasses over numpy, scipy and statsmodels; no
I/O. ``docs/statistics.md`` states every rule; the short version:

* **Orientation.** ``higher_is_better=True`` for accuracies (CLIMB-avg), ``False`` for losses.
  ``delta`` is always the raw ``mean(method) - mean(baseline)`` in metric units;
  ``improvement`` is ``delta`` signed so that positive = better, and ``z`` and ``t`` have the
  same sign.
* **Failures: divergence and stalls, judged as rates.** ``None``, NaN or ±inf in place of a
  score (or ``None`` in place of a whole method) is a failed run: a result, not an error. A
  failed run diverged unless ``compare``'s ``stalled`` counts it as stalled (a run that ended
  at the unigram level with finite losses, ``modbench.runtime.stall``): its score is not an
  ordinary value either, so the caller passes it as ``None`` too. A method's k failed seeds of
  n are tested against the baseline's with Fisher's exact test in the verdict's Holm family
  (left out where it cannot reach alpha at those counts: Tarone 1990). The method is
  ``diverged`` (any diverged seed) or ``stalled`` when that test shows it fails more often, or
  when no seed survived; otherwise its surviving seeds are compared like any method's, with a
  note. A baseline with failed seeds keeps its floor only with 3 finite seeds. Methods with a
  failed seed are never asked for more seeds (``undecided``).
* **Noise floor.** ``sigma`` is the unbiased (ddof=1) std of the baseline's seeds
  (``"baseline"``, the seed study's choice, ``n_b - 1`` degrees of freedom), or the pooled std
  of the baseline and the reference configurations (``"pooled"``), or the largest of their
  stds (``"max"``); both of the latter carry the pooled degrees of freedom ``sum(n_i - 1)``.
  With fewer than 2 finite baseline seeds there is no noise floor: z, t, p and the verdicts
  are ``undetermined``.
* **z-score.** ``z = improvement / sigma``, descriptive only (the effect in units of the
  per-seed floor). ``sigma == 0``: ``z = ±inf`` when ``delta != 0``, ``z = 0`` when it is 0.
* **Test** (two-sided; ``t`` signed like ``z``): when the Brown–Forsythe check does not
  reject equal variances, the *pooled* t with the error term of all the scale's groups
  (``df = sum(n_i - 1)``); otherwise, by the method's finite seeds, one seed → the
  *prediction* test ``t = improvement / (sigma * sqrt(1 + 1/n_b))`` with the floor's degrees
  of freedom, two or more → *Welch's* t. No verdict from an estimated sigma of 0 or below
  ``RESOLUTION`` (1e-6) of the baseline's mean: ``undetermined``.
* **Verdict.** ``improver`` / ``degrader`` when the corrected p (default **Holm** over the
  score tests and the failure-rate tests) is ``<= alpha`` (default 0.05) *and*
  ``|delta| > floor_sigmas * sigma`` (default 1 sigma); otherwise ``within_noise``, whose
  ``note`` reads "not shown: |Δ| < MDE" where that is true. Every compared method has the
  test's Bonferroni-simultaneous interval for delta (``ci``) and its minimum detectable effect
  at 80 % power (``mde``, ``mde_sigma``). ``fewer_seeds`` marks a method with fewer finite
  seeds than the baseline.
* **Sequential seeds** (``study run --until-decided``): :func:`sequential_look` is one look of
  a group-sequential design, :func:`compare` at the alpha the look spends (Lan & DeMets 1983
  spending, :func:`alpha_spent`), the baseline's seeds first; :func:`sequential_verdicts`
  gives the final verdicts at the alpha spent at the last look.
* **Bootstrap.** Percentile intervals from ``n_resamples`` (default 10,000) resamples of the
  seeds with replacement, ``np.random.default_rng(seed)`` created afresh for every method (so
  a method's interval does not depend on the other methods in the table). Paired (one index
  draw shared by both groups) only when both groups are given as ``{seed: score}`` mappings
  over the same seeds (or ``paired=True`` with equal-length lists); unpaired otherwise.

Which parts are library calls: the normal, Student-t and noncentral-t distributions
(``scipy.stats.norm``, ``scipy.stats.t``, ``scipy.stats.nct``), Welch's t
(``scipy.stats.ttest_ind(equal_var=False)``), Brown–Forsythe (``scipy.stats.levene``),
Fisher's exact test (``scipy.stats.fisher_exact``), Stouffer
(``scipy.stats.combine_pvalues(method="stouffer")``), ranks and Spearman
(``scipy.stats.rankdata``, ``scipy.stats.spearmanr``), Bonferroni and Benjamini–Hochberg
(``statsmodels.stats.multitest.multipletests``). Around each call this module keeps its own
documented edge cases (NaN and diverged seeds dropped, Welch with both groups constant gives
p NaN where scipy says 0, Spearman p NaN for n <= 2, ...). Two procedures stay our own code:

* **Holm** is the four-line step-down below, not ``multipletests(method="holm")``: statsmodels'
  Holm branch calls ``gc.collect()`` on every call, which costs ~130 ms in a process holding
  torch (measured), and ``compare`` computes it for every table. The tests check it against
  statsmodels.
* **The seed bootstrap** is our own. ``scipy.stats.bootstrap(method="percentile")`` given
  the same generator reproduces our one-sample and paired intervals (checked with scipy
  1.17), but it refuses a group with one seed, the protocol's most common case (a single-seed
  method's difference interval reflects only the baseline's spread, the seed study's
  "baseline bootstrap interval"); it draws an unpaired resample's groups in the other order
  (method first, where the documented draws take the baseline first); and it has no
  ``prob_not_better`` or pairing by seed label. Using it would need our code for exactly the
  cases the study runs most, so the ~20 lines stay. The tests check the intervals against
  ``scipy.stats.bootstrap``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any, Final, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
from scipy import stats as _sps

__all__ = [
    "CORRECTIONS",
    "DEFAULT_SPENDING",
    "HOMOGENEITY_ALPHA",
    "MDE_POWER",
    "MIN_SURVIVING_BASELINE",
    "RESOLUTION",
    "SPENDING",
    "TESTS",
    "Adjusted",
    "BootstrapDifference",
    "Look",
    "MethodResult",
    "MethodTest",
    "NoiseFloor",
    "PerTaskResult",
    "Scores",
    "SeedRequest",
    "SpearmanResult",
    "StoufferResult",
    "TaskTest",
    "Verdict",
    "WelchResult",
    "adjust_pvalues",
    "alpha_spent",
    "baseline_target",
    "bootstrap_difference",
    "bootstrap_mean_ci",
    "compare",
    "decide",
    "decision_threshold",
    "detectable_effect",
    "homogeneity",
    "information_fraction",
    "method_test",
    "noise_floor",
    "normal_isf",
    "normal_sf",
    "p_two_sided",
    "per_task_stouffer",
    "pooled_std",
    "rankdata",
    "sample_std",
    "sequential_alpha",
    "sequential_look",
    "sequential_verdicts",
    "spearman",
    "spearman_across_scales",
    "stouffer",
    "t_sf",
    "undecided",
    "welch_t",
    "z_score",
]

Score: TypeAlias = float | None
#: One configuration's per-seed scores: a list (seeds unlabeled), a ``{seed: score}`` mapping
#: (seeds labeled: allows pairing), or ``None`` when the configuration failed. ``None`` / NaN
#: / ±inf entries are failed seeds: diverged, or stalled where ``compare``'s ``stalled`` says so.
Scores: TypeAlias = Sequence[Score] | Mapping[Any, Score] | npt.ArrayLike | None
SigmaSource: TypeAlias = Literal["baseline", "pooled", "max"]
Correction: TypeAlias = Literal["bonferroni", "holm", "bh", "none"]
Alternative: TypeAlias = Literal["two-sided", "greater", "less"]

#: The corrections computed by :func:`compare` (``"none"`` is the raw p-value).
CORRECTIONS: tuple[str, ...] = ("bonferroni", "holm", "bh")
DEFAULT_RESAMPLES = 10_000

_NAN = float("nan")


class Verdict(StrEnum):
    """Outcome for one method (compares equal to its string value)."""

    BASELINE = "baseline"
    IMPROVER = "improver"
    WITHIN_NOISE = "within_noise"
    DEGRADER = "degrader"
    DIVERGED = "diverged"
    STALLED = "stalled"
    UNDETERMINED = "undetermined"


# --------------------------------------------------------------------------------------------
# Input normalisation


@dataclass(frozen=True)
class _Group:
    """Normalised scores: finite values, diverged count, seed labels (None if unlabeled)."""

    values: npt.NDArray[np.float64]  # all entries, NaN for diverged seeds
    labels: tuple[Any, ...] | None
    whole_none: bool = False

    @property
    def finite(self) -> npt.NDArray[np.float64]:
        return self.values[np.isfinite(self.values)]

    @property
    def n(self) -> int:
        return int(np.isfinite(self.values).sum())

    @property
    def n_diverged(self) -> int:
        return 1 if self.whole_none else int((~np.isfinite(self.values)).sum())


def _to_float(x: Any) -> float:
    if x is None:
        return _NAN
    v = float(x)
    return v if math.isfinite(v) else _NAN


def _group(scores: Scores) -> _Group:
    if scores is None:
        return _Group(np.empty(0), None, whole_none=True)
    if isinstance(scores, Mapping):
        labels = tuple(scores.keys())
        vals = np.array([_to_float(scores[k]) for k in labels], dtype=np.float64)
        return _Group(vals, labels)
    arr = np.asarray(scores, dtype=object).ravel()
    vals = np.array([_to_float(x) for x in arr], dtype=np.float64)
    return _Group(vals, None)


def _finite(x: Scores) -> npt.NDArray[np.float64]:
    return _group(x).finite


# --------------------------------------------------------------------------------------------
# Distributions (scipy.stats.norm and scipy.stats.t, with this module's NaN / edge conventions)


def normal_sf(z: float) -> float:
    """``1 - Phi(z)``, accurate in the upper tail (``scipy.stats.norm.sf``)."""
    if math.isnan(z):
        return _NAN
    return float(_sps.norm.sf(z))


def normal_isf(p: float) -> float:
    """``z`` with ``normal_sf(z) == p``; ``+inf`` for p = 0, ``-inf`` for p = 1, NaN outside."""
    if math.isnan(p) or p < 0.0 or p > 1.0:
        return _NAN
    return float(_sps.norm.isf(p))


def p_two_sided(z: float) -> float:
    """Two-sided normal p-value ``2 * (1 - Phi(|z|))`` (1 at z = 0, 0 at z = ±inf)."""
    if math.isnan(z):
        return _NAN
    return min(1.0, 2.0 * normal_sf(abs(z)))


def t_sf(t: float, df: float) -> float:
    """Survival function ``P(T > t)`` of Student's t with (possibly fractional) ``df``
    (``scipy.stats.t.sf``); the normal one for ``df = inf``, NaN for ``df <= 0`` or NaN."""
    if math.isnan(t) or math.isnan(df) or df <= 0:
        return _NAN
    if math.isinf(df):
        return normal_sf(t)
    return float(_sps.t.sf(t, df))


def _t_isf(p: float, df: float) -> float:
    """``t`` with ``t_sf(t, df) == p`` (the normal quantile for ``df = inf``)."""
    if math.isnan(p) or math.isnan(df) or df <= 0:
        return _NAN
    return normal_isf(p) if math.isinf(df) else float(_sps.t.isf(p, df))


def _t_p(t: float, df: float, alternative: Alternative) -> float:
    if alternative == "greater":
        return t_sf(t, df)
    if alternative == "less":
        return t_sf(-t, df)
    if alternative == "two-sided":
        return _NAN if math.isnan(t) else min(1.0, 2.0 * t_sf(abs(t), df))
    raise ValueError(f"alternative must be two-sided, greater or less, not {alternative!r}")


# --------------------------------------------------------------------------------------------
# Noise floor


def sample_std(scores: Scores) -> float:
    """Unbiased (ddof=1) std of the finite scores; NaN with fewer than 2."""
    x = _finite(scores)
    return float(np.std(x, ddof=1)) if x.size >= 2 else _NAN


def _pooled(groups: Iterable[Scores]) -> tuple[float, int]:
    ss, dof = 0.0, 0
    for g in groups:
        x = _finite(g)
        if x.size >= 2:
            ss += float(np.sum((x - x.mean()) ** 2))
            dof += x.size - 1
    return (math.sqrt(ss / dof) if dof else _NAN), dof


def pooled_std(groups: Iterable[Scores]) -> float:
    """Pooled std ``sqrt(sum((n_i - 1) s_i^2) / sum(n_i - 1))`` over groups of seeds (groups
    with fewer than 2 finite seeds contribute nothing); NaN when no group has 2 seeds."""
    return _pooled(groups)[0]


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
    baseline_std: float = _NAN
    reference_stds: Mapping[str, float] = field(default_factory=dict)
    n_diverged: int = 0
    df: float = _NAN

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
    g = _group(baseline)
    x = g.finite
    mean = float(x.mean()) if x.size else _NAN
    base_std = sample_std(x)
    refs = dict(references or {})
    ref_stds = {name: sample_std(s) for name, s in refs.items()}
    pooled, pooled_df = _pooled([x, *refs.values()])
    if sigma == "baseline":
        s, df = base_std, float(x.size - 1)
    elif sigma == "pooled":
        s, df = pooled, float(pooled_df)
    elif sigma == "max":
        cands = [v for v in (base_std, *ref_stds.values()) if math.isfinite(v)]
        s, df = (max(cands) if cands else _NAN), float(pooled_df)
    else:
        raise ValueError(f"sigma must be baseline, pooled or max, not {sigma!r}")
    if x.size < 2:
        s, df = _NAN, _NAN
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
    x = _finite([float(scores)] if isinstance(scores, int | float) else scores)
    if not floor.defined or x.size == 0:
        return _NAN
    imp = floor.sign * (float(x.mean()) - floor.mean)
    if floor.sigma == 0.0:
        return 0.0 if imp == 0.0 else math.copysign(math.inf, imp)
    return imp / floor.sigma


# --------------------------------------------------------------------------------------------
# Seed bootstrap


def _percentile_ci(boot: npt.NDArray[np.float64], confidence: float) -> tuple[float, float]:
    lo, hi = np.quantile(boot, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(lo), float(hi)


def _check_boot_args(n_resamples: int, confidence: float) -> None:
    if n_resamples < 1:
        raise ValueError("n_resamples must be >= 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")


def bootstrap_mean_ci(
    scores: Scores,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of the finite seeds (resampled with
    replacement); (NaN, NaN) with no finite seed, a point with one seed or identical seeds."""
    _check_boot_args(n_resamples, confidence)
    x = _finite(scores)
    if x.size == 0:
        return _NAN, _NAN
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    return _percentile_ci(x[idx].mean(axis=1), confidence)


@dataclass(frozen=True)
class BootstrapDifference:
    """Bootstrap of ``mean(method) - mean(baseline)`` (raw metric units)."""

    ci: tuple[float, float]
    prob_not_better: float  # fraction of resamples with sign * difference <= 0
    paired: bool
    n_resamples: int
    n_method: int
    n_baseline: int


def _pairable(a: _Group, b: _Group) -> bool:
    return (
        a.labels is not None
        and b.labels is not None
        and set(a.labels) == set(b.labels)
        and len(a.labels) >= 2
    )


def _can_pair(a: _Group, b: _Group) -> bool:
    unlabeled = a.labels is None and b.labels is None and a.values.size == b.values.size >= 2
    return _pairable(a, b) or unlabeled


def bootstrap_difference(
    method: Scores,
    baseline: Scores,
    *,
    higher_is_better: bool = True,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    paired: bool | None = None,
) -> BootstrapDifference:
    """Seed bootstrap of the difference of means, method minus baseline.

    ``paired=None`` (auto): paired when both groups are ``{seed: score}`` mappings over the
    same seed set (>= 2 seeds); unpaired otherwise. ``paired=True`` also accepts lists of equal
    length (position i = the same seed); it raises ValueError if the groups cannot be paired.
    Paired: one index draw per resample over the seeds finite in both groups, applied to both.
    Unpaired: the baseline's seeds and then the method's seeds are drawn independently from the
    same generator. ``prob_not_better`` is the fraction of resamples whose difference, signed so
    that positive = better, is <= 0 (for ``higher_is_better`` that is ``P(diff <= 0)``).
    """
    _check_boot_args(n_resamples, confidence)
    a, b = _group(method), _group(baseline)
    if paired is None:
        paired = _pairable(a, b)
    elif paired and not _can_pair(a, b):
        raise ValueError("paired=True needs the same seeds in both groups")
    sign = 1.0 if higher_is_better else -1.0
    rng = np.random.default_rng(seed)
    if paired:
        if a.labels is not None and b.labels is not None:
            order = list(b.labels)
            av = np.array([a.values[a.labels.index(k)] for k in order])
        else:
            av = a.values
        bv = b.values
        ok = np.isfinite(av) & np.isfinite(bv)
        d = av[ok] - bv[ok]
        n_a = n_b = int(ok.sum())
        if d.size == 0:
            return BootstrapDifference((_NAN, _NAN), _NAN, True, n_resamples, 0, 0)
        idx = rng.integers(0, d.size, size=(n_resamples, d.size))
        boot = d[idx].mean(axis=1)
    else:
        xa, xb = a.finite, b.finite
        n_a, n_b = int(xa.size), int(xb.size)
        if n_a == 0 or n_b == 0:
            return BootstrapDifference((_NAN, _NAN), _NAN, False, n_resamples, n_a, n_b)
        ib = rng.integers(0, n_b, size=(n_resamples, n_b))
        ia = rng.integers(0, n_a, size=(n_resamples, n_a))
        boot = xa[ia].mean(axis=1) - xb[ib].mean(axis=1)
    prob = float(np.mean(sign * boot <= 0.0))
    return BootstrapDifference(
        _percentile_ci(boot, confidence), prob, bool(paired), n_resamples, n_a, n_b
    )


# --------------------------------------------------------------------------------------------
# Multiple comparisons


@dataclass(frozen=True)
class Adjusted:
    """Adjusted p-values and reject flags (NaN p in → NaN adjusted p, reject False)."""

    method: str
    alpha: float
    p_adjusted: npt.NDArray[np.float64]
    reject: npt.NDArray[np.bool_]
    n_tests: int


def _holm(q: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Holm's step-down adjusted p-values (not statsmodels': see the module docstring)."""
    order = np.argsort(q, kind="mergesort")
    steps = (q.size - np.arange(q.size)) * q[order]
    adj = np.empty(q.size)
    adj[order] = np.minimum(1.0, np.maximum.accumulate(steps))
    return adj


def adjust_pvalues(
    pvalues: npt.ArrayLike, method: Correction = "bonferroni", alpha: float = 0.05
) -> Adjusted:
    """Bonferroni, Holm (step-down) or Benjamini–Hochberg (step-up FDR) adjusted p-values.

    Bonferroni and BH are ``statsmodels.stats.multitest.multipletests`` (``bonferroni``,
    ``fdr_bh``); Holm is our own step-down (same values, without statsmodels' per-call
    ``gc.collect()``). The family is the finite p-values (m = their count); NaN entries stay NaN
    and are never rejected. ``reject = p_adjusted <= alpha``. ``"none"`` returns the raw
    p-values.
    """
    if method not in (*CORRECTIONS, "none"):
        raise ValueError(f"unknown correction {method!r}")
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    q = p[ok]
    m = int(q.size)
    if m:
        if method == "none":
            adj = q.copy()
        elif method == "holm":
            adj = _holm(q)
        else:
            # imported here: statsmodels takes ~0.4 s to import, and only this needs it
            from statsmodels.stats.multitest import multipletests

            sm = {"bonferroni": "bonferroni", "bh": "fdr_bh"}[method]
            adj = np.asarray(multipletests(q, alpha=alpha, method=sm)[1], dtype=np.float64)
        out[ok] = adj
    reject = np.zeros(p.shape, dtype=bool)
    reject[ok] = out[ok] <= alpha
    return Adjusted(method, alpha, out, reject, m)


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
    xa, xb = _finite(a), _finite(b)
    na, nb = int(xa.size), int(xb.size)
    diff = float(xa.mean() - xb.mean()) if na and nb else _NAN
    if na < 2 or nb < 2:
        return WelchResult(_NAN, _NAN, _NAN, alternative, na, nb, diff)
    if np.var(xa) == 0.0 and np.var(xb) == 0.0:
        t = _NAN if diff == 0.0 else math.copysign(math.inf, diff)
        return WelchResult(t, _NAN, _NAN, alternative, na, nb, diff)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        r = _sps.ttest_ind(xa, xb, equal_var=False, alternative=alternative)
    return WelchResult(float(r.statistic), float(r.df), float(r.pvalue), alternative, na, nb,
                       diff)


# --------------------------------------------------------------------------------------------
# Per-task Welch + Stouffer (Appendix E.4)


@dataclass(frozen=True)
class StoufferResult:
    """Stouffer's combination ``Z = sum(w_i z_i) / sqrt(sum(w_i^2))``, ``z_i = Phi^-1(1 - p_i)``.

    ``p_one_sided = 1 - Phi(Z)`` (the direction the one-sided p's test), ``p_two_sided =
    2 * (1 - Phi(|Z|))``.
    """

    z: float
    p_one_sided: float
    p_two_sided: float
    n: int
    weighted: bool


def stouffer(pvalues: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> StoufferResult:
    """Combine one-sided p-values with Stouffer's method (optionally weighted;
    ``scipy.stats.combine_pvalues(method="stouffer")``).

    NaN p-values (and their weights) are dropped. Weights must be finite and >= 0. No p-value
    (or all weights 0): NaN.
    """
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    w = np.ones_like(p) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if w.shape != p.shape:
        raise ValueError("weights and pvalues differ in length")
    if np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and >= 0")
    ok = np.isfinite(p)
    p, w = p[ok], w[ok]
    if p.size == 0 or not np.any(w > 0):
        return StoufferResult(_NAN, _NAN, _NAN, int(p.size), weights is not None)
    with np.errstate(invalid="ignore", divide="ignore"):  # p = 0 and p = 1 together: NaN
        r = _sps.combine_pvalues(p, method="stouffer", weights=w)
    zc = float(r.statistic)
    return StoufferResult(zc, normal_sf(zc), p_two_sided(zc), int(p.size), weights is not None)


@dataclass(frozen=True)
class TaskTest:
    """One task's Welch test, method vs baseline; ``p_one_sided`` tests 'method better'."""

    task: str
    n_method: int
    n_baseline: int
    delta: float
    t: float
    df: float
    p_two_sided: float
    p_one_sided: float


@dataclass(frozen=True)
class PerTaskResult:
    tasks: tuple[TaskTest, ...]
    stouffer: StoufferResult
    stouffer_weighted: StoufferResult | None


def per_task_stouffer(
    method: Mapping[str, Scores],
    baseline: Mapping[str, Scores],
    *,
    higher_is_better: bool = True,
    weights: Mapping[str, float] | None = None,
) -> PerTaskResult:
    """Welch's t per task, then Stouffer's combination of the one-sided per-task p-values.

    Tasks present in both mappings are used (in the method's order); a task whose Welch test is
    undefined (< 2 seeds on a side, zero variance on both) is listed with NaN and left out of
    the combination. The one-sided alternative is 'method better than baseline' (greater for
    ``higher_is_better``, less otherwise), so the combined ``z > 0`` means better. With
    ``weights`` (e.g. items per task) a weighted combination is reported as well; tasks with no
    weight get weight 0.
    """
    alt: Alternative = "greater" if higher_is_better else "less"
    rows: list[TaskTest] = []
    for task in method:
        if task not in baseline:
            continue
        two = welch_t(method[task], baseline[task])
        one = welch_t(method[task], baseline[task], alternative=alt)
        rows.append(
            TaskTest(task, two.n_a, two.n_b, two.mean_diff, two.t, two.df, two.p, one.p)
        )
    ps = [r.p_one_sided for r in rows]
    unweighted = stouffer(ps)
    weighted = None
    if weights is not None:
        weighted = stouffer(ps, [float(weights.get(r.task, 0.0)) for r in rows])
    return PerTaskResult(tuple(rows), unweighted, weighted)


# --------------------------------------------------------------------------------------------
# Spearman rank correlation


def rankdata(x: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """1-based ranks, ties given the average of the ranks they span (``scipy.stats.rankdata``;
    a NaN in the input makes every rank NaN, scipy's ``nan_policy="propagate"``)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        return np.empty(0)
    return np.asarray(_sps.rankdata(a), dtype=np.float64)


@dataclass(frozen=True)
class SpearmanResult:
    """Spearman's rho with the t-approximation p-value (n - 2 df, two-sided)."""

    rho: float
    p: float
    n: int
    methods: tuple[str, ...] = ()


def spearman(x: npt.ArrayLike, y: npt.ArrayLike) -> SpearmanResult:
    """Spearman's rank correlation of paired values (average ranks for ties;
    ``scipy.stats.spearmanr``, t approximation with n - 2 df for p).

    Pairs with a non-finite value on either side are dropped. rho NaN when fewer than 2 pairs
    or when either side is constant; p NaN when n <= 2; p = 0 when |rho| = 1 (n > 2).
    """
    a = np.asarray(x, dtype=np.float64).ravel()
    b = np.asarray(y, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError("x and y differ in length")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    n = int(a.size)
    if n < 2:
        return SpearmanResult(_NAN, _NAN, n)
    if np.ptp(a) == 0.0 or np.ptp(b) == 0.0:  # a constant side: no ranking to correlate
        return SpearmanResult(_NAN, _NAN, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = _sps.spearmanr(a, b)
    rho = max(-1.0, min(1.0, float(r.statistic)))
    if n <= 2:
        return SpearmanResult(rho, _NAN, n)
    if abs(rho) == 1.0:
        return SpearmanResult(rho, 0.0, n)
    return SpearmanResult(rho, float(r.pvalue), n)


def spearman_across_scales(
    scale_a: Mapping[str, Score], scale_b: Mapping[str, Score]
) -> SpearmanResult:
    """Spearman's rho between methods' scores at two scales (e.g. 1.2B vs 3B).

    Uses the methods with a finite score at both scales (diverged at either scale: left out),
    in ``scale_a``'s order; ``methods`` lists them.
    """
    names = [
        m
        for m in scale_a
        if m in scale_b
        and math.isfinite(_to_float(scale_a[m]))
        and math.isfinite(_to_float(scale_b[m]))
    ]
    r = spearman(
        [_to_float(scale_a[m]) for m in names], [_to_float(scale_b[m]) for m in names]
    )
    return SpearmanResult(r.rho, r.p, r.n, tuple(names))


# --------------------------------------------------------------------------------------------
# Verdicts


def decide(
    *,
    improvement: float,
    p_adjusted: float,
    sigma: float,
    alpha: float = 0.05,
    floor_sigmas: float = 1.0,
    diverged: bool = False,
    stalled: bool = False,
) -> Verdict:
    """The verdict rule, in order:

    1. ``diverged`` → DIVERGED; else ``stalled`` → STALLED (failures, whatever the scores);
    2. improvement, p or sigma not finite (no noise floor, no finite score) → UNDETERMINED;
    3. ``p_adjusted <= alpha`` and ``|improvement| > floor_sigmas * sigma`` → IMPROVER if the
       improvement is positive, DEGRADER if negative;
    4. otherwise WITHIN_NOISE.
    """
    if diverged:
        return Verdict.DIVERGED
    if stalled:
        return Verdict.STALLED
    if not (math.isfinite(improvement) and math.isfinite(sigma)) or math.isnan(p_adjusted):
        return Verdict.UNDETERMINED
    if p_adjusted <= alpha and abs(improvement) > floor_sigmas * sigma:
        return Verdict.IMPROVER if improvement > 0 else Verdict.DEGRADER
    return Verdict.WITHIN_NOISE


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
    for ``"none"``. For ``n = 1`` this is exactly the prediction test of :func:`compare`; for
    ``n >= 2`` it approximates Welch's test by taking the method's seeds as spread like the
    baseline's. ``n_baseline=None`` takes the baseline's mean and sigma as exact (normal
    quantile, factor ``sqrt(1/n)``): the reference of earlier versions, which overstates
    certainty with a few baseline seeds. NaN if sigma is undefined.
    """
    if not math.isfinite(sigma):
        return _NAN
    m = 1 if correction == "none" else max(1, n_tests)
    n = max(1, n)
    if n_baseline is None:
        q, spread = normal_isf(alpha / (2.0 * m)), math.sqrt(1.0 / n)
    else:
        dof = float(n_baseline - 1) if df is None else float(df)
        q, spread = _t_isf(alpha / (2.0 * m), dof), math.sqrt(1.0 / n + 1.0 / n_baseline)
    return sigma * max(floor_sigmas, q * spread)


@dataclass(frozen=True)
class SeedRequest:
    """A configuration whose verdict could still change with more seeds.

    ``interval`` bounds the improvement (positive = better, metric units) of its mean;
    ``reason`` is ``"straddles"`` (+threshold or -threshold lies inside the interval),
    ``"no_data"`` (no finite seed yet) or ``"no_floor"`` (the baseline itself needs seeds).
    ``capped``: it already has ``max_seeds`` seeds, so a runner should stop adding.
    """

    method: str
    n: int
    interval: tuple[float, float]
    threshold: float
    reason: str
    capped: bool


def undecided(
    table: Mapping[str, Scores],
    floor: NoiseFloor,
    threshold: float | None = None,
    *,
    baseline: str = "baseline",
    n_tests: int | None = None,
    alpha: float = 0.05,
    correction: Correction = "holm",
    floor_sigmas: float = 1.0,
    confidence: float = 0.95,
    max_seeds: int | None = None,
) -> list[SeedRequest]:
    """Which configurations need more seeds before their verdict is settled.

    Each non-baseline method without a failed seed (``None``: diverged or stalled) with n
    finite seeds gets the interval
    ``improvement ± q * sigma * sqrt(1/n + 1/n_b)`` with ``q`` the Student-t quantile
    ``t^-1((1 + confidence) / 2)`` with the floor's degrees of freedom (``n_b - 1`` for the
    baseline's sigma): the uncertainty of its difference from the baseline's mean when sigma is
    itself estimated from the baseline's ``n_b`` seeds. It is returned when ``+threshold`` or
    ``-threshold`` lies strictly inside the interval (so with sigma = 0 nothing straddles:
    seeds do not vary). ``threshold`` defaults to the method's own :func:`decision_threshold`
    (its ``n``, the floor's ``n`` and ``df``; ``n_tests`` = the number of non-baseline,
    non-diverged methods), so it shrinks as seeds are added; it is in metric units, like the
    improvement. If the floor is undefined, only the baseline is returned (reason
    ``"no_floor"``). Methods with a failed seed are never returned (a divergence or a stall is
    a result). Order: the table's.
    """
    names = [m for m in table if m != baseline]
    cap = max_seeds if max_seeds is not None else math.inf
    if not floor.defined:
        return [SeedRequest(baseline, floor.n, (-math.inf, math.inf), _NAN, "no_floor",
                            floor.n >= cap)]
    groups = {m: _group(table[m]) for m in names}
    live = [m for m in names if groups[m].n_diverged == 0]
    m_tests = n_tests if n_tests is not None else len(live)
    q = _t_isf((1.0 - confidence) / 2.0, floor.df)
    out: list[SeedRequest] = []
    for m in live:
        g = groups[m]
        thr = threshold
        if thr is None:
            thr = decision_threshold(floor.sigma, m_tests, alpha=alpha, correction=correction,
                                     floor_sigmas=floor_sigmas, n=max(1, g.n),
                                     n_baseline=floor.n, df=floor.df)
        if g.n == 0:
            out.append(SeedRequest(m, 0, (-math.inf, math.inf), thr, "no_data", cap <= 0))
            continue
        imp = floor.sign * (float(g.finite.mean()) - floor.mean)
        half = q * floor.sigma * math.sqrt(1.0 / g.n + 1.0 / floor.n)
        lo, hi = imp - half, imp + half
        if lo < thr < hi or lo < -thr < hi:
            out.append(SeedRequest(m, g.n, (lo, hi), thr, "straddles", g.n >= cap))
    return out


# --------------------------------------------------------------------------------------------
# compare


#: The test :func:`compare` gives a method, by its finite seeds (see :func:`method_test`).
TESTS: tuple[str, ...] = ("pooled", "prediction", "welch", "none")
#: The Brown–Forsythe check's level: the pooled test is used when it does not reject.
HOMOGENEITY_ALPHA: Final = 0.05
#: The smallest estimated sigma a verdict may rest on, as a fraction of |baseline mean|.
RESOLUTION: Final = 1e-6
#: Finite seeds a baseline with failed seeds needs to keep its noise floor.
MIN_SURVIVING_BASELINE: Final = 3
#: The power at which :func:`compare` states each method's minimum detectable effect.
MDE_POWER: Final = 0.8


@dataclass(frozen=True)
class MethodResult:
    """Everything the report needs about one configuration (see :func:`compare`)."""

    method: str
    is_baseline: bool
    n: int  # finite seeds
    n_diverged: int  # failed seeds that diverged (n_stalled: those that stalled)
    fewer_seeds: bool  # n < the baseline's finite seeds (its verdict rests on less)
    mean: float
    std: float  # ddof=1, NaN with < 2 seeds
    delta: float  # mean - baseline mean (raw units)
    improvement: float  # delta signed so that positive = better
    z: float  # improvement / floor sigma: descriptive effect size
    test: str  # "prediction" (1 seed) | "welch" (>= 2 seeds) | "none"
    t: float  # the test's statistic, signed like improvement
    df: float  # the test's degrees of freedom
    p: float  # the test's two-sided p
    p_adjusted: Mapping[str, float]  # bonferroni / holm / bh
    significant: Mapping[str, bool]  # none / bonferroni / holm / bh (p <= alpha)
    ci_mean: tuple[float, float]
    ci_delta: tuple[float, float]
    prob_not_better: float
    paired: bool
    welch: WelchResult | None
    verdict: Verdict
    floor: NoiseFloor
    n_stalled: int = 0  # failed seeds that stalled (compare's ``stalled``)
    # why the verdict is what it is, in words ("" when the verdict says it all)
    note: str = ""
    ci: tuple[float, float] = (_NAN, _NAN)  # the test's interval for delta (raw units)
    ci_level: float = _NAN  # its simultaneous coverage (Bonferroni over the compared methods)
    mde: float = _NAN  # minimum detectable |delta| at MDE_POWER (metric units)
    mde_sigma: float = _NAN  # the same in sigmas of the test's error term
    p_failures: float = _NAN  # Fisher's exact p of its failure rate against the baseline's
    p_failures_adjusted: float = _NAN  # the same, corrected in the verdict's family
    homogeneity_p: float = _NAN  # Brown–Forsythe p of the scale (decides pooled vs Welch)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict (verdict as its string; NaN / inf kept as floats)."""
        d = asdict(self)
        d["verdict"] = str(self.verdict)
        d["p_adjusted"] = dict(self.p_adjusted)
        d["significant"] = dict(self.significant)
        return d


@dataclass(frozen=True)
class MethodTest:
    """The test of one method's seeds against the floor (see :func:`method_test`)."""

    test: str
    t: float
    df: float
    p: float
    welch: WelchResult | None = None  # Welch's result as welch_t gives it (raw sign)


def _zero_spread_t(improvement: float) -> float:
    return 0.0 if improvement == 0.0 else math.copysign(math.inf, improvement)


def method_test(scores: Scores, floor: NoiseFloor, baseline: Scores = None) -> MethodTest:
    """The two-sided test :func:`compare` applies to a method with these seeds.

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
    x = _finite(scores)
    if not floor.defined or x.size == 0:
        return MethodTest("none", _NAN, _NAN, _NAN)
    imp = floor.sign * (float(x.mean()) - floor.mean)
    if x.size == 1:
        se = floor.sigma * math.sqrt(1.0 + 1.0 / floor.n)
        t = _zero_spread_t(imp) if se == 0.0 else imp / se
        return MethodTest("prediction", t, floor.df, _t_p(t, floor.df, "two-sided"))
    if baseline is None:
        raise ValueError("Welch's test (>= 2 seeds) needs the baseline's seeds")
    w = welch_t(x, baseline)
    if math.isnan(w.p) and w.n_b >= 2:  # both groups constant
        t = _zero_spread_t(imp)
        return MethodTest("welch", t, _NAN, 1.0 if t == 0.0 else 0.0, w)
    return MethodTest("welch", floor.sign * w.t, w.df, w.p, w)


def homogeneity(groups: Iterable[Scores]) -> float:
    """Brown–Forsythe p that the groups' variances are equal (``scipy.stats.levene`` with
    ``center="median"``, robust to heavy tails) over the groups with >= 2 finite seeds; NaN
    with fewer than 2 such groups or when every such group is constant."""
    xs = [x for x in (_finite(g) for g in groups) if x.size >= 2]
    if len(xs) < 2 or all(float(np.ptp(x)) == 0.0 for x in xs):
        return _NAN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(_sps.levene(*xs, center="median").pvalue)
    return p


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
        return _NAN
    d = _detectable_d(int(n), int(n_baseline), float(df), alpha / n_tests, power)
    return max(d, floor_sigmas)


def _fisher(k: int, n: int, k_b: int, n_b: int) -> float:
    """Two-sided Fisher exact p of k failures of n against k_b of n_b (``scipy``)."""
    return float(_sps.fisher_exact([[k, n - k], [k_b, n_b - k_b]]).pvalue)


@lru_cache(maxsize=1024)
def _fisher_min_p(n: int, n_b: int, total: int) -> float:
    """The smallest two-sided Fisher p any table with these margins (n and n_b seeds, ``total``
    failures between them) can give: a test whose smallest p exceeds alpha can never reject,
    so it is left out of the family (Tarone 1990, "A modified Bonferroni method for discrete
    data", Biometrics 46: the family counts only tests that can reach the level)."""
    ks = range(max(0, total - n_b), min(n, total) + 1)
    return min(_fisher(k, n, total - k, n_b) for k in ks)


def compare(
    table: Mapping[str, Scores],
    baseline: str = "baseline",
    *,
    higher_is_better: bool = True,
    references: Sequence[str] = (),
    sigma: SigmaSource = "baseline",
    alpha: float = 0.05,
    correction: Correction = "holm",
    floor_sigmas: float = 1.0,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
    paired: bool | None = None,
    diverged: Collection[str] = (),
    stalled: Mapping[str, int] | None = None,
    test: Literal["auto", "pooled", "welch"] = "auto",
    homogeneity_alpha: float = HOMOGENEITY_ALPHA,
    resolution: float = RESOLUTION,
) -> list[MethodResult]:
    """Compare every method of ``table`` (``{name: per-seed scores or None}``) with ``baseline``.

    Returns one :class:`MethodResult` per entry, in the table's order, baseline included (its
    delta, improvement and z are 0, its test ``"none"``, its verdict ``baseline`` unless it
    has failed seeds). ``references`` join the baseline's seeds for ``sigma="pooled"|"max"``
    (the floor of z and of the |delta| guard). ``diverged`` flags methods as diverged whatever
    their scores; ``stalled`` says how many of a method's failed (``None``) seeds stalled.

    The primary test (``test="auto"``): when the Brown–Forsythe check (:func:`homogeneity`)
    over the baseline and the compared methods does not reject at ``homogeneity_alpha``, every
    method is tested against the baseline with the **pooled** error term of all those groups
    (``t = improvement / (s_p sqrt(1/n + 1/n_b))``, ``df = sum(n_i - 1)``); otherwise each gets
    :func:`method_test` (prediction test for one seed, Welch for more). ``"pooled"`` /
    ``"welch"`` force one. No verdict rests on an estimated sigma of 0 or below ``resolution``
    times |baseline mean| (the floor's or the test's): such methods are ``undetermined``.

    Failures are judged as rates: a method with failed seeds gets Fisher's exact test of its
    k of n against the baseline's, in the same correction family as the score tests (where it
    can reach ``alpha`` at those counts: :func:`_fisher_min_p`); it is
    ``diverged`` / ``stalled`` when that test shows it fails more often, or when no seed
    survived; otherwise its surviving seeds are compared like any method's (with a note). A
    baseline with failed seeds keeps its floor only with :data:`MIN_SURVIVING_BASELINE` finite
    seeds. Each compared method gets ``ci`` (the test's interval for delta, Bonferroni-
    simultaneous over the compared methods) and ``mde`` / ``mde_sigma`` (the |delta| found
    with probability :data:`MDE_POWER`, :func:`detectable_effect`). docs/statistics.md states
    every rule. An empty table gives []; a table without ``baseline`` raises KeyError.
    """
    if not table:
        return []
    if baseline not in table:
        raise KeyError(f"baseline {baseline!r} is not in the table")
    if correction not in (*CORRECTIONS, "none"):
        raise ValueError(f"unknown correction {correction!r}")
    if test not in ("auto", "pooled", "welch"):
        raise ValueError(f"test must be auto, pooled or welch, not {test!r}")
    groups = {m: _group(s) for m, s in table.items()}
    n_stalled = {m: int((stalled or {}).get(m, 0)) for m in table}
    for m, k in n_stalled.items():
        if not 0 <= k <= groups[m].n_diverged:
            raise ValueError(f"stalled[{m!r}] = {k}, but {m!r} has {groups[m].n_diverged} "
                             "failed (None) seeds; give a stalled seed's score as None")
    floor = noise_floor(
        table[baseline],
        higher_is_better=higher_is_better,
        references={r: table[r] for r in references if r in table and r != baseline},
        sigma=sigma,
    )
    base = groups[baseline]
    notes: dict[str, list[str]] = {m: [] for m in table}
    base_failed = base.n_diverged > 0 or baseline in diverged
    if base_failed and floor.defined and base.n < MIN_SURVIVING_BASELINE:
        notes[baseline].append(f"{base.n_diverged} failed seeds leave {base.n} finite: fewer "
                               f"than {MIN_SURVIVING_BASELINE}, no noise floor")
        floor = NoiseFloor(**{**asdict(floor), "sigma": _NAN, "df": _NAN})
    is_div = {m: g.n_diverged > n_stalled[m] or m in diverged for m, g in groups.items()}
    n_failed = {m: (len(g.values) if m in diverged else g.n_diverged) for m, g in groups.items()}
    n_total = {m: max(len(g.values), n_failed[m]) for m, g in groups.items()}
    no_floor_reason = ""
    if floor.defined and floor.sigma <= resolution * abs(floor.mean):
        no_floor_reason = (f"baseline σ = {floor.sigma:.3g} is below the resolution "
                           f"({resolution:g} of the mean): no verdict from zero spread")
    # methods whose surviving seeds are compared
    live = [m for m in table if m != baseline and m not in diverged and groups[m].n > 0]
    hom_p = homogeneity([base.finite, *(groups[m].finite for m in live)])
    pooled_s, pooled_df = _pooled([base.finite, *(groups[m].finite for m in live)])
    # with no method of >= 2 seeds the pooled term is the baseline's: the prediction test
    shared = pooled_df > base.n - 1
    use_pooled = test == "pooled" or (test == "auto" and shared
                                      and not hom_p <= homogeneity_alpha)

    rows: dict[str, dict[str, Any]] = {}
    no_test = MethodTest("none", _NAN, _NAN, _NAN)
    for m, g in groups.items():
        x = g.finite
        mean = float(x.mean()) if x.size else _NAN
        r: dict[str, Any] = {"g": g, "mean": mean, "delta": 0.0 if m == baseline
                             else mean - floor.mean, "test": no_test, "se": _NAN,
                             "scale": _NAN, "boot": None}
        r["z"] = 0.0 if m == baseline else z_score(x, floor)
        rows[m] = r
        if m == baseline:
            continue
        pair = _can_pair(g, base) if paired else paired
        r["boot"] = bootstrap_difference(
            table[m], table[baseline], higher_is_better=higher_is_better,
            n_resamples=n_resamples, confidence=confidence, seed=seed, paired=pair,
        )
        if m not in live or not floor.defined:
            continue
        imp = floor.sign * r["delta"]
        if no_floor_reason:
            notes[m].append(no_floor_reason)
            r["test"] = MethodTest("pooled" if use_pooled else "none", _NAN, _NAN, _NAN)
            continue
        if use_pooled:
            se = pooled_s * math.sqrt(1.0 / x.size + 1.0 / floor.n)
            r["scale"] = pooled_s
            if not pooled_s > resolution * abs(floor.mean):
                notes[m].append(f"pooled σ = {pooled_s:.3g} is below the resolution: "
                                "no verdict from zero spread")
                r["test"] = MethodTest("pooled", _NAN, float(pooled_df), _NAN)
                continue
            t = imp / se
            r["test"] = MethodTest("pooled", t, float(pooled_df),
                                   _t_p(t, float(pooled_df), "two-sided"))
            r["se"] = se
            continue
        mt = method_test(x, floor, base.finite)
        r["scale"] = floor.sigma
        spread = floor.sigma if x.size == 1 else max(floor.sigma, sample_std(x))
        if not spread > resolution * abs(floor.mean) or not math.isfinite(mt.t):
            notes[m].append("the seeds' spread is below the resolution: no verdict from "
                            "zero spread")
            r["test"] = MethodTest(mt.test, _NAN, mt.df, _NAN, mt.welch)
            continue
        r["test"] = mt
        r["se"] = abs(imp / mt.t) if mt.t != 0.0 else (
            floor.sigma * math.sqrt(1.0 + 1.0 / floor.n) if x.size == 1
            else math.sqrt(float(np.var(x, ddof=1)) / x.size + floor.baseline_std ** 2 / floor.n))

    # failure rates: Fisher's exact test against the baseline, in the same family
    p_fail = {m: _NAN for m in table}
    for m in table:
        if (m != baseline and m not in diverged and n_failed[m] + n_failed[baseline] > 0
                and n_total[baseline] > 0 and n_total[m] > 0):
            p_fail[m] = _fisher(n_failed[m], n_total[m], n_failed[baseline],
                                n_total[baseline])
    scored = [m for m in live if math.isfinite(rows[m]["test"].p)]
    fams = [(m, "score", rows[m]["test"].p) for m in scored] + [
        (m, "fail", p_fail[m]) for m in table if math.isfinite(p_fail[m])
        and _fisher_min_p(n_total[m], n_total[baseline],
                          n_failed[m] + n_failed[baseline]) <= alpha]
    adjusted: dict[tuple[str, str], dict[str, float]] = {}
    for c in CORRECTIONS:
        adj = adjust_pvalues([p for _, _, p in fams], c, alpha)  # type: ignore[arg-type]
        for (m, kind, _), v in zip(fams, adj.p_adjusted, strict=True):
            adjusted.setdefault((m, kind), {})[c] = float(v)

    m_ci = max(1, len(scored))
    level = 1.0 - alpha
    out: list[MethodResult] = []
    for m in table:
        r = rows[m]
        g = r["g"]
        mt: MethodTest = r["test"]
        padj = {c: adjusted.get((m, "score"), {}).get(c, _NAN) for c in CORRECTIONS}
        in_family = (m, "score") in adjusted
        sig = {"none": bool(mt.p <= alpha) if in_family else False}
        sig.update({c: bool(padj[c] <= alpha) for c in CORRECTIONS})
        improvement = floor.sign * r["delta"] if m != baseline else 0.0
        fail_adj = (p_fail[m] if correction == "none"
                    else adjusted.get((m, "fail"), {}).get(correction, _NAN))
        ci, mde, mde_s = (_NAN, _NAN), _NAN, _NAN
        if m == baseline:
            verdict = (Verdict.DIVERGED if is_div[m] else Verdict.STALLED if n_failed[m]
                       else Verdict.BASELINE)
        else:
            p_use = (mt.p if correction == "none" else padj[correction]) if in_family else _NAN
            score_verdict = decide(improvement=improvement, p_adjusted=p_use,
                                   sigma=floor.sigma, alpha=alpha, floor_sigmas=floor_sigmas)
            kind = Verdict.DIVERGED if is_div[m] else Verdict.STALLED
            rate, rate_b = (n_failed[m] / n_total[m] if n_total[m] else 0.0,
                            n_failed[baseline] / n_total[baseline] if n_total[baseline] else 0.0)
            shown_more = fail_adj <= alpha and rate > rate_b
            if m in diverged:
                verdict = Verdict.DIVERGED
            elif n_failed[m] and (shown_more or g.n == 0):
                verdict = kind
                what = "diverged" if is_div[m] else "stalled"
                notes[m].append(
                    f"{n_failed[m]} of {n_total[m]} seeds {what} (baseline "
                    f"{n_failed[baseline]} of {n_total[baseline]}): "
                    + (f"shown to fail more often (Fisher p {fail_adj:.2g})" if shown_more
                       else "no seed survived; the rate is not shown to differ from the "
                            f"baseline's (Fisher p {p_fail[m]:.2g}"
                            + ("" if math.isfinite(fail_adj) else ", which cannot reach α at "
                               "these seed counts") + ")"))
            else:
                verdict = score_verdict
                if n_failed[m]:
                    notes[m].append(
                        f"{n_failed[m]} of {n_total[m]} seeds failed (baseline "
                        f"{n_failed[baseline]} of {n_total[baseline]}), a rate not shown to "
                        f"differ (Fisher p {p_fail[m]:.2g}): judged on its {g.n} surviving "
                        "seeds")
            if math.isfinite(r["se"]) and math.isfinite(mt.df):
                q = _t_isf(alpha / (2.0 * m_ci), mt.df)
                ci = (r["delta"] - q * r["se"], r["delta"] + q * r["se"])
                n_b = floor.n
                d = detectable_effect(g.n, n_b, mt.df, alpha=alpha, n_tests=m_ci,
                                      floor_sigmas=floor_sigmas)
                mde_s, mde = d, d * r["scale"]
            if verdict == Verdict.WITHIN_NOISE:
                if math.isfinite(mde) and abs(r["delta"]) < mde:
                    notes[m].append(f"not shown: |Δ| < MDE ({mde:.3g}, {mde_s:.2g}σ at "
                                    f"{MDE_POWER:.0%} power)")
                else:
                    notes[m].append("not shown at this α: |Δ| is above the detectable effect "
                                    "but its interval includes no effect")
            if verdict == Verdict.UNDETERMINED and not notes[m]:
                notes[m].append("no noise floor" if not floor.defined else "no finite seed")
        bd: BootstrapDifference | None = r["boot"]
        out.append(
            MethodResult(
                method=m,
                is_baseline=m == baseline,
                n=g.n,
                n_diverged=g.n_diverged - n_stalled[m],
                fewer_seeds=m != baseline and g.n < floor.n,
                mean=r["mean"],
                std=sample_std(g.finite),
                delta=r["delta"],
                improvement=improvement,
                z=r["z"],
                test=mt.test,
                t=mt.t,
                df=mt.df,
                p=mt.p,
                p_adjusted=padj,
                significant=sig,
                ci_mean=bootstrap_mean_ci(
                    g.finite, n_resamples=n_resamples, confidence=confidence, seed=seed
                ),
                ci_delta=bd.ci if bd else (_NAN, _NAN),
                prob_not_better=bd.prob_not_better if bd else _NAN,
                paired=bd.paired if bd else False,
                welch=mt.welch,
                verdict=verdict,
                floor=floor,
                n_stalled=n_stalled[m],
                note="; ".join(notes[m]),
                ci=ci,
                ci_level=level if math.isfinite(ci[0]) else _NAN,
                mde=mde,
                mde_sigma=mde_s,
                p_failures=p_fail[m],
                p_failures_adjusted=fail_adj,
                homogeneity_p=hom_p,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Sequential seeds: alpha spent over looks (``modbench study run --until-decided N``)


#: The alpha-spending functions :func:`alpha_spent` knows (Lan & DeMets 1983).
SPENDING: tuple[str, ...] = ("obrien_fleming", "pocock")
DEFAULT_SPENDING: Final = "obrien_fleming"


def alpha_spent(t: float, alpha: float = 0.05, spending: str = DEFAULT_SPENDING) -> float:
    """The alpha spent by information fraction ``t``: Lan & DeMets (1983), "Discrete sequential
    boundaries for clinical trials", Biometrika 70:659–663, their O'Brien–Fleming-type
    function ``2 - 2 Phi(z_{1 - alpha/2} / sqrt(t))`` (``"obrien_fleming"``: next to nothing
    early, most of alpha at the end) or Pocock-type ``alpha ln(1 + (e - 1) t)``
    (``"pocock"``: evenly). 0 for t <= 0, alpha for t >= 1; nondecreasing in t."""
    if spending not in SPENDING:
        raise ValueError(f"spending must be one of {', '.join(SPENDING)}, not {spending!r}")
    if not t > 0.0:
        return 0.0
    if t >= 1.0:
        return alpha
    if spending == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    return min(alpha, 2.0 * normal_sf(normal_isf(alpha / 2.0) / math.sqrt(t)))


def information_fraction(n: int, n_baseline: int, cap: int) -> float:
    """The information of a comparison of ``n`` seeds against ``n_baseline`` relative to its
    most, ``cap`` against ``cap``: ``(2 / cap) / (1/n + 1/n_baseline)``, at most 1 (the inverse
    variance of the difference of means, for one per-seed sigma)."""
    if n < 1 or n_baseline < 1 or cap < 1:
        return 0.0
    return min(1.0, (2.0 / cap) / (1.0 / n + 1.0 / n_baseline))


def baseline_target(n: int, m: int, cap: int) -> int:
    """Baseline seeds for ``m`` open methods of ``n`` seeds: Dunnett's square-root allocation
    ``ceil(n sqrt(m))`` (one control serves m comparisons; ``study plan --baseline-seeds
    sqrt``), at most ``cap``."""
    return min(cap, math.ceil(n * math.sqrt(max(1, m)) - 1e-9))


@dataclass(frozen=True)
class Look:
    """One look of a sequential study at one scale: the seeds each group had, the information
    fraction, the alpha its test used (``alpha``, spent at this look) and spent so far
    (``alpha_spent``), the methods it decided (improver or degrader) and the seeds each group
    gets before the next look (``add``; empty: this was the last look)."""

    index: int
    seeds: Mapping[str, int]
    fraction: float
    alpha: float
    alpha_spent: float
    decided: Mapping[str, str]
    add: Mapping[str, int]
    cap: int
    spending: str = DEFAULT_SPENDING
    note: str = ""

    @property
    def last(self) -> bool:
        return not self.add

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(seeds=dict(self.seeds), decided=dict(self.decided), add=dict(self.add))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Look:
        return cls(index=int(d["index"]), seeds=dict(d["seeds"]), fraction=float(d["fraction"]),
                   alpha=float(d["alpha"]), alpha_spent=float(d["alpha_spent"]),
                   decided=dict(d["decided"]), add=dict(d["add"]), cap=int(d["cap"]),
                   spending=str(d.get("spending", DEFAULT_SPENDING)),
                   note=str(d.get("note", "")))


def sequential_look(
    table: Mapping[str, Scores],
    history: Sequence[Look] = (),
    cap: int = 10,
    *,
    baseline: str = "baseline",
    alpha: float = 0.05,
    spending: str = DEFAULT_SPENDING,
    **compare_kw: Any,
) -> Look:
    """The next look of a group-sequential study (``--until-decided cap``): test what the seeds
    of ``table`` show at the alpha this look may spend, and say who gets seeds next.

    * **Alpha over looks** (Lan & DeMets 1983, :func:`alpha_spent`): look k has the
      information fraction ``t_k`` (:func:`information_fraction` of the open methods' seeds
      against the baseline's, never below the previous look's) and tests with
      ``alpha_k = alpha_spent(t_k) - alpha_spent(t_{k-1})``, the alpha spent at that look. The
      looks' alphas add up to at most ``alpha``: with look times fixed in advance the union
      bound over looks keeps the family-wise false-positive rate at most ``alpha`` however the
      looks' statistics correlate (conservative: exact boundaries would use that correlation);
      the timing here depends a little on the data, which tests/analysis/test_sequential_sim.py
      measures. When everything open has ``cap`` seeds, t = 1 and the last look spends what
      is left.
    * **The verdict's own test**: the look is :func:`compare` at ``alpha_k`` (Holm family,
      pooled t or Welch, Fisher tests, |Δ| guard: ``compare_kw`` as the report passes them).
      A method it calls improver or degrader is decided at this look and gets no more seeds.
    * **Who gets seeds next**: the open methods, those not decided, without a failed seed
      (a failure is a result) and below ``cap``. The baseline first: while it has fewer
      seeds than :func:`baseline_target` of the open methods (Dunnett's square root), the
      next look adds baseline seeds only; otherwise one seed to each open method and the
      baseline up to the target for the new count. Without a noise floor (fewer than 2 finite
      baseline seeds, or fewer than :data:`MIN_SURVIVING_BASELINE` with failed ones) nothing
      is tested or spent and the baseline gets a seed.

    Pure: the caller keeps the looks (``history``, oldest first) and adds the seeds.
    """
    if cap < 1:
        raise ValueError(f"cap must be at least 1, got {cap}")
    if baseline not in table:
        raise KeyError(f"baseline {baseline!r} is not in the table")
    groups = {m: _group(s) for m, s in table.items()}
    seeds = {m: len(g.values) if not g.whole_none else 1 for m, g in groups.items()}
    decided_before = {m for look in history for m in look.decided}
    prev_t = history[-1].fraction if history else 0.0
    spent = history[-1].alpha_spent if history else 0.0
    index = len(history) + 1
    base = groups[baseline]

    def look(t: float, a: float, decided: Mapping[str, str], add: Mapping[str, int],
             note: str = "") -> Look:
        return Look(index, seeds, t, a, spent + a, dict(decided), dict(add), cap, spending,
                    note)

    need = MIN_SURVIVING_BASELINE if base.n_diverged else 2
    if base.n < need:
        more = {baseline: 1} if seeds[baseline] < cap else {}
        return look(prev_t, 0.0, {}, more, f"no noise floor ({base.n} finite baseline seeds)")
    methods = [m for m in table if m != baseline]
    candidates = [m for m in methods if m not in decided_before and groups[m].n > 0]
    if not candidates:
        return look(prev_t, 0.0, {}, {}, "nothing left to decide")
    open_ = [m for m in candidates if groups[m].n_diverged == 0]
    n = max(groups[m].n for m in (open_ or candidates))
    t = max(prev_t, information_fraction(n, base.n, cap))
    if all(groups[m].n >= cap for m in open_) and base.n >= cap:
        t = 1.0
    a = max(0.0, alpha_spent(t, alpha, spending) - alpha_spent(prev_t, alpha, spending))
    decided: dict[str, str] = {}
    if a > 0.0:
        res = compare(table, baseline, alpha=a, **compare_kw)
        decided = {r.method: str(r.verdict) for r in res if r.method in candidates
                   and r.verdict in (Verdict.IMPROVER, Verdict.DEGRADER)}
    still = [m for m in open_ if m not in decided and groups[m].n < cap]
    add: dict[str, int] = {}
    if still:
        n_o = max(groups[m].n for m in still)
        target = baseline_target(n_o, len(still), cap)
        if base.n < target:  # the baseline first
            add[baseline] = target - base.n
        else:
            add.update({m: 1 for m in still})
            more = baseline_target(min(cap, n_o + 1), len(still), cap) - base.n
            if more > 0:
                add[baseline] = more
    return look(t, a, decided, add)


def sequential_alpha(looks: Sequence[Look], alpha: float = 0.05) -> float:
    """The alpha a sequential study's final verdicts use: the alpha spent at its last look
    that tested (``alpha`` when none did)."""
    tested = [lk.alpha for lk in looks if lk.alpha > 0.0]
    return tested[-1] if tested else alpha


def sequential_verdicts(results: Sequence[MethodResult], looks: Sequence[Look]
                        ) -> list[MethodResult]:
    """A sequential study's verdicts: ``results`` (:func:`compare` of the final seeds at
    :func:`sequential_alpha`) with each method decided at a look given that look's verdict
    (the decision stands: its seeds stopped there), and an improver or degrader that no look
    decided (seeds added after the last look) made ``within_noise``; each note says which."""
    if not looks:
        return list(results)
    decided = {m: (lk, v) for lk in looks for m, v in lk.decided.items()}
    k = len(looks)
    out: list[MethodResult] = []
    for r in results:
        if r.is_baseline or r.verdict not in (Verdict.IMPROVER, Verdict.DEGRADER,
                                              Verdict.WITHIN_NOISE, Verdict.UNDETERMINED):
            out.append(r)
            continue
        note = [r.note] if r.note else []
        verdict = r.verdict
        if r.method in decided:
            lk, v = decided[r.method]
            verdict = Verdict(v)
            note.append(f"sequential: decided {v} at look {lk.index} of {k} (α = "
                        f"{lk.alpha:.2g} spent there, {lk.seeds.get(r.method, r.n)} seeds)")
        elif r.verdict in (Verdict.IMPROVER, Verdict.DEGRADER):
            verdict = Verdict.WITHIN_NOISE
            note.append("sequential: no look decided it (seeds added after the last look)")
        out.append(dataclasses.replace(r, verdict=verdict, note="; ".join(note)))
    return out
