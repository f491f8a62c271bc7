"""How many seeds a study needs (``modbench study plan``): the seeds per method and baseline
that give the verdict a chosen power to call a true effect an improver, at the spec's design
(:func:`modbench.analysis.power.plan_seeds`), with what they cost (FLOPs, CPU time,
GPU-hours). The noise floor is given, or read from a finished study (:func:`study_floor`).
Writes nothing. docs/statistics.md, "Planning seeds"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modbench.analysis import power as P
from modbench.analysis.results import (
    ALPHA,
    CORRECTION,
    FLOOR_SIGMAS,
    default_metric,
    metric_table,
)
from modbench.analysis.stats import sample_std
from modbench.errors import ModbenchError
from modbench.study.costs import Throughput, run_flops
from modbench.study.results import load_rows, load_spec_of
from modbench.study.spec import StudySpec, run_spec


@dataclass
class StudySeedPlan:
    """A seed plan for one spec: the plan (:class:`modbench.analysis.power.SeedPlan`), the
    methods it counts, the throughput and worker processes its costs assume, and each row's
    CPU core-seconds and GPU-hours."""

    spec: StudySpec
    methods: list[str]
    plan: P.SeedPlan
    rate: Throughput
    workers: int
    cpu_s: list[float]
    gpu_h: list[float]

    def to_json(self) -> dict[str, Any]:
        """``modbench study plan --json``."""
        s, p, rate = self.spec, self.plan, self.rate
        return {**p.to_dict(), "spec": s.name, "scales": s.scales, "methods": self.methods,
                "baseline": s.baseline, "cpu_flops_per_s": P.CPU_FLOPS_PER_S,
                "workers": self.workers, "gpu": rate.gpu, "gpu_flops_per_s": rate.flops_per_s,
                "cost": [{"n": r.n, "cpu_core_hours": c / 3600,
                          "cpu_wall_hours": c / 3600 / min(self.workers, r.runs),
                          "gpu_hours": g}
                         for r, c, g in zip(p.rows, self.cpu_s, self.gpu_h, strict=True)]}

    def format(self) -> str:
        """``modbench study plan``'s table and summary."""
        return format_seed_plan(self.spec.name, self.spec.scales, self.spec.baseline,
                                self.plan, self.cpu_s, self.gpu_h, self.workers, self.rate)


def check_plan_options(sigma: float | None, from_study: Path | None,
                       workers: int | None) -> None:
    """The noise floor given once and positive, and at least one worker, in one line each."""
    if sigma is not None and from_study is not None:
        raise ModbenchError("give the noise floor once: --sigma S or --from STUDY_FOLDER")
    if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
        raise ModbenchError(f"--sigma must be a positive std in metric units, got {sigma}")
    if workers is not None and workers < 1:
        raise ModbenchError(f"--workers must be at least 1, got {workers}")


def plan_study_seeds(spec: StudySpec, effect: str, *, sigma: float | None = None,
                     from_study: Path | None = None, power: float = 0.8,
                     baseline_seeds: str = "same", workers: int | None = None,
                     rate: Throughput) -> StudySeedPlan:
    """The seed plan for ``spec`` to find ``effect`` (metric units, or sigmas: ``2σ``) with
    ``power``: the study's verdict rule (Holm over its methods at :data:`ALPHA`, pooled t,
    |Δ| > :data:`FLOOR_SIGMAS` σ), ``baseline_seeds`` (same, sqrt, or a number), the noise
    floor ``sigma`` or that of the finished study ``from_study``, and each candidate n's cost
    at ``rate`` and on ``workers`` CPU processes (None: one per usable core, at most 8)."""
    eff = P.parse_effect(effect)
    rule = P.parse_baseline_seeds(baseline_seeds)
    check_plan_options(sigma, from_study, workers)
    floor_note = ""
    if from_study is not None:
        sigma, floor_note = study_floor(from_study)
    d = eff.sigmas(sigma)
    s = spec
    methods = [m for m in dict.fromkeys(s.methods) if m != s.baseline]
    base_f = [run_flops(run_spec(s, sc, s.baseline, 0).config) for sc in s.scales]
    meth_f = [run_flops(run_spec(s, sc, m, 0).config) for sc in s.scales for m in methods]
    p = P.plan_seeds(d, len(methods), alpha=ALPHA, power=power, floor_sigmas=FLOOR_SIGMAS,
                     baseline=rule, flops_per_run={"baseline": base_f, "methods": meth_f},
                     scales=len(s.scales), correction=CORRECTION, sigma=sigma,
                     effect_metric=d * sigma if sigma is not None else None)
    if from_study is not None:
        p.notes.append(floor_note)
    if workers is None:
        from modbench.runtime.device import usable_cpus

        workers = min(usable_cpus(), 8)
    return StudySeedPlan(s, methods, p, rate, workers,
                         [r.flops / P.CPU_FLOPS_PER_S for r in p.rows],
                         [r.flops / rate.flops_per_s / 3600 for r in p.rows])


