"""The group-sequential stage (``modbench study run --until-decided N``): after the study's
own runs, seeds are added in looks, up to N seeds per group. At each look every scale is
judged by the verdict's own test at the alpha that look spends (Lan–DeMets ``--spending``:
``obrien_fleming`` or ``pocock``; :func:`modbench.analysis.stats.sequential_look`), the
baseline's seeds first, one more seed for each method not yet decided; with ``--futility
GAMMA`` a method whose conditional power under the current trend is below GAMMA gets no more
seeds (stopped for futility, non-binding). The looks are kept in
the study folder (``analysis.results.LOOKS_FILE``), and the report judges the study by them
(docs/statistics.md, "Sequential seeds")."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from modbench.analysis.results import ALPHA, LOOKS_FILE, StudyResults, read_looks
from modbench.errors import ModbenchError
from modbench.fsutil import atomic_write_text
from modbench.report.blocks import Block
from modbench.report.trajectory import futility_words, sequential_section
from modbench.study.costs import StagePlan, Throughput, run_flops
from modbench.study.results import load_rows
from modbench.study.spec import RunSpec, StudySpec, expand, run_spec
from modbench.study.stages.base import (
    RunSettings,
    Session,
    Stage,
    StatusPart,
    hours,
    register,
)


class SequentialStage(Stage):
    name = "sequential"
    order = 10

    @classmethod
    def applies(cls, spec: StudySpec, out: Path, settings: RunSettings) -> bool:
        return settings.until_decided is not None or (out / LOOKS_FILE).is_file()

    def run(self, session: Session) -> None:
        cap = self.settings.until_decided
        if cap is None:  # a study looked at before, run now without --until-decided
            return
        asked: set[str] = set()
        while True:
            runs = undecided_runs(self.spec, self.folder, cap, self.settings.spending,
                                  self.settings.futility)
            if {r.key for r in runs} <= asked:  # nothing asked, or the same runs: they failed
                return
            asked = {r.key for r in runs}
            session.counts["added_seeds"] += len(runs)
            session.execute(self.spec, self.folder, runs)

    def plan(self, rate: Throughput | None) -> StagePlan | None:
        """At most every group filled to the cap: an upper bound (the looks stop a group as
        soon as it is decided, or stopped for futility)."""
        cap = self.settings.until_decided
        if cap is None:
            return None
        seeds: dict[tuple[str, str], set[int]] = defaultdict(set)
        for r in expand(self.spec):
            seeds[r.scale, r.method].add(r.seed)
        more: list[RunSpec] = []
        for (scale, method), have in seeds.items():
            first = min(have)
            extra = [s for s in range(first, first + 2 * cap) if s not in have][:cap - len(have)]
            more += [run_spec(self.spec, scale, method, s) for s in extra]
        flops = sum(run_flops(r.config) for r in more)
        futility = self.settings.futility
        stop = "" if futility is None else f" nor stopped for futility (below {futility:g})"
        return StagePlan(self.name, self.folder, len(more), 0, flops,
                         f"seeds added by looks up to {cap} per group "
                         f"({self.settings.spending} α-spending), only to methods not yet "
                         f"decided{stop}", known=False, gpu_hours=hours(flops, rate),
                         upper_bound=True, runs_bound=True)

    def status(self) -> list[StatusPart]:
        lines = []
        for scale, looks in read_looks(self.folder).items():
            if looks:
                last = looks[-1]
                asked = sum(last.add.values())
                lines.append(f"  sequential {scale}: {len(looks)} look(s) (--until-decided "
                             f"{last.cap}, {last.spending} spending{futility_words(looks)}), "
                             "α spent "
                             f"{last.alpha_spent:.3g} of {ALPHA:g}; the last look "
                             + (f"asked for {asked} more seed(s)" if asked else "asked for none"))
        return [StatusPart(lines=lines)] if lines else []

    def report(self, results: StudyResults, out: Path) -> list[Block]:
        return sequential_section(results)


def undecided_runs(spec: StudySpec, out: str | Path, cap: int,
                   spending: str = "obrien_fleming", futility: float | None = None
                   ) -> list[RunSpec]:
    """One look of the group-sequential design at each scale
    (:func:`modbench.analysis.stats.sequential_look`, with the report's verdict rule and
    ``futility``): the new seeds it asks for (a method's next seed numbers above its first, a
    gap first: a run of an earlier wave left unfinished), the look recorded in the study
    folder (``LOOKS_FILE``). A scale whose last look asked for nothing and whose seeds have
    not changed since gets no new look. Looks planned with another cap, spending function or
    futility setting are refused in one line."""
    # read through their module when called (the report's own table and rule, tested so)
    from modbench.analysis.results import (
        default_metric,
        looks_json,
        metric_table,
        verdict_options,
    )
    from modbench.analysis.stats import sequential_look

    metric = default_metric(spec.evaluation.primary, spec.evaluation.tasks)
    rows = load_rows(out)
    looks = read_looks(out)
    new: list[RunSpec] = []
    for scale in spec.scales:
        table = metric_table(rows, scale, metric, spec.baseline)
        if spec.baseline not in table:
            continue
        history = looks.setdefault(scale, [])
        last = history[-1] if history else None
        if last and (last.cap, last.spending, last.futility) != (cap, spending, futility):
            raise ModbenchError(
                f"the looks of {scale} were planned for --until-decided {last.cap} "
                f"--spending {last.spending}{futility_flag(last.futility)}; go on with "
                f"those, or remove {Path(out) / LOOKS_FILE} to start a new design")
        seeds = {m: len(s) for m, s in table.items()}
        if history and history[-1].last and dict(history[-1].seeds) == seeds:
            continue
        look = sequential_look(table, history, cap, baseline=spec.baseline, alpha=ALPHA,
                               spending=spending, futility=futility, n_resamples=1,
                               **verdict_options(rows, scale, metric,
                                                 list(spec.seeds.anchors), table))
        history.append(look)
        for method, k in look.add.items():
            have = set(table.get(method) or ())
            # the next seeds above the first (a gap: a run of an earlier wave left unfinished)
            seed, seeds_new = (min(have) + 1 if have else 0), []
            while len(seeds_new) < k:
                if seed not in have:
                    seeds_new.append(seed)
                seed += 1
            new += [run_spec(spec, scale, method, s) for s in seeds_new]
    if any(looks.values()):
        atomic_write_text(Path(out) / LOOKS_FILE, looks_json(looks))
    return new


def futility_flag(futility: float | None) -> str:
    """How a design's futility setting is given on the command line."""
    return " without --futility" if futility is None else f" --futility {futility:g}"


register(SequentialStage)
