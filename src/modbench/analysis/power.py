"""The power planner (``modbench study plan SPEC --effect E``): how many seeds a study needs so
that its verdict rule calls a true effect of size E an improver with a given probability, and
what those seeds cost.

The test planned for is the verdict's own (:func:`modbench.analysis.stats.compare`, stated in
docs/statistics.md): every method against the baseline by the **pooled** t with the error term
of all the scale's groups (``df = (n_b - 1) + m (n - 1)`` for a baseline of ``n_b`` seeds and
``m`` methods of ``n``), two-sided at ``alpha`` under Holm over the ``m`` methods, and a
verdict only when ``|Δ|`` also exceeds ``floor_sigmas`` times the baseline's estimated sigma.
The power computed here is that of calling one method truly ``d`` sigma better an improver:

* the level is **Bonferroni**'s ``alpha / m`` per side-split test (``t > t_{1 - alpha/(2m)}``):
  Holm's first step, and a conservative bound for Holm, which never rejects less; with one
  true effect among null methods the two nearly coincide (the smallest p is the true
  effect's, tested at ``alpha / m`` by both);
* the guard ``Δ > floor_sigmas * s_b`` is part of the event: ``Δ`` is normal, the baseline's
  and the other groups' sums of squares are independent chi-squares (``U`` on ``n_b - 1``
  and ``W`` on ``m (n - 1)`` degrees of freedom), and the pooled variance is
  ``(U + W) / df``, so the probability is the double integral over the two chi-square
  quantiles of a normal tail, taken by Gauss-Legendre quadrature split where the guard stops
  binding. Without the guard (``floor_sigmas = 0``) it is exactly the noncentral t's
  ``P(T > t_crit)`` (``scipy.stats.nct``), which :func:`t_power` gives and the tests check.

Not modelled: the Brown–Forsythe switch to Welch's t when the variances differ (under equal
variances it rejects about ``HOMOGENEITY_ALPHA`` of the time or less, and Welch then has less
power) and Holm's later steps (more power): tests/analysis/test_power_plan.py checks the
planned power against a Monte Carlo of ``compare`` itself, and docs/statistics.md ("Planning
seeds") gives the figures.

Compute is the planned runs' FLOPs (the caller's per-run FLOPs, ``modbench.study.plan``'s
accounting: training plus validation passes) over a throughput: on a CPU
:data:`CPU_FLOPS_PER_S`, the built-in study's measured end-to-end rate, unless the caller
passes another.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
from scipy import stats as _sps

from modbench.errors import ModbenchError

__all__ = [
    "CPU_FLOPS_PER_S",
    "DEFAULT_POWER",
    "MAX_SEEDS",
    "MIN_SEEDS",
    "Effect",
    "PowerRow",
    "SeedPlan",
    "baseline_seeds",
    "parse_baseline_seeds",
    "parse_effect",
    "plan_seeds",
    "sigma_interval",
    "t_power",
    "verdict_power",
]

#: The power a plan aims at unless ``--power`` says otherwise (the MDE's, stats.MDE_POWER).
DEFAULT_POWER: Final = 0.8
#: Seeds per group the planner searches.
MIN_SEEDS: Final = 2
MAX_SEEDS: Final = 20
#: Training FLOP/s of one CPU worker process (one thread), end to end: the built-in study
#: (``modbench study run``, 18 runs of ``cpu-deep``, 500 steps, 4.147e13 FLOPs by
#: ``modbench.study.plan.run_flops``) took 9 min 41 s with two worker processes on two idle
#: cores (BENCHMARKS.md, "The built-in study, end to end", 2026-11-23): 4.147e13 / (581 s x 2).
#: It includes start-up, validation, the diagnostics and the report; a model of another shape
#: runs at another rate (small ones slower per FLOP), so it is an estimate, and the output says so.
CPU_FLOPS_PER_S: Final = 4.147e13 / (581.0 * 2)

_SIGMA_SUFFIX = re.compile(r"^\s*([0-9eE+\-.]+)\s*(σ|sigma|sigmas)\s*$", re.IGNORECASE)
_NUMBER = re.compile(r"^\s*[0-9eE+\-.]+\s*$")


@dataclass(frozen=True)
class Effect:
    """A planned effect: ``value`` in the metric's units (``unit == "metric"``, for a loss
    "loss units") or in sigmas of the noise floor (``unit == "sigma"``)."""

    value: float
    unit: str  # "metric" | "sigma"
    text: str = ""

    def sigmas(self, sigma: float | None) -> float:
        """The effect in sigmas (``sigma``: the noise floor in metric units, needed for an
        effect in metric units)."""
        if self.unit == "sigma":
            return self.value
        if sigma is None:
            raise ModbenchError(f"--effect {self.text} is in loss units: give the noise floor "
                                "with --sigma S or --from STUDY_FOLDER, or the effect in "
                                "sigmas (--effect 2σ)")
        return self.value / sigma


def parse_effect(text: str) -> Effect:
    """``"0.02"`` (metric units), ``"2σ"``, ``"2sigma"`` or ``"2 sigma"`` (sigmas); a positive
    finite size, else one line saying how to write it."""
    how = ("write the effect as a positive number in loss units (--effect 0.02) or in sigmas "
           "of the noise floor (--effect 2σ or --effect 2sigma)")
    s = str(text)
    m = _SIGMA_SUFFIX.match(s)
    num, unit = (m.group(1), "sigma") if m else (s, "metric") if _NUMBER.match(s) else ("", "")
    try:
        value = float(num)
    except ValueError:
        raise ModbenchError(f"--effect {text!r} is not an effect size; {how}") from None
    if not math.isfinite(value) or value <= 0:
        raise ModbenchError(f"--effect {text!r} must be positive and finite; {how}")
    return Effect(value, unit, s.strip())


def parse_baseline_seeds(text: str) -> str | int:
    """``--baseline-seeds``: ``same`` (the methods' n), ``sqrt`` (``ceil(n sqrt(m))``) or a
    whole number (at least the methods' n at every candidate)."""
    t = str(text).strip().lower()
    if t in ("same", "sqrt"):
        return t
    if t.isdigit() and int(t) >= MIN_SEEDS:
        return int(t)
    raise ModbenchError(f"--baseline-seeds {text!r} must be same, sqrt or a whole number of "
                        f"seeds, at least {MIN_SEEDS}")


def baseline_seeds(n: int, m: int, rule: str | int) -> int:
    """The baseline's seeds when every method has ``n``: ``same`` gives n; ``sqrt`` gives
    ``ceil(n sqrt(m))``, the square-root allocation that minimises the variance of m
    comparisons against one shared control for a given number of runs (Dunnett 1955, "A
    multiple comparison procedure for comparing several treatments with a control", JASA
    50); a number N gives ``max(N, n)``."""
    if rule == "same":
        return n
    if rule == "sqrt":
        return max(n, math.ceil(n * math.sqrt(m) - 1e-9))
    return max(int(rule), n)


def _crit(alpha: float, m: int, df: float) -> float:
    return float(_sps.t.isf(alpha / (2.0 * m), df))


def t_power(d: float, n: int, n_b: int, m: int, *, alpha: float = 0.05) -> float:
    """P(the pooled t calls a method truly ``d`` sigma better significant in its direction)
    at Bonferroni's two-sided level ``alpha / m``: the noncentral t's upper tail
    (``scipy.stats.nct``, noncentrality ``d / sqrt(1/n + 1/n_b)``, ``df = (n_b - 1) +
    m (n - 1)``), without the verdict's |Δ| guard."""
    _check_design(n, n_b, m)
    df = float((n_b - 1) + m * (n - 1))
    nc = d / math.sqrt(1.0 / n + 1.0 / n_b)
    p = float(_sps.nct.sf(_crit(alpha, m, df), df, nc))
    return p if math.isfinite(p) else 1.0  # scipy's far tail is NaN at a huge noncentrality


_NODES = 96
_GL_X, _GL_W = np.polynomial.legendre.leggauss(_NODES)
_GL_X = 0.5 * (_GL_X + 1.0)
_GL_W = 0.5 * _GL_W


def verdict_power(d: float, n: int, n_b: int, m: int, *, alpha: float = 0.05,
                  floor_sigmas: float = 1.0) -> float:
    """P(the verdict rule calls a method truly ``d`` sigma better an ``improver``): the
    pooled t at Bonferroni's level (see :func:`t_power`) *and* ``Δ > floor_sigmas * s_b``,
    ``s_b`` the baseline's estimated sigma. With ``U`` and ``W`` the baseline's and the other
    groups' sums of squares (chi-square on ``n_b - 1`` and ``m (n - 1)`` degrees of freedom,
    independent of each other and of ``Δ ~ N(d, 1/n + 1/n_b)``), the event is
    ``Δ > max(c k sqrt((U + W) / df), g sqrt(U / (n_b - 1)))``; its probability is integrated
    over the quantiles of U and W (Gauss-Legendre, the inner integral split where the first
    bound overtakes the second, below which the integrand is constant)."""
    _check_design(n, n_b, m)
    nu_b, nu_w = n_b - 1, m * (n - 1)
    df = float(nu_b + nu_w)
    k = math.sqrt(1.0 / n + 1.0 / n_b)
    ck = _crit(alpha, m, df) * k
    u = _sps.chi2.ppf(_GL_X, nu_b)  # outer nodes: U at its quantiles
    h = floor_sigmas * np.sqrt(u / nu_b)  # the guard's bound on Δ
    # W above which the test's bound exceeds the guard's: (c k)^2 (U + W) / df = h^2
    w_star = np.maximum(df * h * h / (ck * ck) - u, 0.0)
    r_star = _sps.chi2.cdf(w_star, nu_w)  # its quantile
    below = r_star * _sps.norm.sf((h - d) / k)  # W < w*: only the guard binds
    # W > w*: quantiles r in (r*, 1), mapped onto the Gauss-Legendre nodes
    r = r_star[:, None] + (1.0 - r_star[:, None]) * _GL_X[None, :]
    w = _sps.chi2.ppf(r, nu_w)
    tail = _sps.norm.sf((ck * np.sqrt((u[:, None] + w) / df) - d) / k)
    above = (1.0 - r_star) * (tail @ _GL_W)
    return float(np.clip(np.sum(_GL_W * (below + above)), 0.0, 1.0))


def _check_design(n: int, n_b: int, m: int) -> None:
    if n < 1 or n_b < 2 or m < 1:
        raise ValueError(f"a design needs n >= 1, n_b >= 2 and m >= 1 (got {n}, {n_b}, {m})")
    if (n_b - 1) + m * (n - 1) < 1:
        raise ValueError("the pooled test needs at least one degree of freedom")


def sigma_interval(sigma: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The chi-square interval for a sigma estimated from ``n`` normal seeds (``n - 1``
    degrees of freedom): how far the floor a plan rests on may be off."""
    nu = n - 1
    if nu < 1 or not math.isfinite(sigma):
        return (math.nan, math.nan)
    a = (1.0 - confidence) / 2.0
    return (sigma * math.sqrt(nu / float(_sps.chi2.isf(a, nu))),
            sigma * math.sqrt(nu / float(_sps.chi2.ppf(a, nu))))


@dataclass(frozen=True)
class PowerRow:
    """One candidate design: ``n`` seeds per method, ``n_b`` for the baseline."""

    n: int
    n_b: int
    df: int
    power: float  # the verdict's (test and |Δ| guard): verdict_power
    t_power: float  # the pooled t alone: t_power
    runs: int  # over every scale
    flops: float  # over every scale (NaN when not given)


@dataclass
class SeedPlan:
    """A plan: the design searched, each candidate's power and cost, and the choice."""

    effect_sigma: float
    effect_metric: float | None  # the effect in metric units (None without a floor)
    sigma: float | None  # the noise floor in metric units (None: not given)
    m: int  # methods compared with the baseline (the Holm family per scale)
    scales: int
    alpha: float
    correction: str
    floor_sigmas: float
    target: float
    baseline_rule: str | int
    rows: list[PowerRow]
    chosen: PowerRow | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chosen"] = asdict(self.chosen) if self.chosen else None
        return d


def plan_seeds(effect_sigma: float, m: int, *, alpha: float = 0.05, power: float = DEFAULT_POWER,
               floor_sigmas: float = 1.0, baseline: str | int = "same",
               flops_per_run: Mapping[str, Sequence[float]] | None = None,
               scales: int = 1, correction: str = "holm",
               sigma: float | None = None, effect_metric: float | None = None) -> SeedPlan:
    """Power at ``n = MIN_SEEDS .. MAX_SEEDS`` seeds per method (the baseline's by
    ``baseline``, :func:`baseline_seeds`) for a method ``effect_sigma`` sigma better among
    ``m``, and the smallest ``n`` reaching ``power``. ``flops_per_run``: ``{"baseline":
    [FLOPs of one baseline run per scale], "methods": [FLOPs of one run of each method at each
    scale]}`` gives each candidate's FLOPs; ``scales`` counts runs."""
    if m < 1:
        raise ModbenchError("the spec compares no method with its baseline: add methods under "
                            "'methods' to plan seeds for")
    if not 0.0 < power < 1.0:
        raise ModbenchError(f"--power must be a fraction between 0 and 1, got {power}")
    base_f = list((flops_per_run or {}).get("baseline", []))
    meth_f = list((flops_per_run or {}).get("methods", []))
    rows: list[PowerRow] = []
    for n in range(MIN_SEEDS, MAX_SEEDS + 1):
        n_b = baseline_seeds(n, m, baseline)
        flops = (n_b * sum(base_f) + n * sum(meth_f)) if flops_per_run else math.nan
        rows.append(PowerRow(
            n=n, n_b=n_b, df=(n_b - 1) + m * (n - 1),
            power=verdict_power(effect_sigma, n, n_b, m, alpha=alpha,
                                floor_sigmas=floor_sigmas),
            t_power=t_power(effect_sigma, n, n_b, m, alpha=alpha),
            runs=scales * (n_b + m * n), flops=float(flops)))
    chosen = next((r for r in rows if r.power >= power), None)
    plan = SeedPlan(effect_sigma, effect_metric, sigma, m, scales, alpha, correction,
                    floor_sigmas, power, baseline, rows, chosen)
    if effect_sigma <= floor_sigmas:
        plan.notes.append(
            f"the effect ({effect_sigma:.3g}σ) is not above the verdict's |Δ| guard "
            f"({floor_sigmas:g}σ of the baseline's estimated sigma): no number of seeds makes "
            "it reliably an improver")
    if chosen is None:
        plan.notes.append(f"{power:.0%} power is not reached with {MAX_SEEDS} seeds per group "
                          f"(power there {rows[-1].power:.1%}): plan a larger effect or a "
                          "smaller family")
    return plan
