"""Learning-rate profiles (issue 45): how each method's final loss depends on the learning
rate, and whether a modification makes training less sensitive to it than the baseline.

Every method, the baseline included, is trained at every rate of a grid (multipliers of the
recipe's rate, log-spaced) on several seeds; a run ends with a final validation loss or fails
(diverged or stalled: ``None``, as are NaN and ±inf). From ``{rate: {seed: loss or None}}``:

* :func:`seed_sensitivity`: the learning-rate sensitivity of Wortsman et al. 2023,
  "Small-scale proxies for large-scale Transformer training instabilities",
  arXiv:2309.14322, §3.1, of one seed's losses over the grid,
  ``LR sensitivity = E_{η in grid}[ min(ℓ(η), ℓ0) − ℓ* ]``, ``ℓ* = min_η ℓ(η)``;
* :func:`method_profile`: per rate, the mean loss and its 95 % t interval over the seeds; the
  best rate and loss with a bootstrap over seeds; the width of the basin around the best rate;
  the largest rate at which every seed trained; the sensitivity of each seed and their mean;
* :func:`sensitivity_verdicts`: the study's verdict rule
  (:func:`modbench.analysis.stats.compare`) applied to the per-seed sensitivities, lower is
  better: is a method shown less (or more) sensitive than the baseline?
* :func:`rate_dependent`: whether a method's per-rate verdicts against the baseline include
  both an improvement and a degradation.

Sensitivities are computed per seed, not from the seeds' mean losses, so that the seeds'
spread of sensitivities is the noise the verdict tests against (a seed is one replicate of
the whole grid). Pure functions and frozen dataclasses, no I/O; docs/statistics.md,
"Learning-rate profiles", states every definition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from scipy import stats as sps

from modbench.analysis.stats import VerdictRule, compare

#: The confidence of every interval of this module (t intervals and bootstrap percentiles).
CONFIDENCE: Final = 0.95

#: compare's verdicts renamed for sensitivity (lower sensitivity is better); others pass.
_VERDICT_NAMES: Final = {
    "improver": "less_sensitive",
    "degrader": "more_sensitive",
    "within_noise": "not_shown",
}

Losses = Mapping[int, float | None]
#: rate -> {seed -> final validation loss, or None for a failed run}
LossTable = Mapping[float, Losses]


def _loss(x: float | None) -> float:
    """A final loss as a float, NaN for a failed run (None, NaN, ±inf)."""
    if x is None:
        return math.nan
    v = float(x)
    return v if math.isfinite(v) else math.nan


def _json(x: Any) -> Any:
    """``x`` with tuples as lists, non-finite floats as None, mapping keys as strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json(v) for v in x]
    return x


