"""The learning-rate profile's successive-halving rule (``lr_profile.halving``) replayed on
recorded profiles: how often it drops a point that would have finished near the best, what
it saves, and how far it moves the sensitivities and their verdicts.

    python benchmarks/halving_false_drops.py STUDY [STUDY ...] [--window 5]

Each STUDY is a finished study folder with an unhalved ``lr_profile/`` (every point trained
to the end, validation losses logged along the way; e.g. ``modbench study run lr-profile-cpu``).
For every rule (rungs x margins, below), every method, every ``--window`` contiguous grid
points (a 5-point profile cut from a longer grid) and every seed set (all the profile's seeds,
and each 3-seed subset), the rule is replayed exactly as the stage applies it
(:func:`modbench.analysis.profile.halving_drops` at :func:`modbench.study.stages.halving.
rung_step`'s steps, on the losses the runs logged there), then judged against the runs' own
final losses:

* **false drop**: a dropped point whose final mean loss was within the profile's tolerance of
  the window's best point (the best included): a point the profile's best rate, best loss or
  basin needed. Rate = false drops / near-best points, with its Clopper-Pearson 95 % upper
  bound (the trials share curves, windows and seeds, so the bound is optimistic; the distinct
  (method, rate) near-best points ever dropped are counted beside it);
* **cost**: the steps trained (dropped points to their rung, stalled or diverged runs to their
  stop, the rest to the end) over the frozen study's at the same seeds (one point), so an
  unhalved 5-point profile costs at most 5;
* **sensitivity**: each method's Wortsman sensitivity with the dropped points at their loss
  when dropped (what the profile then reports, an upper bound) against the full profile's, and
  whether the sensitivity verdict against the baseline (the study's rule) stays the same.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy import stats as sps

from modbench.analysis.profile import halving_drops, method_profile, sensitivity_verdicts
from modbench.study.stages.halving import rung_step

RULES = [((0.2,), m) for m in (0.05, 0.1, 0.2)] + [((0.2, 0.4), m) for m in (0.05, 0.1, 0.2)] \
    + [((0.1, 0.2, 0.4), m) for m in (0.1,)]
TOLERANCE = 0.02


def load(study: Path) -> tuple[dict[str, dict[float, dict[int, dict[str, Any]]]], str]:
    """method -> rate -> seed -> {vals: {step: loss}, final, steps, planned, eval_every}."""
    root = study / "lr_profile"
    db = sqlite3.connect(root / "index.sqlite")
    db.row_factory = sqlite3.Row
    out: dict[str, dict[float, dict[int, dict[str, Any]]]] = defaultdict(dict)
    for r in db.execute("SELECT key, method, seed FROM runs WHERE state='done'"):
        run = root / "runs" / r["key"]
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        summary = json.loads((run / "summary.json").read_text())
        if summary["status"] == "dropped":
            raise SystemExit(f"{study} was run with halving: replay needs an unhalved profile")
        vals = {}
        for line in (run / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "val":
                vals[int(rec["step"])] = rec["val_loss"]
        out[r["method"]].setdefault(float(cfg["recipe"]["lr"]), {})[int(r["seed"])] = {
            "vals": vals, "steps": summary["steps"], "planned": summary["steps_planned"],
            "final": summary["final_val_loss"] if summary["status"] == "completed" else None,
            "eval_every": cfg["train"]["eval_every"]}
    spec = yaml.safe_load((study / "spec.yaml").read_text())
    return dict(out), spec["baseline"]


def replay(points: list[dict[int, dict[str, Any]]], seeds: tuple[int, ...],
           rule: tuple[tuple[float, ...], float]) -> dict[int, int]:
    """The points the rule drops (index -> the step), as the stage decides them."""
    at, margin = rule
    dropped: dict[int, int] = {}
    for fraction in at:
        any_run = points[0][seeds[0]]
        step = rung_step(fraction, any_run["planned"], any_run["eval_every"])
        if step is None:
            continue
        losses: list[dict[int, float | None] | None] = []
        for i, p in enumerate(points):
            ended = any(p[s]["final"] is None and p[s]["steps"] < step for s in seeds)
            losses.append(None if i in dropped or ended else
                          {s: p[s]["vals"].get(step) for s in seeds})
        for d in halving_drops(losses, margin):
            dropped[d.point] = step
    return dropped


def mean_final(point: dict[int, dict[str, Any]], seeds: tuple[int, ...]) -> float | None:
    v = [point[s]["final"] for s in seeds]
    return None if any(x is None for x in v) else float(np.mean(v))


def profile_of(rates: list[float], points: list[dict[int, dict[str, Any]]],
               seeds: tuple[int, ...], dropped: dict[int, int]) -> Any:
    table = {r: {s: p[s]["final"] for s in seeds} for r, p in zip(rates, points, strict=True)}
    cut = {rates[i]: {s: points[i][s]["vals"][step] for s in seeds}
           for i, step in dropped.items()}
    init = {s: points[0][s]["vals"][0] for s in seeds}
    return method_profile("m", table, init, tolerance=TOLERANCE, n_resamples=10,
                          dropped=cut or None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", nargs="+", type=Path)
    ap.add_argument("--window", type=int, default=5)
    args = ap.parse_args()
    data = [load(s) for s in args.studies]
    print(f"studies: {', '.join(str(s) for s in args.studies)}; {args.window}-point windows; "
          f"near-best: final mean within {TOLERANCE} of the window's best\n")
    print("| rungs | margin | near-best points (distinct) | false drops | rate [95 % upper] | "
          "distinct near-best dropped | points dropped | cost (frozen = 1) | max sensitivity shift "
          "| sensitivity verdicts unchanged |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for rule in RULES:
        good = false = dropped_n = points_n = 0
        cost: list[float] = []
        distinct: set[tuple[str, str, float]] = set()
        near: set[tuple[str, str, float]] = set()
        shifts: list[float] = []
        same = total = 0
        for (study, baseline), name in zip(data, args.studies, strict=True):
            n_rates = min(len(v) for v in study.values())
            all_seeds = tuple(sorted(next(iter(next(iter(study.values())).values()))))
            seed_sets = [all_seeds] + [tuple(c) for c in itertools.combinations(all_seeds, 3)]
            for w0 in range(n_rates - args.window + 1):
                for seeds in seed_sets:
                    per_seed: dict[str, dict[str, dict[int, float | None]]] = {"full": {},
                                                                                "cut": {}}
                    for method, by_rate in study.items():
                        rates = sorted(by_rate)[w0:w0 + args.window]
                        points = [by_rate[r] for r in rates]
                        cut = replay(points, seeds, rule)
                        finals = [mean_final(p, seeds) for p in points]
                        ok = [f for f in finals if f is not None]
                        best = min(ok) if ok else math.inf
                        for i, f in enumerate(finals):
                            if f is not None and f <= best + TOLERANCE:
                                good += 1
                                near.add((str(name), method, rates[i]))
                                if i in cut:
                                    false += 1
                                    distinct.add((str(name), method, rates[i]))
                        dropped_n += len(cut)
                        points_n += len(points)
                        steps = sum(cut.get(i, min(p[s]["steps"] for s in seeds))
                                    for i, p in enumerate(points))
                        cost.append(steps / points[0][seeds[0]]["planned"])
                        full = profile_of(rates, points, seeds, {})
                        halved = profile_of(rates, points, seeds, cut)
                        if math.isfinite(full.sensitivity) and math.isfinite(halved.sensitivity):
                            shifts.append(halved.sensitivity - full.sensitivity)
                        for which, prof in (("full", full), ("cut", halved)):
                            per_seed[which][method] = {
                                s: (v if math.isfinite(v) else None)
                                for s, v in prof.seed_sensitivities.items()}
                    if len(seeds) >= 3 and baseline in per_seed["full"]:
                        a = {v.method: v.verdict
                             for v in sensitivity_verdicts(per_seed["full"], baseline)}
                        b = {v.method: v.verdict
                             for v in sensitivity_verdicts(per_seed["cut"], baseline)}
                        same += sum(a[m] == b.get(m) for m in a if m != baseline)
                        total += sum(1 for m in a if m != baseline)
        upper = sps.beta.ppf(0.95, false + 1, good - false) if good > false else 1.0
        print(f"| {', '.join(f'{a:g}' for a in rule[0])} | {rule[1]:g} | {good} ({len(near)}) "
              f"| {false} | "
              f"{false / good:.2%} [{upper:.2%}] | {len(distinct)} | {dropped_n} of "
              f"{points_n} | {np.mean(cost):.2f} (max {np.max(cost):.2f}) | "
              f"{np.max(np.abs(shifts)):.3f} (mean {np.mean(shifts):+.3f}) | "
              f"{same} of {total} |")


if __name__ == "__main__":
    main()
