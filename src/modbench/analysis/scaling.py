"""Per-method scaling fits over a study's scales (a ladder, docs/studies.md "Ladders"), the gap
to the baseline along them, an effective compute multiplier, and a leave-last-out check of
what the smaller rungs predict for the largest (issue 31; docs/statistics.md, "Scaling fits").

**Points.** One per finished run that did not fail (diverged or stalled runs have no loss to
fit): its final validation loss L, its non-embedding parameters N (the run's parameters less
``vocab x d`` for the embedding, twice for an untied head; Kaplan et al. 2020's convention)
and its training FLOPs C (``measure.flops``' training FLOPs per token x tokens trained).
A method's rung is the mean over its seeds at one scale; the rungs are ordered by N.

**The fit.** ``L(x) = E + A x^(-alpha)`` for x = N or C (Kaplan et al. 2020; Hoffmann et al.
2022 with the data term folded in, since a ladder holds tokens per parameter fixed), fitted
to the rung means by ``scipy.optimize.curve_fit`` (least squares, trust-region reflective,
``0 <= E < min L``, ``A > 0``, ``0 < alpha <= ALPHA_MAX``), x rescaled by its geometric mean
for conditioning. **Fallback**: where that fit is ill-posed, the power law without an
irreducible term, ``L = A x^(-alpha)``, fitted by ``curve_fit`` in log space (a straight line
in log L against log x, any sign of alpha). Ill-posed means: fewer than 3 distinct x; the
least-squares solver fails; E at either end of its range (within 1e-6 of 0 or of min L,
where the data do not pin it down); alpha at its bound; or a non-finite result. With fewer
than 2 distinct x there is no fit.

**Uncertainty: the seed bootstrap.** ``BOOT`` resamples; in each, every (method, rung) draws
its seeds with replacement (independently, ``numpy.random.default_rng(seed)``), the drawn
mean's deviation from the rung mean scaled by ``sqrt(n / (n - 1))`` (so it has the variance of
a mean of n seeds; the plain bootstrap's is (n - 1)/n of it), its means are refitted, and
every derived number (alpha, E, gaps, multiplier, predictions) is computed from that
replicate, the method's replicate b paired with the baseline's replicate b. Intervals are the
2.5 % and 97.5 % percentiles. A rung with one seed contributes no spread of its own.

**Gap and trend.** The gain at a rung is ``mean L(baseline) - mean L(method)`` (positive: the
method is better). Its trend along the ladder is the least-squares slope of the gain against
log10 N: ``grows`` where the slope's interval lies above 0, ``shrinks`` where it lies below,
``crosses zero`` where one rung's gain interval lies wholly above 0 and another's wholly
below (this takes precedence), else ``flat`` (no trend shown at this budget).

**Effective compute multiplier** (at the largest rung): the training compute the baseline's
fitted loss-vs-FLOPs curve needs to reach the method's measured loss there, over the method's
own compute, ``C_base(L_method) / C_method``: above 1 the method is worth that much more
compute. Infinite where the method's loss lies below the baseline's fitted E.

**Leave-last-out prediction.** Each method's loss-vs-N curve fitted to every rung but the
largest, evaluated at the largest rung's N; the gap likewise (the method's prediction less
the baseline's). The 95 % prediction interval holds the bootstrap's spread of the prediction
plus the noise of the rung mean being predicted: each replicate adds a normal draw with
the pooled within-rung seed std of the fitted rungs over sqrt(seeds at the largest rung)
(two such draws for a gap). How it did: ``error = observed - predicted`` and ``z = error /
half-width`` of the interval (|z| <= 1: inside it).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

BOOT = 100  # bootstrap resamples
ALPHA_MAX = 4.0  # the full form's upper bound on alpha
EDGE = 1e-6  # relative distance from a bound at which a parameter counts as at the bound
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Point:
    """One run: its method, scale and seed, non-embedding parameters, training FLOPs (None
    where unknown) and final validation loss."""

    method: str
    scale: str
    seed: int
    params: float
    flops: float | None
    loss: float


@dataclass(frozen=True)
class PowerFit:
    """``L(x) = E + A x^(-alpha)`` (``form`` ``"E + A x^-α"``; E = 0 for the fallback form
    ``"A x^-α"``)."""

    form: str
    E: float
    A: float
    alpha: float
    fallback: bool = False
    why: str = ""  # why the full form was refused (the fallback's reason)

    def __call__(self, x: float | npt.NDArray[np.float64]) -> Any:
        return self.E + self.A * np.power(x, -self.alpha)

    def inverse(self, loss: float) -> float:
        """The x whose fitted loss is ``loss`` (inf where ``loss`` is at or below E, or the
        curve does not fall)."""
        if self.alpha == 0 or loss <= self.E:
            return math.inf
        r = (loss - self.E) / self.A
        if r <= 0:
            return math.inf
        return float(r ** (-1.0 / self.alpha))


FULL, POWER = "E + A x^-α", "A x^-α"


def _full(x: npt.NDArray[np.float64], e: float, b: float, a: float) -> Any:
    return e + b * np.power(x, -a)


def _full_jac(x: npt.NDArray[np.float64], e: float, b: float, a: float) -> Any:
    p = np.power(x, -a)
    return np.stack([np.ones_like(x), p, -b * p * np.log(x)], axis=1)


_GRID = np.linspace(0.02, ALPHA_MAX * 0.95, 48)


def _start(u: npt.NDArray[np.float64], y: npt.NDArray[np.float64], lo_y: float
           ) -> tuple[float, float, float]:
    """curve_fit's starting point: over a grid of alpha, (E, B) by linear least squares (E
    kept inside [0, min L), B > 0), the alpha with the smallest residual."""
    p = np.power(u[None, :], -_GRID[:, None])  # (alphas, points)
    pc, yc = p - p.mean(axis=1, keepdims=True), y - y.mean()
    var = np.einsum("ij,ij->i", pc, pc)
    b = np.maximum(np.where(var > 0, pc @ yc / np.where(var > 0, var, 1.0), 0.0), 1e-12)
    e = np.clip((y[None, :] - b[:, None] * p).mean(axis=1), 0.01 * lo_y, 0.99 * lo_y)
    r = np.square(e[:, None] + b[:, None] * p - y[None, :]).sum(axis=1)
    i = int(np.argmin(r))
    return float(e[i]), float(b[i]), float(_GRID[i])


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> PowerFit | None:
    """Fit ``y = E + A x^(-alpha)`` (the module's rules; the fallback ``A x^-alpha`` where it
    is ill-posed); None with fewer than 2 distinct x or non-positive values."""
    from scipy.optimize import curve_fit

    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(xs) & np.isfinite(ys) & (xs > 0) & (ys > 0)
    xs, ys = xs[ok], ys[ok]
    distinct = len(np.unique(xs))
    if distinct < 2:
        return None
    ref = float(np.exp(np.mean(np.log(xs))))
    u = xs / ref
    why = f"{distinct} distinct sizes (the full form needs 3)" if distinct < 3 else ""
    if not why:
        lo_y = float(ys.min())
        e0, b0, a0 = _start(u, ys, lo_y)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (e, b, a), _ = curve_fit(_full, u, ys, p0=(e0, b0, a0), jac=_full_jac,
                                         bounds=([0.0, 0.0, 0.0], [lo_y, np.inf, ALPHA_MAX]),
                                         method="trf", maxfev=5000)
        except (RuntimeError, ValueError) as exc:
            why = f"the least-squares fit failed ({type(exc).__name__})"
        else:
            if not all(math.isfinite(v) for v in (e, b, a)):
                why = "a non-finite fit"
            elif e <= EDGE * lo_y or e >= lo_y * (1 - EDGE):
                why = "E at the end of its range [0, min L): the rungs do not pin it down"
            elif a >= ALPHA_MAX * (1 - EDGE) or a <= EDGE:
                why = "alpha at its bound"
            else:
                return PowerFit(FULL, float(e), float(b * ref ** a), float(a))
    # fallback: log L = log A - alpha log x, by curve_fit on the logs
    def line(lx: npt.NDArray[np.float64], la: float, a: float) -> Any:
        return la - a * lx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (la, a), _ = curve_fit(line, np.log(u), np.log(ys), p0=(float(np.log(ys.mean())), 0.1))
    return PowerFit(POWER, 0.0, float(math.exp(la) * ref ** a), float(a), True, why)


def _interval(values: Iterable[float]) -> tuple[float, float]:
    """The central :data:`CONFIDENCE` percentile interval of the finite values (NaNs: none)."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if v.size == 0:
        return (math.nan, math.nan)
    tail = 100 * (1 - CONFIDENCE) / 2
    lo, hi = np.percentile(v, [tail, 100 - tail])
    return (float(lo), float(hi))