def _t_interval(x: npt.NDArray[np.float64]) -> tuple[float, float] | None:
    """``mean ± t_{0.975; n−1} · s / √n`` over the finite ``x`` (s with ddof = 1); None with
    fewer than 2 values."""
    n = int(x.size)
    if n < 2:
        return None
    m = float(x.mean())
    half = float(sps.t.ppf(0.5 + CONFIDENCE / 2.0, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    return (m - half, m + half)


# --------------------------------------------------------------------------------------------
# One seed's sensitivity


def seed_sensitivity(losses: Sequence[float | None], init_loss: float) -> float:
    """The learning-rate sensitivity of one seed (Wortsman et al. 2023, arXiv:2309.14322,
    §3.1):

        LR sensitivity = E_{η ∈ grid}[ min(ℓ(η), ℓ0) − ℓ* ],   ℓ* = min_{η ∈ grid} ℓ(η),

    ``losses[i] = ℓ(η_i)`` the final loss at the grid's i-th rate, ``init_loss = ℓ0`` the loss
    at initialisation. A failed point (None, NaN, ±inf) counts as ℓ0: the paper caps every
    point at the initial loss, so a diverged run costs ``ℓ0 − ℓ*`` and no more. ℓ* is the
    minimum of the capped points (the same as min ℓ unless every point is above ℓ0, when the
    sensitivity is 0). The expectation is the plain mean over the grid points (the grid is
    log-spaced, so each point stands for the same factor of rate). 0 means the loss does not
    depend on the rate within the grid; larger is more sensitive.

    Returns NaN when every point failed (or the grid is empty): no ℓ* to measure against.
    A non-finite ``init_loss`` raises ValueError.
    """
    l0 = float(init_loss)
    if not math.isfinite(l0):
        raise ValueError(f"init_loss must be finite, got {init_loss!r}")
    x = np.array([_loss(v) for v in losses], dtype=np.float64)
    ok = np.isfinite(x)
    if not ok.any():
        return math.nan
    capped = np.where(ok, np.minimum(x, l0), l0)
    return float(np.mean(capped - capped.min()))


# --------------------------------------------------------------------------------------------
# A method's profile


@dataclass(frozen=True)
class RateCell:
    """One grid rate of one method: its runs, failed runs, and the finite seeds' mean final
    loss with its 95 % t interval (``mean ± t_{0.975; n−1} s/√n``, n the finite seeds)."""

    rate: float
    seeds: int  # runs at this rate
    failed: int  # of them failed (None / non-finite)
    mean: float | None  # mean final loss of the finite seeds (None: none finite)
    lo: float | None  # 95 % t interval of that mean (None: fewer than 2 finite seeds)
    hi: float | None
    dropped: int = 0  # of them dropped by the halving rule (then mean, lo, hi are None)

    @property
    def stable(self) -> bool:
        """Every seed run at this rate trained (at least one run, none failed; a point the
        halving rule dropped failed nowhere, as far as it ran)."""
        return self.seeds > 0 and self.failed == 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN / inf as None); ``dropped`` only where the halving rule
        dropped the point."""
        keys = ("rate", "seeds", "failed", "mean", "lo", "hi", *(("dropped",) if self.dropped
                                                                   else ()))
        return {k: _json(getattr(self, k)) for k in keys}


@dataclass(frozen=True)
class MethodProfile:
    """One method's learning-rate profile (see :func:`method_profile` for each definition)."""

    method: str
    cells: tuple[RateCell, ...]  # one per grid rate, ascending rate
    best_rate: float | None  # argmin of the mean loss over the eligible rates
    best_loss: float | None  # that mean
    best_loss_ci: tuple[float, float] | None  # seed bootstrap, 95 % percentile
    best_rate_ci: tuple[float, float] | None  # same bootstrap, of the argmin rate
    sensitivity: float  # mean over seeds of seed_sensitivity (NaN if none)
    sensitivity_ci: tuple[float, float] | None  # 95 % t interval over the seeds
    seed_sensitivities: dict[int, float]
    basin_log2: float | None  # log2(highest / lowest rate) of the basin around best_rate
    max_stable_rate: float | None  # largest rate at which every seed trained

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: floats, lists and dicts; NaN / inf as None; tuples as lists; the
        seeds of ``seed_sensitivities`` as string keys (as JSON writes them)."""
        return {
            "method": self.method,
            "cells": [c.to_dict() for c in self.cells],
            "best_rate": _json(self.best_rate),
            "best_loss": _json(self.best_loss),
            "best_loss_ci": _json(self.best_loss_ci),
            "best_rate_ci": _json(self.best_rate_ci),
            "sensitivity": _json(self.sensitivity),
            "sensitivity_ci": _json(self.sensitivity_ci),
            "seed_sensitivities": _json(self.seed_sensitivities),
            "basin_log2": _json(self.basin_log2),
            "max_stable_rate": _json(self.max_stable_rate),
        }


def _cell(rate: float, runs: Losses) -> RateCell:
    x = np.array([_loss(v) for v in runs.values()], dtype=np.float64)
    fin = x[np.isfinite(x)]
    ci = _t_interval(fin)
    return RateCell(
        rate=rate,
        seeds=int(x.size),
        failed=int(x.size - fin.size),
        mean=float(fin.mean()) if fin.size else None,
        lo=ci[0] if ci else None,
        hi=ci[1] if ci else None,
    )


def _eligible(cells: Sequence[RateCell]) -> npt.NDArray[np.bool_]:
    """The rates the best rate is chosen among: those where every seed trained (to the end:
    not dropped by the halving rule), or, if there are none, those with any finite seed."""
    stable = np.array([c.stable and not c.dropped for c in cells], dtype=bool)
    if stable.any():
        return stable
    return np.array([c.mean is not None for c in cells], dtype=bool)


def _basin(cells: Sequence[RateCell], best: int, tolerance: float) -> float:
    """log2 of the ratio of the highest to the lowest rate of the contiguous run of grid rates
    around ``cells[best]`` whose mean is within ``tolerance`` of the best mean and whose
    seeds all trained (the best rate itself always belongs)."""
    best_loss = cells[best].mean
    assert best_loss is not None

    def inside(c: RateCell) -> bool:
        return c.stable and c.mean is not None and c.mean <= best_loss + tolerance

    lo = best
    while lo > 0 and inside(cells[lo - 1]):
        lo -= 1
    hi = best
    while hi < len(cells) - 1 and inside(cells[hi + 1]):
        hi += 1
    return math.log2(cells[hi].rate / cells[lo].rate)


def _bootstrap_best(matrix: npt.NDArray[np.float64], rates: npt.NDArray[np.float64],
                    eligible: npt.NDArray[np.bool_], n_resamples: int, seed: int
                    ) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """The seed bootstrap of the best loss and the best rate. ``matrix[s, r]`` is seed s's
    loss at rate r (NaN: failed or not run). Each resample draws the seeds (rows) with
    replacement, so a seed's losses at every rate move together, recomputes each eligible
    rate's mean over the drawn seeds' finite losses, and takes the minimum and its rate.
    Resamples in which no eligible rate has a finite loss are dropped; None if all are."""
    n_seeds = matrix.shape[0]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_seeds, size=(n_resamples, n_seeds))
    weights = np.zeros((n_resamples, n_seeds), dtype=np.float64)
    np.add.at(weights, (np.arange(n_resamples)[:, None], idx), 1.0)
    sub = matrix[:, eligible]
    ok = np.isfinite(sub)
    sums = weights @ np.where(ok, sub, 0.0)
    counts = weights @ ok.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), np.inf)
    keep = np.isfinite(means).any(axis=1)
    if not keep.any():
        return None
    means = means[keep]
    arg = means.argmin(axis=1)
    best = means[np.arange(means.shape[0]), arg]
    best_rates = rates[eligible][arg]
    q = (0.5 - CONFIDENCE / 2.0, 0.5 + CONFIDENCE / 2.0)
    loss_ci = np.quantile(best, q)
    rate_ci = np.quantile(best_rates, q, method="inverted_cdf")
    return ((float(loss_ci[0]), float(loss_ci[1])), (float(rate_ci[0]), float(rate_ci[1])))


def method_profile(method: str, table: LossTable, init_loss: Mapping[int, float] | float, *,
                   tolerance: float = 0.02, n_resamples: int = 2000, seed: int = 0,
                   dropped: LossTable | None = None) -> MethodProfile:
    """One method's learning-rate profile from ``table`` (``{rate: {seed: final loss or
    None}}``) and its loss at initialisation ``init_loss`` (ℓ0 per seed, or one value for
    every seed).

    * ``cells``: per grid rate (ascending), the runs, the failed runs and the finite seeds'
      mean loss with its 95 % t interval ``mean ± t_{0.975; n−1} s/√n``.
    * ``best_rate`` / ``best_loss``: the rate of lowest mean loss among the rates where every
      seed trained (if there are none, among the rates with any finite seed) and that mean;
      ties go to the lower rate. None when nothing trained.
    * ``best_loss_ci`` / ``best_rate_ci``: a seed bootstrap (``n_resamples`` resamples,
      ``numpy.random.default_rng(seed)``, so deterministic): draw the seed numbers with
      replacement (a seed's losses at every rate move together), recompute the per-rate means
      over the drawn seeds, take the minimum over the same eligible rates and its rate. The
      loss interval is the 2.5 / 97.5 % percentiles (``np.quantile``, linear); the rate
      interval the same percentiles of the argmin rates by the inverted CDF, so both ends are
      grid rates. With one seed both are points.
    * ``seed_sensitivities``: :func:`seed_sensitivity` of every seed that was run at every
      grid rate (a seed missing at a rate has no sensitivity over the grid and is left out),
      NaN where all its runs failed; ``sensitivity`` their mean over the finite ones (NaN if
      none), ``sensitivity_ci`` its 95 % t interval (None with fewer than 2 finite).
    * ``basin_log2``: the width, in log2 units of rate, of the contiguous run of grid rates
      around ``best_rate`` whose mean loss is within ``tolerance`` (loss units: by default
      within 0.02 nats of the best) of ``best_loss``; a rate with a failed seed ends the basin.
      ``log2(highest / lowest rate in it)``: 0.0 when only the best rate qualifies, 1.0 for two
      neighbouring rates a factor 2 apart.
    * ``max_stable_rate``: the largest rate at which every seed trained (None: none).

    ``dropped`` (the halving rule's, ``{rate: {seed: loss when dropped}}``, rates of
    ``table``, whose own entries there are then ignored): such a point has no final loss, so
    its cell counts its runs as ``dropped`` with no mean, and it is never the best rate, in
    the basin or the largest stable rate (whether it would have trained to the end is not
    known: with a higher point dropped, ``max_stable_rate`` is a lower bound); and each seed's
    sensitivity takes its loss when dropped (capped at ℓ0 as every point): above the final
    loss of a point that would have trained on, below the ℓ0 of one that would have diverged
    or stalled, so a halved profile's sensitivity is approximate, in either direction
    (docs/statistics.md, "Successive halving").

    Rates must be positive and finite (ValueError); a seed without ℓ0 in a mapping
    ``init_loss`` raises KeyError. An empty table gives an empty profile.
    """
    rates = sorted(float(r) for r in table)
    for r in rates:
        if not (math.isfinite(r) and r > 0):
            raise ValueError(f"rates must be positive and finite, got {r!r}")
    if len(set(rates)) != len(rates):
        raise ValueError("duplicate rates in the table")
    by_rate = {float(r): runs for r, runs in table.items()}
    cut = {float(r): runs for r, runs in (dropped or {}).items()}
    if not set(cut) <= set(by_rate):
        raise ValueError(f"dropped rates {sorted(set(cut) - set(by_rate))} are not in the table")
    by_rate.update(cut)
    cells = tuple(RateCell(r, len(cut[r]), 0, None, None, None, dropped=len(cut[r]))
                  if r in cut else _cell(r, by_rate[r]) for r in rates)

    seeds = sorted({int(s) for runs in by_rate.values() for s in runs})
    matrix = np.full((len(seeds), len(rates)), np.nan, dtype=np.float64)
    row = {s: i for i, s in enumerate(seeds)}
    present = np.zeros_like(matrix, dtype=bool)
    for j, r in enumerate(rates):
        for s, v in by_rate[r].items():
            matrix[row[int(s)], j] = _loss(v)
            present[row[int(s)], j] = True

    def l0(s: int) -> float:
        if isinstance(init_loss, Mapping):
            if s not in init_loss:
                raise KeyError(f"no initial loss for seed {s} of {method!r}")
            return float(init_loss[s])
        return float(init_loss)

    seed_sens = {s: seed_sensitivity([None if math.isnan(v) else float(v)
                                      for v in matrix[row[s]]], l0(s))
                 for s in seeds if present[row[s]].all()}
    sens = np.array([v for v in seed_sens.values() if math.isfinite(v)], dtype=np.float64)

    rate_arr = np.array(rates, dtype=np.float64)
    best_rate = best_loss = basin = None
    boot = None
    if cells:
        eligible = _eligible(cells)
        if eligible.any():
            means = np.array([c.mean if c.mean is not None else np.inf for c in cells])
            best = int(np.argmin(np.where(eligible, means, np.inf)))
            best_rate, best_loss = cells[best].rate, cells[best].mean
            basin = _basin(cells, best, tolerance)
            boot = _bootstrap_best(matrix, rate_arr, eligible, n_resamples, seed)
    stable = [c.rate for c in cells if c.stable and not c.dropped]
    return MethodProfile(
        method=method,
        cells=cells,
        best_rate=best_rate,
        best_loss=best_loss,
        best_loss_ci=boot[0] if boot else None,
        best_rate_ci=boot[1] if boot else None,
        sensitivity=float(sens.mean()) if sens.size else math.nan,
        sensitivity_ci=_t_interval(sens),
        seed_sensitivities=seed_sens,
        basin_log2=basin,
        max_stable_rate=max(stable) if stable else None,
    )


# --------------------------------------------------------------------------------------------
# Verdicts on sensitivity


@dataclass(frozen=True)
class SensitivityVerdict:
    """One method's sensitivity judged against the baseline's (:func:`sensitivity_verdicts`)."""

    method: str
    delta: float  # method's mean sensitivity − baseline's (negative: less sensitive)
    ci: tuple[float, float]  # the verdict's test's interval for delta (sensitivity units)
    p_adjusted: float  # the test's p, corrected by the rule's correction (Holm)
    verdict: str  # less_sensitive | more_sensitive | not_shown | baseline | undetermined | ...
    test: str  # the test that decided (compare's test column)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN / inf as None, the interval as a list)."""
        return {"method": self.method, "delta": _json(self.delta), "ci": _json(self.ci),
                "p_adjusted": _json(self.p_adjusted), "verdict": self.verdict,
                "test": self.test}


def sensitivity_verdicts(per_seed: Mapping[str, Mapping[int, float | None]], baseline: str,
                         *, alpha: float = 0.05) -> list[SensitivityVerdict]:
    """Each method's per-seed sensitivities (``{method: {seed: sensitivity}}``, the baseline
    among them; None or NaN: a seed with no sensitivity, a failed seed of the rule) judged
    against the baseline's by the study's verdict rule,
    :func:`modbench.analysis.stats.compare` with ``higher_is_better=False`` (lower sensitivity
    is better) at ``alpha``: the seeds' spread of sensitivities is the noise floor and the
    test's error term, the methods are one correction family (Holm).

    compare's verdicts are renamed: ``improver`` → ``less_sensitive``, ``degrader`` →
    ``more_sensitive``, ``within_noise`` → ``not_shown``; ``baseline``, ``undetermined`` (and
    any other, e.g. ``diverged`` for a method whose seeds' sensitivities are all NaN) pass
    through. ``delta`` is compare's delta, mean(method) − mean(baseline) in sensitivity units
    (negative: less sensitive; 0 for the baseline), ``ci`` the test's interval for it
    (Bonferroni-simultaneous over the compared methods; NaN where no test ran), ``p_adjusted``
    the Holm-corrected p (NaN for the baseline). One result per method, in ``per_seed``'s
    order; a ``baseline`` not in ``per_seed`` raises KeyError.
    """
    rule = VerdictRule(alpha=alpha)
    table = {m: {int(s): v for s, v in seeds.items()} for m, seeds in per_seed.items()}
    results = compare(table, baseline, higher_is_better=False, rule=rule)
    out: list[SensitivityVerdict] = []
    for r in results:
        v = str(r.verdict)
        out.append(SensitivityVerdict(
            method=r.method,
            delta=float(r.delta),
            ci=(float(r.ci[0]), float(r.ci[1])),
            p_adjusted=float(r.p_adjusted[rule.correction]),
            verdict=_VERDICT_NAMES.get(v, v),
            test=str(r.test),
        ))
    return out


def rate_dependent(verdicts_by_rate: Mapping[float, str]) -> bool:
    """Whether a method's verdict against the baseline depends on the learning rate: True when
    its per-rate verdicts (compare's, on the final losses at each rate; the caller passes only
    the rates at which both the method and the baseline trained) include both ``improver`` and
    ``degrader``, decided verdicts of opposite sign. ``within_noise``, ``undetermined`` and
    failures never make a method rate-dependent: "better at one rate, not shown at another" is
    not a reversal."""
    seen = {str(v) for v in verdicts_by_rate.values()}
    return "improver" in seen and "degrader" in seen

# --------------------------------------------------------------------------------------------
# Successive halving: grid points dropped early


@dataclass(frozen=True)
class Drop:
    """A grid point the halving rule drops at a rung (:func:`halving_drops`)."""

    point: int  # its index in the grid
    best: int  # the point it was compared with: the lowest mean loss at the rung
    gap: float  # the mean over the seeds of its loss minus the best point's, at the rung
    min_gap: float  # the smallest seed's gap (above the margin: every seed is clearly worse)

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point, "best": self.best, "gap": _json(self.gap),
                "min_gap": _json(self.min_gap)}