def study_floor(folder: Path) -> tuple[float, str]:
    """The noise floor of a finished study: its baseline's seed std (ddof 1) at its first
    scale (the spec's order, else by name) on its decision metric, and a line saying so."""
    rows = load_rows(folder)
    spec = load_spec_of(folder) or StudySpec()
    metric = default_metric(spec.evaluation.primary, spec.evaluation.tasks)
    here = {r.scale for r in rows if r.method == spec.baseline and r.state == "done"}
    order = [sc for sc in spec.scales if sc in here] + sorted(here - set(spec.scales))
    if not order:
        raise ModbenchError(f"{folder} has no finished run of its baseline '{spec.baseline}': "
                            "no noise floor to read; give --sigma S")
    scale = order[0]
    values = list(metric_table(rows, scale, metric, spec.baseline)[spec.baseline].values())
    finite = [v for v in values if v is not None and v == v and abs(v) != float("inf")]
    sd = sample_std(finite)
    if len(finite) < 2 or not sd > 0:
        raise ModbenchError(f"{folder}: the baseline has {len(finite)} finished seed(s) with "
                            f"a {metric} at {scale} and σ = {sd:.3g}: no noise floor; give "
                            "--sigma S")
    lo, hi = P.sigma_interval(sd, len(finite))
    return sd, (f"σ = {sd:.4g} ({metric}) from {folder}'s {len(finite)} baseline seeds at "
                f"{scale}; from {len(finite)} seeds its 95 % interval is {lo:.3g} to {hi:.3g}, "
                "so the planned seeds are as uncertain as that floor")


def format_seed_plan(name: str, scales: list[str], baseline: str, p: P.SeedPlan,
                       cpu_s: list[float], gpu_h: list[float], workers: int,
                       rate: Throughput) -> str:
    eff = f"{p.effect_sigma:.3g}σ" + (f" = {p.effect_metric:.4g} (σ = {p.sigma:.4g})"
                                      if p.effect_metric is not None else "")
    b = {"same": "the same n", "sqrt": "ceil(n x sqrt(methods))"}.get(
        str(p.baseline_rule), f"max({p.baseline_rule}, n)")
    lines = [f"power plan for {name}: a method truly {eff} better, called an improver",
             f"design     {p.m} methods against {baseline} at {len(scales)} scale(s) "
             f"({', '.join(scales)}); baseline seeds: {b}",
             f"test       pooled t, df = (n_b - 1) + {p.m} (n - 1); Holm over {p.m} at α "
             f"{p.alpha:g}, bounded by Bonferroni (α/{p.m}); and |Δ| > {p.floor_sigmas:g}σ",
             "",
             f"{'n':>3} {'n_b':>4} {'df':>4} {'power':>7} {'(t alone)':>9} {'runs':>5} "
             f"{'FLOPs':>9} {'CPU h':>8} {'GPU-h':>8}"]
    for r, c, g in zip(p.rows, cpu_s, gpu_h, strict=True):
        mark = "  <- " + f"{p.target:.0%}" if r is p.chosen else ""
        lines.append(f"{r.n:>3} {r.n_b:>4} {r.df:>4} {r.power:>7.1%} {r.t_power:>9.1%} "
                     f"{r.runs:>5} {r.flops:>9.3g} {c / 3600:>8.3g} {g:>8.3g}{mark}")
    lines.append("")
    if p.chosen is not None:
        i = p.rows.index(p.chosen)
        c = p.chosen
        wall = cpu_s[i] / min(workers, c.runs)
        lines.append(f"seeds: {c.n} per method and {c.n_b} for the baseline give "
                     f"{c.power:.1%} power ({c.runs} runs, {c.flops:.3g} FLOPs)")
        lines.append(f"CPU time: {cpu_s[i] / 3600:.3g} core-hours, about "
                     f"{duration(wall)} wall with {workers} worker process(es); GPU: "
                     f"{gpu_h[i]:.3g} GPU-hours on {rate.gpu} at {rate.flops_per_s / 1e12:.1f} "
                     f"TFLOP/s (MFU {rate.mfu:.2f}{', assumed' if rate.mfu_assumed else ''})")
    else:
        lines.append(f"seeds: no n up to {p.rows[-1].n} reaches {p.target:.0%} power")
    lines.append(f"CPU rate: {P.CPU_FLOPS_PER_S / 1e9:.1f} GFLOP/s per worker process, assumed: "
                 "the built-in study's measured end-to-end rate (BENCHMARKS.md); other shapes "
                 "run at other rates")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.3g} days"