@dataclass
class Rung:
    """One method at one scale: its seeds' mean loss, and the gain over the baseline."""

    scale: str
    params: float
    flops: float | None
    mean: float
    seeds: int
    gain: float = math.nan  # baseline mean - method mean (positive: better)
    gain_ci: tuple[float, float] = (math.nan, math.nan)


@dataclass
class Prediction:
    """What the rungs below the largest predict for it, and what it measured."""

    scale: str
    params: float
    loss: float  # predicted
    loss_pi: tuple[float, float]
    observed: float
    gain: float = math.nan  # predicted gain over the baseline
    gain_pi: tuple[float, float] = (math.nan, math.nan)
    observed_gain: float = math.nan
    fallback: bool = False
    draws: npt.NDArray[np.float64] = field(default_factory=lambda: np.empty(0), repr=False)

    @staticmethod
    def z(observed: float, predicted: float, pi: tuple[float, float]) -> float:
        """The error in units of the interval's half-width on the error's side."""
        err = observed - predicted
        half = (pi[1] - predicted) if err >= 0 else (predicted - pi[0])
        if not half > 0:
            return math.nan if err == 0 or math.isnan(err) else math.copysign(math.inf, err)
        return err / half

    @property
    def loss_z(self) -> float:
        return self.z(self.observed, self.loss, self.loss_pi)

    @property
    def gain_z(self) -> float:
        return self.z(self.observed_gain, self.gain, self.gain_pi)