def halving_drops(losses: Sequence[Mapping[int, float | None] | None], margin: float
                  ) -> list[Drop]:
    """The grid points of one method that a rung of the halving rule drops.

    ``losses[i]``: grid point i's validation loss at the rung, by seed; None for a point out
    of the running (dropped at an earlier rung, or ended: diverged or stalled). A point with a
    seed whose loss is missing or not finite is not compared (a run that failed ends by itself,
    a failed outcome the profile keeps). Among the others, the best point is the one of lowest
    mean loss over its seeds (a tie: the lower index); a point is dropped when, on every seed
    it shares with the best point, its loss is above that seed's loss at the best point by
    more than ``margin`` (paired by seed: the same initial weights and batches), so a point is
    dropped only if it is clearly worse on each seed, not on average. Returns the drops in
    grid order (none with fewer than two comparable points).
    """
    if not (isinstance(margin, int | float) and math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite loss difference >= 0, got {margin!r}")
    live = {i: {int(s): float(v) for s, v in runs.items() if v is not None}
            for i, runs in enumerate(losses) if runs}
    live = {i: runs for i, runs in live.items()
            if runs and len(runs) == len(losses[i] or {})
            and all(math.isfinite(v) for v in runs.values())}
    if len(live) < 2:
        return []
    best = min(live, key=lambda i: (float(np.mean(list(live[i].values()))), i))
    out: list[Drop] = []
    for i, runs in sorted(live.items()):
        shared = sorted(set(runs) & set(live[best]))
        if i == best or not shared:
            continue
        gaps = np.array([runs[s] - live[best][s] for s in shared], dtype=np.float64)
        if float(gaps.min()) > margin:
            out.append(Drop(i, best, float(gaps.mean()), float(gaps.min())))
    return out
