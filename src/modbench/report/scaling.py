"""The report's "Scaling along the ladder" section, for a study with 3 or more scales
(:mod:`modbench.analysis.scaling`; docs/statistics.md, "Scaling fits"): each method's fit of
the final loss against non-embedding parameters and training FLOPs with bootstrap intervals,
the gain over the baseline at every rung and its trend, the effective compute multiplier, one
log-log figure with every method's points and curve, the leave-last-out prediction of the
largest rung and how it did; ``scaling.json`` beside the report holds the same numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from modbench.analysis.results import StudyResults
from modbench.analysis.scaling import (
    CONFIDENCE,
    MethodScaling,
    Point,
    ScalingAnalysis,
    analyse,
    points_from_results,
)
from modbench.fsutil import atomic_write_text
from modbench.report.blocks import Block
from modbench.report.blocks import fmt as _fmt

SCALING_JSON = "scaling.json"
FIGURE = "scaling_loglog.png"


def _ci(lo_hi: tuple[float, float], digits: int = 3) -> str:
    lo, hi = lo_hi
    if math.isnan(lo) or math.isnan(hi):
        return "–"
    return f"[{_g(lo, digits)}, {_g(hi, digits)}]"


def _g(v: float, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if math.isinf(v) or abs(v) >= 1e299:
        return "∞" if v > 0 else "−∞"
    return f"{v:.{digits}g}"


def _with_ci(v: float, ci: tuple[float, float], digits: int = 3) -> str:
    return f"{_g(v, digits)} {_ci(ci, digits)}" if not math.isnan(v) else "–"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


_TREND_WORDS = {
    "grows": "the gain over the baseline **grows** with scale",
    "shrinks": "the gain over the baseline **shrinks** with scale",
    "crosses zero": "the gap **crosses zero** within the ladder",
    "flat": "no trend of the gap with scale is shown at this budget",
}


def scaling_section(results: StudyResults, out: Path) -> list[Block]:
    """The section's blocks (none for a study with fewer than 3 scales where the baseline
    finished), the figure and ``scaling.json`` into ``out``."""
    points = points_from_results(results)
    an = analyse(points, results.baseline)
    if an is None:
        return []
    blocks = [Block("h2", "Scaling along the ladder"), Block("p", _intro(an))]
    blocks += _fit_table(an)
    blocks += _gap_table(an)
    blocks.append(Block("img", "Final validation loss against non-embedding parameters "
                               "(log–log): every run (small), each rung's mean (large), each "
                               "method's fitted curve", path=_figure(an, points, out)))
    blocks += _prediction(an)
    atomic_write_text(out / SCALING_JSON, json.dumps(to_dict(an), indent=1) + "\n")
    return blocks


def _intro(an: ScalingAnalysis) -> str:
    return (f"{len(an.scales)} scales ({', '.join(f'`{s}`' for s in an.scales)}), ordered by "
            "the baseline's non-embedding parameters N. Each method's mean final validation "
            "loss per rung is fitted to L = E + A·N^(−α) (and against training FLOPs C) by "
            "least squares (scipy's curve_fit); where that fit is ill-posed the power law "
            "without E, L = A·N^(−α), is fitted instead (form column). Intervals are 95 % "
            f"percentile intervals from {an.boot} bootstrap resamples of each rung's seeds. "
            "The gain is the baseline's loss less the method's (positive: the method is "
            "better); its trend is the slope of the gain against log10 N. The compute "
            "multiplier is the training compute the baseline's fitted loss-vs-FLOPs curve "
            "needs to reach the method's loss at the largest rung, over the method's own "
            "(above 1: the method is worth that much more compute). docs/statistics.md, "
            "\"Scaling fits\".")


def _fit_table(an: ScalingAnalysis) -> list[Block]:
    rows = []
    for m, ms in an.methods.items():
        f, fc = ms.fit_n, ms.fit_c
        rows.append([
            f"`{m}`", f.form if f else "–",
            _with_ci(f.alpha, ms.alpha_ci) if f else "–",
            (_with_ci(f.E, ms.E_ci) if f and not f.fallback else "–"),
            _g(f.A) if f else "–",
            _with_ci(fc.alpha, ms.alpha_c_ci) if fc else "–",
            "(baseline)" if m == an.baseline else ms.trend or "–",
            _with_ci(ms.slope, ms.slope_ci) if m != an.baseline else "–",
            _with_ci(ms.multiplier, ms.multiplier_ci) if m != an.baseline else "1",
        ])
    blocks = [Block("table", header=["method", "form", "α vs N [CI]", "E [CI]", "A",
                                     "α vs FLOPs [CI]", "gain trend",
                                     "gain per decade of N [CI]", "compute multiplier [CI]"],
                    rows=rows)]
    notes = [f"`{m}`: the full form was ill-posed ({ms.fit_n.why}); the power law without E "
             "is shown" for m, ms in an.methods.items()
             if ms.fit_n is not None and ms.fit_n.fallback and ms.fit_n.why]
    items = [f"`{m}`: {_TREND_WORDS[ms.trend]} (gain {_gains(ms)}; slope "
             f"{_with_ci(ms.slope, ms.slope_ci)} per decade of N)"
             for m, ms in an.methods.items() if ms.trend]
    items += [f"`{m}`: no fit and no trend: its seeds trained at {len(ms.rungs)} of "
              f"{len(an.scales)} rungs (at the others every seed diverged or stalled; a "
              "fit needs 3, a trend 2)" for m, ms in an.methods.items()
              if m != an.baseline and not ms.trend and ms.fit_n is None]
    if items:
        blocks.append(Block("ul", items=items + notes))
    elif notes:
        blocks.append(Block("ul", items=notes))
    return blocks


def _gains(ms: MethodScaling) -> str:
    shown = [r for r in ms.rungs if not math.isnan(r.gain)]
    if not shown:
        return "–"
    first, last = shown[0], shown[-1]
    return (f"{_with_ci(first.gain, first.gain_ci)} at {_count(first.params)} to "
            f"{_with_ci(last.gain, last.gain_ci)} at {_count(last.params)}")


def _gap_table(an: ScalingAnalysis) -> list[Block]:
    base = an.methods[an.baseline]
    n_of = {r.scale: r.params for r in base.rungs}
    header = ["method", *[f"`{s}` (N {_count(n_of[s])})" for s in an.scales]]
    rows = [["`" + an.baseline + "` (loss)",
             *[_fmt(next(r.mean for r in base.rungs if r.scale == s)) for s in an.scales]]]
    for m, ms in an.methods.items():
        if m == an.baseline:
            continue
        by = {r.scale: r for r in ms.rungs}
        rows.append([f"`{m}` (gain)", *[_with_ci(by[s].gain, by[s].gain_ci)
                                        if s in by else "–" for s in an.scales]])
    return [Block("p", "Gain over the baseline at each rung (baseline loss − method loss, "
                       "mean over seeds, 95 % bootstrap interval):"),
            Block("table", header=header, rows=rows)]


def _prediction(an: ScalingAnalysis) -> list[Block]:
    rows = []
    for m, ms in an.methods.items():
        p = ms.prediction
        if p is None:
            continue
        rows.append([f"`{m}`", f"`{p.scale}`", _with_ci(p.loss, p.loss_pi, 4),
                     _g(p.observed, 4), _g(p.observed - p.loss, 3), _g(p.loss_z, 2),
                     _with_ci(p.gain, p.gain_pi) if m != an.baseline else "–",
                     _g(p.observed_gain) if m != an.baseline else "–",
                     _g(p.gain_z, 2) if m != an.baseline else "–",
                     "A·N^(−α)" if p.fallback else "E + A·N^(−α)"])
    if not rows:
        return [Block("h2", "Leave-last-out prediction"),
                Block("p", "Not enough rungs below the largest to fit (a method needs 3 "
                           "rungs in all).")]
    inside = [r for r in rows if r[5] not in ("–",) and abs(float(r[5].replace("−", "-")))
              <= 1]
    return [
        Block("h2", "Leave-last-out prediction"),
        Block("p", f"Each method's curve fitted to every rung but the largest, extrapolated "
                   f"to the largest rung's N and compared with what it measured. The "
                   f"{CONFIDENCE:.0%} prediction interval holds the bootstrap spread of the "
                   "extrapolation and the seed noise of the rung's mean; z is the error in "
                   "units of the interval's half-width (|z| ≤ 1: inside the interval). "
                   f"{len(inside)} of {len(rows)} measured losses fell inside their "
                   "interval."),
        Block("table", header=["method", "largest rung", "predicted loss [PI]", "measured",
                               "error", "z", "predicted gain [PI]", "measured gain",
                               "z (gain)", "form"], rows=rows)]


def _figure(an: ScalingAnalysis, points: list[Point], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs_all = [r.params for ms in an.methods.values() for r in ms.rungs]
    lo, hi = min(xs_all), max(xs_all)
    grid = np.exp(np.linspace(math.log(lo / 1.3), math.log(hi * 1.3), 100))
    for i, (m, ms) in enumerate(an.methods.items()):
        c = colours[i % len(colours)]
        pts = [p for p in points if p.method == m]
        ax.scatter([p.params for p in pts], [p.loss for p in pts], s=8, color=c, alpha=0.4)
        ax.scatter([r.params for r in ms.rungs], [r.mean for r in ms.rungs], s=30, color=c,
                   label=m + (f" (α={ms.fit_n.alpha:.2g})" if ms.fit_n else ""))
        if ms.fit_n is not None:
            ax.plot(grid, ms.fit_n(grid), color=c, linewidth=1.2,
                    linestyle="--" if ms.fit_n.fallback else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter  # plain loss values on the log axis

    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2f"))
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel("final validation loss")
    ax.set_title("loss against size (dashed: power law without E)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / FIGURE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _num(v: float) -> float | str | None:
    if v is None or math.isnan(v):
        return None
    return v if math.isfinite(v) and abs(v) < 1e299 else ("inf" if v > 0 else "-inf")


def to_dict(an: ScalingAnalysis) -> dict[str, Any]:
    """The analysis as plain JSON (NaN as null, infinities as strings)."""
    def fit(f: Any) -> dict[str, Any] | None:
        return None if f is None else {"form": f.form, "E": _num(f.E), "A": _num(f.A),
                                       "alpha": _num(f.alpha), "fallback": f.fallback,
                                       "why": f.why}

    def pair(t: tuple[float, float]) -> list[Any]:
        return [_num(t[0]), _num(t[1])]

    methods = {}
    for m, ms in an.methods.items():
        p = ms.prediction
        methods[m] = {
            "fit_params": fit(ms.fit_n), "fit_flops": fit(ms.fit_c),
            "alpha_ci": pair(ms.alpha_ci), "E_ci": pair(ms.E_ci),
            "alpha_flops_ci": pair(ms.alpha_c_ci), "trend": ms.trend,
            "slope_per_decade": _num(ms.slope), "slope_ci": pair(ms.slope_ci),
            "compute_multiplier": _num(ms.multiplier),
            "compute_multiplier_ci": pair(ms.multiplier_ci),
            "rungs": [{"scale": r.scale, "params": r.params, "flops": r.flops,
                       "mean_loss": r.mean, "seeds": r.seeds, "gain": _num(r.gain),
                       "gain_ci": pair(r.gain_ci)} for r in ms.rungs],
            "prediction": None if p is None else {
                "scale": p.scale, "params": p.params, "loss": _num(p.loss),
                "loss_pi": pair(p.loss_pi), "observed": _num(p.observed),
                "z": _num(p.loss_z), "gain": _num(p.gain), "gain_pi": pair(p.gain_pi),
                "observed_gain": _num(p.observed_gain), "gain_z": _num(p.gain_z),
                "fallback": p.fallback},
        }
    return {"baseline": an.baseline, "scales": an.scales, "bootstrap": an.boot,
            "confidence": CONFIDENCE, "methods": methods}