@dataclass
class MethodScaling:
    """One method's fits, gaps, trend, multiplier and prediction."""

    method: str
    rungs: list[Rung]
    fit_n: PowerFit | None
    fit_c: PowerFit | None
    alpha_ci: tuple[float, float] = (math.nan, math.nan)
    E_ci: tuple[float, float] = (math.nan, math.nan)
    alpha_c_ci: tuple[float, float] = (math.nan, math.nan)
    trend: str = ""  # grows | shrinks | crosses zero | flat ("" for the baseline)
    slope: float = math.nan  # gain per decade of N
    slope_ci: tuple[float, float] = (math.nan, math.nan)
    multiplier: float = math.nan  # effective compute multiplier at the largest rung
    multiplier_ci: tuple[float, float] = (math.nan, math.nan)
    prediction: Prediction | None = None
    boot_n: list[PowerFit | None] = field(default_factory=list, repr=False)  # replicates
    boot_c: list[PowerFit | None] = field(default_factory=list, repr=False)  # ... vs FLOPs
    pooled_sd: float = math.nan  # within-rung seed std, pooled over the rungs

    def extrapolate(self, params: float) -> float:
        return float(self.fit_n(params)) if self.fit_n is not None else math.nan


@dataclass
class ScalingAnalysis:
    baseline: str
    scales: list[str]  # ordered by the baseline's N
    methods: dict[str, MethodScaling]
    boot: int

    def extrapolated_gain(self, method: str, params: float, base_params: float
                          ) -> tuple[float, tuple[float, float]]:
        """The gain (baseline - method) the full-ladder fits give at a target's N (the
        method's and the baseline's own), with its bootstrap interval (no seed-noise term:
        the interval of the curves, not of one run)."""
        m, b = self.methods[method], self.methods[self.baseline]
        if m.fit_n is None or b.fit_n is None:
            return math.nan, (math.nan, math.nan)
        point = b.extrapolate(base_params) - m.extrapolate(params)
        reps = [float(fb(base_params) - fm(params))
                for fm, fb in zip(m.boot_n, b.boot_n, strict=True)
                if fm is not None and fb is not None]
        return point, _interval(reps)


# ------------------------------------------------------------------ from a study's runs


def _embedding_params(run_dir: Path | None, scale: str) -> int:
    """``vocab x d`` (twice untied) from the run's config.yaml, else the scale's preset."""
    model: dict[str, Any] = {}
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        import yaml

        try:
            tree = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
            model = dict((tree or {}).get("model") or {})
        except (OSError, ValueError, yaml.YAMLError):
            model = {}
    if not model:
        from modbench.config import PRESETS

        if scale not in PRESETS:
            return 0
        m = PRESETS[scale].model
        model = {"vocab_size": m.vocab_size, "d_model": m.d_model,
                 "tie_embeddings": m.tie_embeddings}
    return int(model["vocab_size"]) * int(model["d_model"]) * (
        1 if model.get("tie_embeddings", True) else 2)


