"""The learning-rate profile stage (a spec's ``lr_profile`` block; docs/studies.md,
"Learning-rate profiles"; docs/statistics.md, "Learning-rate profiles").

Every method, the baseline included, is trained at every point of a grid of learning rates
(multipliers of each run's own ``recipe.lr``, or given rates) at every scale, on the
profile's seeds (and on ``select_seeds``, if given), into ``STUDY/lr_profile/``: a study
folder of its own, so no run of it is a row of another. A point whose run diverges or stalls
stops early (the trainer's divergence and stall stops). The point at multiplier 1 trains the
frozen study's configuration again (same config, same key, in its own folder).

From those runs it writes ``STUDY/lr_profile/profile.json``: per scale and method the loss
at each rate with its seed interval, the best rate and loss (bootstrap intervals over seeds),
the learning-rate sensitivity of Wortsman et al. 2023 (arXiv:2309.14322, §3.1), the width of
the near-best basin and the largest rate that trains on every seed
(:func:`modbench.analysis.profile.method_profile`); the study's verdict at every grid point;
the sensitivity verdict (the study's rule on the seeds' sensitivities,
:func:`modbench.analysis.profile.sensitivity_verdicts`); which methods' verdicts are
rate-dependent; and, with ``select_seeds``, the verdict at each method's own best rate,
chosen on the selection seeds (as the ``tuning`` stage chooses on its tuning seeds).

With ``halving``, the runs train in rungs and the points the rule finds clearly worse stop
early (:mod:`modbench.study.stages.halving`): ``profile.json`` records each decision, and the
steps trained against the steps planned.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any

from modbench.analysis.profile import method_profile, rate_dependent, sensitivity_verdicts
from modbench.analysis.results import (
    RunRow,
    StudyResults,
    compare_scales,
    comparisons_json,
    default_metric,
    metric_table,
    rule_record,
)
from modbench.fsutil import atomic_write_text
from modbench.report.blocks import Block
from modbench.report.profile import PROFILE_DIR, PROFILE_FILE, profile_section
from modbench.study.costs import StagePlan, Throughput, done_keys, run_flops
from modbench.study.results import load_rows
from modbench.study.spec import (
    LrProfileSpec,
    RunSpec,
    Seeds,
    StudySpec,
    halving_settings,
    run_spec,
)
from modbench.study.stages.base import (
    RunSettings,
    Session,
    Stage,
    StatusPart,
    hours,
    register,
)
from modbench.study.stages.halving import DROPPED, Halving, reopen_dropped, run_rungs
from modbench.study.store import Store

#: the loss the profile reads (the sensitivity is defined on the loss; the per-point verdicts
#: use the study's primary metric)
LOSS = "val_loss"


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of the profile: its grid point (index), rate, and the run."""

    index: int
    rate: float
    run: RunSpec


