"""Tuned versus frozen verdicts: a spec's ``tuning`` block (docs/studies.md, "Tuned versus
frozen"; docs/statistics.md).

A study with ``tuning: {key: recipe.lr, grid: [1e-3, 3e-3], seeds: [100]}`` runs in three
parts, each its own study folder with its own index and run folders, so no run of one is ever
a row of another:

* ``STUDY/`` — the frozen study: every method at the spec's own value of the key, on the
  verdict seeds (``seeds.default``, ``seeds.noise_floor``); its verdicts are the report's
  usual ones.
* ``STUDY/tuning/`` — stage 1: every scale, method (the baseline included), grid value and
  tuning seed, one run. The best value of a (scale, method) is the one with the fewest failed
  tuning runs (diverged, stalled, or not finished: a failure counts as the worst score), then
  the best mean primary metric over its tuning seeds; an exact tie goes to the frozen value,
  else to the earlier grid value. Written to ``STUDY/tuning/best.json``.
* ``STUDY/tuned/`` — stage 2: every method at its own best value on the verdict seeds, judged
  against the baseline at *its* best value by the same :func:`compare_scales` as the frozen
  study; written to ``STUDY/tuned/verdicts.json`` (with the seeds each verdict read).

The tuning seeds are disjoint from the verdict seeds (:func:`modbench.study.spec.check_spec`
refuses a spec otherwise), so the value a method is tuned to is chosen on runs that never
enter a verdict. A method whose best value is the frozen one is trained again in
``STUDY/tuned/`` (the same config and seed as its frozen run, so the same key and, on one
device, the same numbers): the tuned verdicts are read from that folder alone, never
assembled from two stores.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modbench.analysis.results import (
    RunRow,
    compare_scales,
    comparisons_json,
    default_metric,
    higher_is_better,
    metric_table,
)
from modbench.fsutil import atomic_write_text
from modbench.report.tuning import BEST_FILE, TUNED_DIR, TUNING_DIR, VERDICTS_FILE
from modbench.study.results import load_rows
from modbench.study.spec import (
    RunSpec,
    Seeds,
    StudySpec,
    run_spec,
    tuning_grid,
    unique_runs,
    verdict_seeds,
)

#: runs a stage: (sub-spec, its folder, its runs) -> the runner's counts
Stage = Callable[[StudySpec, Path, list[RunSpec]], dict[str, Any]]


def config_value(cfg: Any, key: str) -> Any:
    """The value of the dotted config ``key`` in a run config."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def with_value(spec: StudySpec, value: Any) -> StudySpec:
    """``spec`` with its tuning key set to ``value`` in every run (one more override)."""
    assert spec.tuning is not None
    return dataclasses.replace(spec, overrides=[*spec.overrides,
                                                f"{spec.tuning.key}={json.dumps(value)}"])


def _methods(spec: StudySpec) -> list[str]:
    return [spec.baseline, *[m for m in spec.methods if m != spec.baseline]]


def _stage_spec(spec: StudySpec, suffix: str, seeds: Seeds) -> StudySpec:
    """A stage's own spec (its folder's ``spec.yaml``): no tuning block, no claim, no
    diagnostics, the stage's seeds."""
    ev = dataclasses.replace(spec.evaluation, diagnostics=None)
    return dataclasses.replace(spec, name=f"{spec.name}-{suffix}", seeds=seeds, tuning=None,
                               claim=None, evaluation=ev)


def tuning_runs(spec: StudySpec) -> list[tuple[Any, RunSpec]]:
    """Stage 1's runs: (grid value, run) for every scale, method, grid value and tuning seed."""
    t = spec.tuning
    if t is None:
        return []
    out: list[tuple[Any, RunSpec]] = []
    for value in tuning_grid(t.key, t.grid):
        tuned = with_value(spec, value)
        for scale in spec.scales:
            for method in _methods(spec):
                out += [(value, run_spec(tuned, scale, method, int(s))) for s in t.seeds]
    return out