def points_from_results(results: Any) -> list[Point]:
    """The points of a :class:`~modbench.analysis.results.StudyResults`: every finished run
    that did not fail, with a finite validation loss and a parameter count."""
    pts: list[Point] = []
    emb: dict[tuple[str, str], int] = {}
    for r in results.rows:
        if r.state != "done" or r.failed or r.params is None:
            continue
        loss = r.val_loss
        if not isinstance(loss, int | float) or not math.isfinite(loss):
            continue
        key = (r.scale, r.method)
        if key not in emb:
            emb[key] = _embedding_params(r.run_dir, r.scale)
        fl = results.flops_of(r.scale, r.method)
        flops = (fl.train_flops_per_token * r.tokens if fl is not None and r.tokens else None)
        pts.append(Point(r.method, r.scale, r.seed, float(r.params - emb[key]), flops,
                         float(loss)))
    return pts


# ------------------------------------------------------------------ the analysis


def _trend(gains: list[float], cis: list[tuple[float, float]], slope_ci: tuple[float, float]
           ) -> str:
    tol = 1e-9 * max([1.0, *(abs(g) for g in gains if math.isfinite(g))])  # rounding
    above = any(lo > tol for lo, _ in cis)
    below = any(hi < -tol for _, hi in cis)
    if above and below:
        return "crosses zero"
    if slope_ci[0] > tol:
        return "grows"
    if slope_ci[1] < -tol:
        return "shrinks"
    return "flat"