class LrProfileStage(Stage):
    name = "lr_profile"
    order = 40

    @classmethod
    def applies(cls, spec: StudySpec, out: Path, settings: RunSettings) -> bool:
        return spec.lr_profile is not None

    @property
    def folder(self) -> Path:
        return self.out / PROFILE_DIR

    @property
    def block(self) -> LrProfileSpec:
        assert self.spec.lr_profile is not None
        return self.spec.lr_profile

    @property
    def seeds(self) -> list[int]:
        """The profile's seeds (``lr_profile.seeds``, else ``seeds.default``)."""
        return list(self.block.seeds or self.spec.seeds.default)

    @property
    def methods(self) -> list[str]:
        return [self.spec.baseline, *[m for m in dict.fromkeys(self.spec.methods)
                                      if m != self.spec.baseline]]

    @property
    def halving(self) -> Halving | None:
        """The halving rule (None: every point trains to the end)."""
        if self.block.halving is None:
            return None
        settings = halving_settings(self.block.halving)  # None for `halving: false`
        return Halving.of(settings) if settings is not None else None

    def labels(self) -> list[str]:
        """Each grid point as the report names it: ×0.5, or the rate itself."""
        b = self.block
        if b.grid is not None:
            return [f"×{m:g}" for m in b.grid]
        assert b.rates is not None
        return [f"{r:g}" for r in b.rates]

    def rate(self, scale: str, method: str, index: int) -> float:
        """The rate of grid point ``index`` for ``method`` at ``scale``."""
        b = self.block
        if b.rates is not None:
            return float(b.rates[index])
        assert b.grid is not None
        key = (scale, method)
        if key not in self._base:  # the frozen rate of this scale and method
            self._base[key] = run_spec(self.spec, scale, method, self.seeds[0]).config.recipe.lr
        return float(self._base[key] * b.grid[index])

    @cached_property
    def _base(self) -> dict[tuple[str, str], float]:
        return {}

    @cached_property
    def points(self) -> list[Point]:
        """Every run of the profile: each grid point, scale, method and seed (the profile's,
        then the selection seeds)."""
        out: list[Point] = []
        n = len(self.labels())
        for scale in self.spec.scales:
            for method in self.methods:
                for i in range(n):
                    rate = self.rate(scale, method, i)
                    at = dataclasses.replace(self.spec, overrides=[
                        *self.spec.overrides, f"recipe.lr={json.dumps(rate)}"])
                    out += [Point(i, rate, run_spec(at, scale, method, seed))
                            for seed in [*self.seeds, *self.block.select_seeds]]
        return out

    def check(self) -> None:
        _ = self.points  # every point's run resolves, before anything is written

    def runs(self) -> list[RunSpec]:
        return [p.run for p in self.points]

    def stage_spec(self) -> StudySpec:
        """The profile folder's own spec (its ``spec.yaml``): its seeds, no later stage, no
        claim, no diagnostics."""
        ev = dataclasses.replace(self.spec.evaluation, diagnostics=None)
        return dataclasses.replace(
            self.spec, name=f"{self.spec.name}-{PROFILE_DIR}",
            seeds=Seeds(self.seeds, [], []), tuning=None, lr_profile=None, claim=None,
            evaluation=ev)

    def run(self, session: Session) -> None:
        spec, keys = self.stage_spec(), [p.run.key for p in self.points]
        decisions: list[dict[str, Any]] = []
        dropped = session.counts.get("dropped", 0)
        if self.halving is not None:
            decisions = run_rungs(self.points, self.seeds, self.labels(), self.halving, session,
                                  spec, self.folder)
        elif (self.folder / "index.sqlite").is_file():  # a rule no longer set: train them on
            reopen_dropped(Store(self.folder), keys)
        session.execute(spec, self.folder, self.runs())
        # the runs dropped now are done in the index, but not done before this run
        session.counts["already_done"] -= session.counts.get("dropped", 0) - dropped
        atomic_write_text(self.folder / PROFILE_FILE,
                          json.dumps(self.judge(load_rows(self.folder), decisions), indent=1,
                                     default=str) + "\n")

    # ------------------------------------------------------------------ judging

    def judge(self, rows: list[RunRow], decisions: list[dict[str, Any]] | None = None
              ) -> dict[str, Any]:
        """``profile.json``'s content from the profile folder's ``rows`` (and the halving
        rule's ``decisions``, :func:`~modbench.study.stages.halving.run_rungs`)."""
        by_key = {r.key: r for r in rows if r.status != DROPPED}
        dropped = {r.key: r for r in rows if r.status == DROPPED}
        metric = default_metric(self.spec.evaluation.primary, self.spec.evaluation.tasks)
        scales = {scale: self._judge_scale(scale, by_key, dropped, metric)
                  for scale in self.spec.scales}
        b = self.block
        out = {"metric": metric, "loss": LOSS, "points": self.labels(), "grid": b.grid,
               "rates": b.rates, "seeds": self.seeds, "select_seeds": list(b.select_seeds),
               "tolerance": b.tolerance, "scales": scales, "rule": rule_record()}
        if self.halving is not None:
            mine = [r for r in rows if r.key in {p.run.key for p in self.points}]
            out["halving"] = {"at": list(self.halving.at), "margin": self.halving.margin,
                              "decisions": list(decisions or []),
                              "steps_trained": sum(r.steps or 0 for r in mine),
                              "steps_planned": sum(p.run.config.train.steps
                                                   for p in self.points)}
        return out

    def _rows(self, by_key: dict[str, RunRow], scale: str, index: int | None,
              seeds: list[int]) -> list[RunRow]:
        """The rows of ``scale`` at grid point ``index`` (None: every point) of ``seeds``."""
        return [by_key[p.run.key] for p in self.points
                if p.run.scale == scale and (index is None or p.index == index)
                and p.run.seed in seeds and p.run.key in by_key]

    def _dropped(self, dropped: dict[str, RunRow], scale: str, method: str
                 ) -> dict[float, dict[int, float]]:
        """``{rate: {seed: loss when dropped}}`` of ``method``'s points the halving rule
        dropped at ``scale`` (the profile's seeds; a loss not recorded counts as not finite)."""
        out: dict[float, dict[int, float]] = {}
        for p in self.points:
            r = dropped.get(p.run.key)
            if r is not None and r.scale == scale and r.method == method \
                    and r.seed in self.seeds:
                out.setdefault(p.rate, {})[r.seed] = _drop_loss(r)
        return out

    def _judge_scale(self, scale: str, by_key: dict[str, RunRow], dropped: dict[str, RunRow],
                     metric: str) -> dict[str, Any]:
        n = len(self.labels())
        base = self.spec.baseline
        anchors = list(self.spec.seeds.anchors)
        tables = [metric_table(self._rows(by_key, scale, i, self.seeds), scale, LOSS, base)
                  for i in range(n)]
        profiles = {}
        for method in self.methods:
            rates = [self.rate(scale, method, i) for i in range(n)]
            table = {rates[i]: {s: tables[i].get(method, {}).get(s) for s in self.seeds}
                     for i in range(n)}
            profiles[method] = method_profile(method, table,
                                              self._init_losses(by_key, scale, method),
                                              tolerance=self.block.tolerance,
                                              dropped=self._dropped(dropped, scale, method))
        by_point = []
        for i in range(n):
            gone = [{"method": m, "verdict": DROPPED} for m in self.methods
                    if any(p.index == i and p.run.scale == scale and p.run.method == m
                           and p.run.key in dropped for p in self.points)]
            if any(g["method"] == base for g in gone):  # no baseline to judge against
                by_point.append(gone)
                continue
            comps = compare_scales(self._rows(by_key, scale, i, self.seeds), base, metric,
                                   anchors, looks={})
            by_point.append(comparisons_json(comps).get(scale, []) + gone)
        # a seed that trained at no rate has no sensitivity: a failed seed of the verdict
        per_seed = {m: {s: (v if math.isfinite(v) else None)
                        for s, v in p.seed_sensitivities.items()}
                    for m, p in profiles.items() if p.seed_sensitivities}
        sens = sensitivity_verdicts(per_seed, base) if base in per_seed else []
        return {"rates": {m: [self.rate(scale, m, i) for i in range(n)] for m in self.methods},
                "profiles": {m: p.to_dict() for m, p in profiles.items()},
                "by_point": by_point,
                "rate_dependent": self._rate_dependent(by_point),
                "sensitivity": [v.to_dict() for v in sens],
                "tuned": self._tuned(by_key, scale, metric)}

    def _init_losses(self, by_key: dict[str, RunRow], scale: str, method: str
                     ) -> dict[int, float]:
        """Each seed's loss at initialisation (its runs' validation before training; every
        rate starts from the same weights), else log(vocabulary): a uniform prediction's."""
        out: dict[int, float] = {}
        for r in self._rows(by_key, scale, None, self.seeds):
            v = r.initial_val_loss
            if r.method == method and v is not None and math.isfinite(v):
                out.setdefault(r.seed, v)
        vocab = run_spec(self.spec, scale, method, self.seeds[0]).config.model.vocab_size
        return {s: out.get(s, math.log(vocab)) for s in self.seeds}

    def _rate_dependent(self, by_point: list[list[dict[str, Any]]]) -> dict[str, bool]:
        """Per method, whether its verdicts at the points where it and the baseline both
        trained (neither's verdict a failure) include an improver and a degrader."""
        failed = ("diverged", "stalled", DROPPED)
        verdicts: dict[str, dict[float, str]] = {}
        for i, results in enumerate(by_point):
            base_failed = any(r["method"] == self.spec.baseline and r["verdict"] in failed
                              for r in results)
            for r in results:
                if r["method"] != self.spec.baseline and not base_failed \
                        and r["verdict"] not in failed:
                    verdicts.setdefault(r["method"], {})[float(i)] = str(r["verdict"])
        return {m: rate_dependent(v) for m, v in verdicts.items()}

    def _tuned(self, by_key: dict[str, RunRow], scale: str, metric: str
               ) -> dict[str, Any] | None:
        """With ``select_seeds``: each method's best point on them (fewest failed runs, then
        the best mean loss; a tie to the earlier point), and the study's verdict with each
        method at its own best point, on the profile's seeds."""
        select = list(self.block.select_seeds)
        if not select:
            return None
        n = len(self.labels())
        base = self.spec.baseline
        tables = [metric_table(self._rows(by_key, scale, i, select), scale, LOSS, base)
                  for i in range(n)]
        best: dict[str, int] = {}
        for method in self.methods:
            def rank(i: int, method: str = method) -> tuple[int, float]:
                values = [tables[i].get(method, {}).get(s) for s in select]
                finite = [v for v in values if v is not None and math.isfinite(v)]
                return (len(values) - len(finite),
                        sum(finite) / len(finite) if finite else math.inf)
            best[method] = min(range(n), key=rank)
        rows = [r for m, i in best.items() for r in self._rows(by_key, scale, i, self.seeds)
                if r.method == m]
        comps = compare_scales(rows, base, metric, list(self.spec.seeds.anchors), looks={})
        return {"best_point": {m: self.labels()[i] for m, i in best.items()},
                "best_rate": {m: self.rate(scale, m, i) for m, i in best.items()},
                "comparisons": comparisons_json(comps).get(scale, [])}

    # ------------------------------------------------------------------ what it says

    def plan(self, rate: Throughput | None) -> StagePlan:
        runs = self.runs()
        done = done_keys(self.folder)
        flops = sum(run_flops(r.config) for r in runs if r.key not in done)
        b = self.block
        what = (f"every method and the baseline at {len(self.labels())} learning rates "
                f"({', '.join(self.labels())}{' of recipe.lr' if b.grid is not None else ''})"
                f", on seed(s) {', '.join(map(str, self.seeds))}"
                + (f" and selection seed(s) {', '.join(map(str, b.select_seeds))}"
                   if b.select_seeds else "")
                + "; a point that diverges or stalls stops early"
                + (f"; halving: a point worse than its method's best by more than "
                   f"{self.halving.margin:g} on every seed at "
                   f"{', '.join(f'{a:g}' for a in self.halving.at)} of the steps stops there"
                   if self.halving is not None else ""))
        return StagePlan(self.name, self.folder, len(runs), sum(r.key in done for r in runs),
                         flops, what, gpu_hours=hours(flops, rate), upper_bound=True)

    def status(self) -> list[StatusPart]:
        return self.folder_status("recipe.lr")

    def report(self, results: StudyResults, out: Path) -> list[Block]:
        return profile_section(results, out)


def _drop_loss(row: RunRow) -> float:
    """A dropped run's validation loss when it was dropped (its summary's), else NaN."""
    try:
        v = json.loads((Path(str(row.run_dir)) / "summary.json").read_text()).get(
            "val_loss_at_drop")
    except (OSError, ValueError):
        return math.nan
    return float(v) if isinstance(v, int | float) else math.nan


register(LrProfileStage)