def choose_best(spec: StudySpec, runs: list[tuple[Any, RunSpec]],
                rows: list[RunRow]) -> dict[str, Any]:
    """``best.json``'s content: per scale and method, each grid value's tuning runs (mean
    primary metric of the surviving ones, failures), the frozen value and the best value."""
    t = spec.tuning
    assert t is not None
    metric = default_metric(spec.evaluation.primary, spec.evaluation.tasks)
    sign = -1.0 if higher_is_better(metric) else 1.0
    by_key = {r.key: r for r in rows}
    grid = tuning_grid(t.key, t.grid)
    scales: dict[str, dict[str, Any]] = {}
    for scale in spec.scales:
        for method in _methods(spec):
            frozen = config_value(run_spec(spec, scale, method, int(t.seeds[0])).config, t.key)
            tried = []
            for value in grid:
                here = [r for v, r in runs if v == value and r.scale == scale
                        and r.method == method]
                scores = []
                for r in here:
                    row = by_key.get(r.key)
                    v = row.metric(metric) if row is not None and row.state == "done" else None
                    scores.append(v if v is not None and math.isfinite(v) else None)
                finite = [v for v in scores if v is not None]
                tried.append({"value": value, "keys": [r.key for r in here],
                              "seeds": [r.seed for r in here],
                              "mean": sum(finite) / len(finite) if finite else None,
                              "failed": len(scores) - len(finite)})

            def rank(e: dict[str, Any]) -> tuple[int, float]:
                return (e["failed"], sign * e["mean"] if e["mean"] is not None else math.inf)

            top = min(rank(e) for e in tried)
            winners = [e["value"] for e in tried if rank(e) == top]
            best = frozen if frozen in winners else winners[0]
            scales.setdefault(scale, {})[method] = {"frozen": frozen, "best": best,
                                                    "tried": tried}
    return {"key": t.key, "grid": grid, "seeds": list(t.seeds), "metric": metric,
            "higher_is_better": higher_is_better(metric), "scales": scales}


def tuned_runs(spec: StudySpec, best: dict[str, Any]) -> list[RunSpec]:
    """Stage 2's runs: every method at its best value on the spec's verdict seeds (the
    default seeds; the baseline and the anchors also the noise-floor seeds, as
    :func:`modbench.study.spec.expand`)."""
    return unique_runs(
        run_spec(with_value(spec, best["scales"][scale][method]["best"]), scale, method, seed)
        for scale in spec.scales for method in _methods(spec)
        for seed in verdict_seeds(spec, method))


def tuned_verdicts(spec: StudySpec, rows: list[RunRow], runs: list[RunSpec]) -> dict[str, Any]:
    """``verdicts.json``'s content: the tuned comparisons (:func:`compare_scales` on the tuned
    folder's rows of ``runs``, the frozen study's rule) and, per scale and method, the seeds
    they read. Rows of other runs (at a value an earlier tuning chose) are left out."""
    keys = {r.key for r in runs}
    rows = [r for r in rows if r.key in keys]
    metric = default_metric(spec.evaluation.primary, spec.evaluation.tasks)
    comparisons = compare_scales(rows, spec.baseline, metric, list(spec.seeds.anchors),
                                 looks={})
    seeds = {scale: {m: sorted(s) for m, s in
                     metric_table(rows, scale, metric, spec.baseline).items()}
             for scale in comparisons}
    values = {scale: {r.method: config_value(r.config, spec.tuning.key) for r in runs
                      if r.scale == scale} for scale in spec.scales} if spec.tuning else {}
    return {"metric": metric, "seeds": seeds, "values": values,
            "comparisons": comparisons_json(comparisons)}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def run_tuning(spec: StudySpec, out: str | Path, stage: Stage) -> list[dict[str, Any]]:
    """Stages 1 and 2 of a tuned study in ``out`` (the frozen study's folder), each run by
    ``stage``; ``best.json`` and ``verdicts.json`` written after each. Returns the stages'
    counts."""
    t = spec.tuning
    if t is None:
        return []
    root = Path(out)
    runs = tuning_runs(spec)
    tuning_dir = root / TUNING_DIR
    counts = [stage(_stage_spec(spec, TUNING_DIR, Seeds(list(t.seeds), [], [])), tuning_dir,
                    [r for _, r in runs])]
    best = choose_best(spec, runs, load_rows(tuning_dir))
    _write_json(tuning_dir / BEST_FILE, best)
    tuned_dir = root / TUNED_DIR
    second = tuned_runs(spec, best)
    counts.append(stage(_stage_spec(spec, TUNED_DIR, spec.seeds), tuned_dir, second))
    _write_json(tuned_dir / VERDICTS_FILE, tuned_verdicts(spec, load_rows(tuned_dir), second))
    return counts