def _slope(logn: Sequence[float], gains: Sequence[float]) -> float:
    x, y = np.asarray(logn, dtype=float), np.asarray(gains, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 2 or len(np.unique(x[ok])) < 2:
        return math.nan
    return float(np.polyfit(x[ok], y[ok], 1)[0])


def analyse(points: Sequence[Point], baseline: str, *, boot: int = BOOT, seed: int = 0,
            fitter: Callable[[Sequence[float], Sequence[float]], PowerFit | None]
            = fit_power_law) -> ScalingAnalysis | None:
    """The scaling analysis of ``points`` against ``baseline``; None with fewer than 3
    scales where the baseline has points (no fit to speak of)."""
    by: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        by.setdefault((p.method, p.scale), []).append(p)
    base_scales = {s for (m, s) in by if m == baseline}
    if len(base_scales) < 3:
        return None
    n_of = {s: float(np.mean([p.params for p in by[(baseline, s)]])) for s in base_scales}
    scales = sorted(base_scales, key=lambda s: (n_of[s], s))
    methods = [baseline, *sorted({m for m, _ in by} - {baseline})]
    rng = np.random.default_rng(seed)
    # replicate means: reps[(method, scale)][b]
    reps: dict[tuple[str, str], npt.NDArray[np.float64]] = {}
    for key in sorted(by):
        losses = np.asarray([p.loss for p in sorted(by[key], key=lambda p: p.seed)])
        n = len(losses)
        idx = rng.integers(0, n, size=(boot, n))
        mean = float(losses.mean())
        # the seeds' deviations scaled by sqrt(n / (n - 1)): a resampled mean then has the
        # variance s^2 / n of the mean, not (n - 1) / n of it (2/3 with 3 seeds)
        inflate = math.sqrt(n / (n - 1)) if n > 1 else 0.0
        reps[key] = mean + inflate * (losses[idx].mean(axis=1) - mean)
    out: dict[str, MethodScaling] = {}
    top = scales[-1]
    for m in methods:
        here = [s for s in scales if (m, s) in by]
        rungs = []
        for s in here:
            ps = by[(m, s)]
            fl = [p.flops for p in ps]
            rungs.append(Rung(s, float(np.mean([p.params for p in ps])),
                              float(np.mean(fl)) if all(f is not None for f in fl) else None,
                              float(np.mean([p.loss for p in ps])), len(ps)))
        ns = [r.params for r in rungs]
        means = [r.mean for r in rungs]
        fit_n = fitter(ns, means)
        has_c = all(r.flops is not None for r in rungs)
        cs = [float(r.flops) for r in rungs if r.flops is not None]
        fit_c = fitter(cs, means) if has_c else None
        sds = [float(np.std([p.loss for p in by[(m, s)]], ddof=1)) for s in here
               if len(by[(m, s)]) > 1]
        dfs = [len(by[(m, s)]) - 1 for s in here if len(by[(m, s)]) > 1]
        pooled = (math.sqrt(sum(d * v * v for d, v in zip(dfs, sds, strict=True)) / sum(dfs))
                  if dfs else math.nan)
        ms = MethodScaling(m, rungs, fit_n, fit_c, pooled_sd=pooled)
        boot_n, boot_c = [], []
        for b in range(boot):
            y = [float(reps[(m, s)][b]) for s in here]
            boot_n.append(fitter(ns, y))
            boot_c.append(fitter(cs, y) if has_c else None)
        ms.boot_n = boot_n
        ms.alpha_ci = _interval(f.alpha for f in boot_n if f is not None)
        ms.E_ci = _interval(f.E for f in boot_n if f is not None and not f.fallback)
        ms.alpha_c_ci = _interval(f.alpha for f in boot_c if f is not None)
        ms.boot_c = boot_c
        out[m] = ms
    base = out[baseline]
    base_means = {r.scale: r.mean for r in base.rungs}
    for m in methods:
        ms = out[m]
        if m != baseline:
            for r in ms.rungs:
                if r.scale in base_means:
                    r.gain = base_means[r.scale] - r.mean
                    r.gain_ci = _interval(reps[(baseline, r.scale)] - reps[(m, r.scale)])
            shared = [r for r in ms.rungs if r.scale in base_means]
            logn = [math.log10(r.params) for r in shared]
            ms.slope = _slope(logn, [r.gain for r in shared])
            ms.slope_ci = _interval(
                _slope(logn, [float(reps[(baseline, r.scale)][b] - reps[(m, r.scale)][b])
                              for r in shared]) for b in range(boot))
            ms.trend = (_trend([r.gain for r in shared], [r.gain_ci for r in shared],
                               ms.slope_ci) if len(shared) >= 2 else "")
            _multiplier(ms, base, top, reps, boot)
        ms.prediction = _predict(ms, base, by, reps, boot, fitter, rng)
    return ScalingAnalysis(baseline, scales, out, boot)


def _multiplier(ms: MethodScaling, base: MethodScaling, top: str,
                reps: dict[tuple[str, str], npt.NDArray[np.float64]], boot: int) -> None:
    """C_base(L_method) / C_method at the largest rung (the module's definition)."""
    r = next((x for x in ms.rungs if x.scale == top), None)
    if r is None or r.flops is None or base.fit_c is None:
        return
    ms.multiplier = base.fit_c.inverse(r.mean) / r.flops
    vals = []
    for b in range(boot):
        f = base.boot_c[b]
        if f is not None:
            v = f.inverse(float(reps[(ms.method, top)][b])) / r.flops
            vals.append(min(v, 1e300))  # an infinite replicate sorts last
    ms.multiplier_ci = _interval(vals)


def _predict(ms: MethodScaling, base: MethodScaling, by: dict[tuple[str, str], list[Point]],
             reps: dict[tuple[str, str], npt.NDArray[np.float64]], boot: int,
             fitter: Callable[[Sequence[float], Sequence[float]], PowerFit | None],
             rng: np.random.Generator) -> Prediction | None:
    """Leave-last-out: fit every rung but the largest, predict the largest (the module's
    definition of the interval)."""
    if len(ms.rungs) < 3:
        return None
    last, fit_rungs = ms.rungs[-1], ms.rungs[:-1]
    f = fitter([r.params for r in fit_rungs], [r.mean for r in fit_rungs])
    if f is None:
        return None
    m = ms.method
    n_last = by[(m, last.scale)]
    sds = [float(np.std([p.loss for p in by[(m, r.scale)]], ddof=1)) for r in fit_rungs
           if len(by[(m, r.scale)]) > 1]
    noise = (float(np.sqrt(np.mean(np.square(sds)))) / math.sqrt(len(n_last))
             if sds else 0.0)
    pred = float(f(last.params))
    draws = np.empty(boot)
    for b in range(boot):
        fb = fitter([r.params for r in fit_rungs],
                    [float(reps[(m, r.scale)][b]) for r in fit_rungs])
        draws[b] = (float(fb(last.params)) if fb is not None else math.nan) + (
            rng.normal(0.0, noise) if noise > 0 else 0.0)
    p = Prediction(last.scale, last.params, pred, _interval(draws), last.mean,
                   fallback=f.fallback, draws=draws)
    if m != base.method and base.prediction is not None and \
            base.prediction.scale == last.scale:
        bp = base.prediction
        p.gain = bp.loss - pred
        p.gain_pi = _interval(bp.draws - draws)
        p.observed_gain = bp.observed - last.mean
    return p


def method_non_embedding_params(model: Any) -> float:
    """Non-embedding parameters of a model config with its method string (a target shape
    for :meth:`ScalingAnalysis.extrapolated_gain`): ``measure.flops``' parameter count less
    ``vocab x d`` (twice untied), as :func:`points_from_results` counts a run's."""
    from modbench.measure.flops import flop_report

    emb = model.vocab_size * model.d_model * (1 if model.tie_embeddings else 2)
    return float(flop_report(model).params - emb)
