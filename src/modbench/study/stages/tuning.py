"""The tuning and tuned stages: tuned versus frozen verdicts, a spec's ``tuning`` block
(docs/studies.md, "Tuned versus frozen"; docs/statistics.md).

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
from pathlib import Path
from typing import Any

from modbench.analysis.results import (
    RunRow,
    StudyResults,
    compare_scales,
    comparisons_json,
    default_metric,
    higher_is_better,
    metric_table,
    rule_record,
)
from modbench.fsutil import atomic_write_text
from modbench.report.blocks import Block
from modbench.report.tuning import (
    BEST_FILE,
    TUNED_DIR,
    TUNING_DIR,
    VERDICTS_FILE,
    tuning_section,
)
from modbench.study.costs import StagePlan, Throughput, done_keys, run_flops
from modbench.study.results import load_rows
from modbench.study.spec import (
    RunSpec,
    Seeds,
    StudySpec,
    expand,
    run_spec,
    tuning_grid,
    unique_runs,
    verdict_seeds,
)
from modbench.study.stages.base import (
    RunSettings,
    Session,
    Stage,
    StatusPart,
    hours,
    register,
)


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
    they read; last, ``"rule"``, the verdict rule that produced them, as in ``results.json``
    (:func:`modbench.analysis.results.rule_record`). Rows of other runs (at a value an earlier
    tuning chose) are left out."""
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
            "comparisons": comparisons_json(comparisons), "rule": rule_record()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


class TuningStage(Stage):
    """Stage 1: every scale, method (the baseline included), grid value and tuning seed, one
    run, in ``STUDY/tuning/``; then each (scale, method)'s best value, ``best.json``."""

    name = "tuning"
    order = 20

    @classmethod
    def applies(cls, spec: StudySpec, out: Path, settings: RunSettings) -> bool:
        return spec.tuning is not None

    @property
    def folder(self) -> Path:
        return self.out / TUNING_DIR

    def check(self) -> None:
        tuning_runs(self.spec)  # every grid value's runs resolve, before anything is written

    def runs(self) -> list[RunSpec]:
        return [r for _, r in tuning_runs(self.spec)]

    def run(self, session: Session) -> None:
        t = self.spec.tuning
        assert t is not None
        runs = tuning_runs(self.spec)
        session.execute(_stage_spec(self.spec, TUNING_DIR, Seeds(list(t.seeds), [], [])),
                        self.folder, [r for _, r in runs])
        _write_json(self.folder / BEST_FILE,
                    choose_best(self.spec, runs, load_rows(self.folder)))

    def plan(self, rate: Throughput | None) -> StagePlan:
        t = self.spec.tuning
        assert t is not None
        runs = self.runs()
        done = done_keys(self.folder)
        flops = sum(run_flops(r.config) for r in runs if r.key not in done)
        seeds = ", ".join(str(x) for x in t.seeds)
        return StagePlan(self.name, self.folder, len(runs),
                         sum(r.key in done for r in runs), flops,
                         f"every method and the baseline at each of the "
                         f"{len(tuning_grid(t.key, t.grid))} values of {t.key}, on tuning "
                         f"seed(s) {seeds}", gpu_hours=hours(flops, rate))

    def status(self) -> list[StatusPart]:
        assert self.spec.tuning is not None
        return self.folder_status(self.spec.tuning.key)


class TunedStage(Stage):
    """Stage 2: every method at its best value on the verdict seeds, in ``STUDY/tuned/``,
    judged against the baseline at its best value: ``verdicts.json``, and the report's
    "Frozen versus tuned" section."""

    name = "tuned"
    order = 30

    @classmethod
    def applies(cls, spec: StudySpec, out: Path, settings: RunSettings) -> bool:
        return spec.tuning is not None

    @property
    def folder(self) -> Path:
        return self.out / TUNED_DIR

    def best(self) -> dict[str, Any] | None:
        """The tuning stage's ``best.json`` once every tuning run is done (None before, or
        when it cannot be read: as if not chosen)."""
        tuning = self.out / TUNING_DIR
        path = tuning / BEST_FILE
        first = [r for _, r in tuning_runs(self.spec)]
        if not path.is_file() or not {r.key for r in first} <= done_keys(tuning):
            return None
        try:
            best: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
            tuned_runs(self.spec, best)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return best

    def runs(self) -> list[RunSpec] | None:
        best = self.best()
        return tuned_runs(self.spec, best) if best is not None else None

    def run(self, session: Session) -> None:
        best = json.loads((self.out / TUNING_DIR / BEST_FILE).read_text(encoding="utf-8"))
        runs = tuned_runs(self.spec, best)
        session.execute(_stage_spec(self.spec, TUNED_DIR, self.spec.seeds), self.folder, runs)
        _write_json(self.folder / VERDICTS_FILE,
                    tuned_verdicts(self.spec, load_rows(self.folder), runs))

    def plan(self, rate: Throughput | None) -> StagePlan:
        """Its runs once the tuning stage has chosen every value; before, one run per verdict
        run, costed at the grid value whose run costs most: an upper bound where the key
        changes the FLOPs (such as ``train.steps``), exact for ``recipe.lr``."""
        t = self.spec.tuning
        assert t is not None
        runs = self.runs()
        if runs is not None:
            done = done_keys(self.folder)
            flops = sum(run_flops(r.config) for r in runs if r.key not in done)
            return StagePlan(self.name, self.folder, len(runs),
                             sum(r.key in done for r in runs), flops,
                             f"every method at its best {t.key} (best.json), on the verdict "
                             "seeds", gpu_hours=hours(flops, rate))
        verdict = expand(self.spec)
        variants = [with_value(self.spec, v) for v in tuning_grid(t.key, t.grid)]
        costs = [[run_flops(run_spec(v, r.scale, r.method, r.seed).config) for v in variants]
                 for r in verdict]
        flops = sum(max(c) for c in costs)
        return StagePlan(self.name, self.folder, len(verdict), 0, flops,
                         f"every method at its best {t.key}, chosen by the tuning stage, on "
                         "the verdict seeds", known=False, gpu_hours=hours(flops, rate),
                         upper_bound=any(min(c) != max(c) for c in costs))

    def status(self) -> list[StatusPart]:
        assert self.spec.tuning is not None
        return self.folder_status(self.spec.tuning.key)

    def report(self, results: StudyResults, out: Path) -> list[Block]:
        return tuning_section(results, out)


register(TuningStage)
register(TunedStage)
