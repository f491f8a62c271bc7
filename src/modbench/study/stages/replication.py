"""Replication under a changed factor (``modbench study replicate DIR --change FACTOR``;
docs/studies.md, "Replication").

A verdict is a snapshot of one data order, one set of seeds and one numeric path. This stage
re-runs, at every scale, the baseline and every method whose verdict was decided (improver,
degrader, diverged, stalled) with one factor changed, into ``STUDY/replicate/<change>/`` (a
study folder of its own), judges them by the study's rule, and writes
``replication.json``: per decided verdict the replication's verdict, Δ and interval, whether
the sign agrees and whether the verdict replicates, the agreement rate, and the study's claim
checked again on the replication. The factors (:data:`FACTORS`):

* ``seeds[=OFFSET]``: new seeds, each seed plus OFFSET (default 1000);
* ``data-order[=SEED]``: another data order, ``data.data_seed`` SEED (default the study's + 1);
* ``dtype[=bf16|fp32]``: ``recipe.precision`` (default bf16 autocast);
* ``compile[=true|false]``: ``train.compile`` (default true: compiled, where the study ran
  eager on the CPU);
* ``threads[=N]``: ``train.threads`` (default 2): another thread count splits the kernels'
  sums differently;
* ``onednn[=off|on]``: torch's oneDNN CPU kernels off (``train.onednn``).

The last two change only the order of floating-point sums, so a verdict that does not replicate
under them depends on the machine, not on the method.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modbench.analysis.results import (
    MethodResult,
    StudyResults,
    check_claim,
    compare_scales,
    comparisons_json,
    rule_record,
)
from modbench.errors import ModbenchError, suggest
from modbench.fsutil import atomic_write_text
from modbench.report.blocks import Block
from modbench.report.replication import (
    REPLICATE_DIR,
    REPLICATION_FILE,
    read_replications,
    replication_section,
)
from modbench.study.costs import StagePlan, Throughput, done_keys, run_flops
from modbench.study.results import load_results, load_rows
from modbench.study.spec import RunSpec, Seeds, StudySpec, expand
from modbench.study.stages.base import (
    RunSettings,
    Session,
    Stage,
    StatusPart,
    hours,
    register,
)

#: the factors a replication may change, and what each changes (docs/studies.md)
FACTORS = {
    "seeds": "new seeds: each seed + OFFSET, default 1000",
    "data-order": "another data order: data.data_seed SEED, default the study's + 1",
    "dtype": "recipe.precision: bf16 or fp32, default bf16",
    "compile": "train.compile: true or false, default true",
    "threads": "train.threads: N, default 2",
    "onednn": "torch's oneDNN CPU kernels: off or on, default off",
}
DECIDED = ("improver", "degrader", "diverged", "stalled")
_CHANGE = re.compile(r"^([a-z-]+)(?:=(.+))?$")


@dataclass(frozen=True)
class Change:
    """One factor changed, with its value (None: the factor's default)."""

    factor: str
    value: str | None = None

    @property
    def name(self) -> str:
        """The change as written (``threads=3``) and its folder's name (``threads-3``)."""
        return self.factor + (f"={self.value}" if self.value is not None else "")

    @property
    def folder_name(self) -> str:
        return self.name.replace("=", "-")

    def apply(self, spec: StudySpec) -> StudySpec:
        """``spec`` with this factor changed in every run."""
        v = self.value
        if self.factor == "seeds":
            k = _int(self, v, 1000, low=1)
            s = spec.seeds
            return dataclasses.replace(spec, seeds=Seeds([x + k for x in s.default],
                                                         [x + k for x in s.noise_floor],
                                                         list(s.anchors)))
        if self.factor == "data-order":
            seed = _int(self, v, spec.data.data_seed + 1, low=0)
            if seed == spec.data.data_seed:
                raise ModbenchError(f"--change {self.name}: that is the study's own data order; "
                                    "give another data seed")
            return dataclasses.replace(spec, data=dataclasses.replace(spec.data, data_seed=seed))
        if self.factor == "dtype":
            key, value = "recipe.precision", _choice(self, v, "bf16", ("bf16", "fp32"))
        elif self.factor == "compile":
            key, value = "train.compile", _choice(self, v, "true", ("true", "false"))
        elif self.factor == "threads":
            key, value = "train.threads", str(_int(self, v, 2, low=1))
        else:  # onednn
            on = _choice(self, v, "off", ("off", "on")) == "on"
            key, value = "train.onednn", "true" if on else "false"
        return dataclasses.replace(spec, overrides=[*spec.overrides, f"{key}={value}"])


def _int(change: Change, v: str | None, default: int, *, low: int) -> int:
    if v is None:
        return default
    try:
        out = int(v)
    except ValueError:
        out = low - 1
    if out < low:
        raise ModbenchError(f"--change {change.name}: {change.factor} takes a whole number of at "
                            f"least {low}, e.g. {change.factor}={max(low, 2)}")
    return out


def _choice(change: Change, v: str | None, default: str, allowed: tuple[str, ...]) -> str:
    if v is None:
        return default
    if v not in allowed:
        raise ModbenchError(f"--change {change.name}: {change.factor} takes "
                            f"{' or '.join(allowed)}")
    return v


def parse_change(text: str) -> Change:
    """``--change FACTOR[=VALUE]``, refused in one line when the factor is unknown or its value
    wrong."""
    m = _CHANGE.match(str(text).strip())
    factor = m.group(1) if m else str(text)
    if m is None or factor not in FACTORS:
        raise ModbenchError(f"--change: unknown factor {factor!r}{suggest(factor, FACTORS)}; "
                            f"use one of {', '.join(FACTORS)} (e.g. --change threads=2)")
    change = Change(factor, m.group(2))
    change.apply(StudySpec(overrides=[]))  # its value checked now, before anything runs
    return change


class ReplicationStage(Stage):
    name = "replication"
    order = 50

    @classmethod
    def applies(cls, spec: StudySpec, out: Path, settings: RunSettings) -> bool:
        return bool(settings.replicate) or bool(read_replications(out))

    def changes(self) -> list[Change]:
        """The changes asked for now (``study replicate``), else those already replicated."""
        if self.settings.replicate:
            return [parse_change(c) for c in self.settings.replicate]
        return [parse_change(d["change"]) for d in read_replications(self.out)]

    def folder_of(self, change: Change) -> Path:
        return self.out / REPLICATE_DIR / change.folder_name

    def decided(self, results: StudyResults | None = None) -> dict[str, list[str]]:
        """Per scale, the methods whose verdict the study decided (``results``: the study's,
        None: read from its runs now)."""
        results = results or load_results(self.out)
        return {scale: [r.method for r in res if str(r.verdict) in DECIDED]
                for scale, res in results.comparisons.items()}

    def runs_of(self, change: Change, decided: dict[str, list[str]]) -> list[RunSpec]:
        """The changed study's runs of the baseline and the decided methods."""
        keep = {(scale, m) for scale, ms in decided.items() for m in [self.spec.baseline, *ms]}
        return [r for r in expand(change.apply(self.spec)) if (r.scale, r.method) in keep]

    def check(self) -> None:
        if not self.settings.replicate:
            return
        changes = self.changes()
        if not (self.out / "index.sqlite").is_file():
            raise ModbenchError(f"{self.out} is not a study folder (no index.sqlite); run "
                                "`modbench study run` first, then replicate it")
        for change in changes:
            expand(change.apply(self.spec))  # every changed run resolves

    def run(self, session: Session) -> None:
        original = load_results(self.out)  # read once: the verdicts, and what was decided
        decided = self.decided(original)
        if not any(decided.values()):
            return  # nothing decided: nothing to replicate (the report says so)
        for change in self.changes():
            changed = change.apply(self.spec)
            runs = self.runs_of(change, decided)
            folder = self.folder_of(change)
            sub = dataclasses.replace(
                changed, name=f"{self.spec.name}-{change.folder_name}", tuning=None,
                lr_profile=None, claim=None,
                evaluation=dataclasses.replace(changed.evaluation, diagnostics=None))
            session.execute(sub, folder, runs)
            data = self.judge(change, original, decided, load_rows(folder))
            atomic_write_text(folder / REPLICATION_FILE,
                              json.dumps(data, indent=1, default=str) + "\n")

    def judge(self, change: Change, original: StudyResults, decided: dict[str, list[str]],
              rows: list[Any]) -> dict[str, Any]:
        """``replication.json``: each decided verdict against the replication's."""
        metric = original.metric
        comps = compare_scales(rows, self.spec.baseline, metric, list(self.spec.seeds.anchors),
                               looks={})
        scales: dict[str, list[dict[str, Any]]] = {}
        for scale, methods in decided.items():
            before = {r.method: r for r in original.comparisons.get(scale, [])}
            after = {r.method: r for r in comps.get(scale, [])}
            scales[scale] = [_pair(m, before[m], after.get(m)) for m in methods]
        pairs = [p for ps in scales.values() for p in ps]
        claim = None
        if self.spec.claim is not None and original.claim is not None:
            again = check_claim(comps, self.spec.claim.expect, self.spec.claim.source,
                                self.spec.claim.text)
            claim = {"original": original.claim.summary, "replication": again.summary,
                     "original_rows": [(r.method, r.outcome) for r in original.claim.rows],
                     "replication_rows": [(r.method, r.outcome) for r in again.rows],
                     "same": [(r.method, r.outcome) for r in original.claim.rows]
                     == [(r.method, r.outcome) for r in again.rows]}
        return {"change": change.name, "what": FACTORS[change.factor], "metric": metric,
                "scales": scales, "replicated": sum(p["replicates"] for p in pairs),
                "verdicts": len(pairs),
                "agreement": (sum(p["replicates"] for p in pairs) / len(pairs)
                              if pairs else None),
                "comparisons": comparisons_json(comps), "claim": claim, "rule": rule_record()}

    # ------------------------------------------------------------------ what it says

    def plan(self, rate: Throughput | None) -> StagePlan | None:
        if not self.settings.replicate:
            return None
        try:
            decided = self.decided()
        except ModbenchError:  # no finished study yet
            return None
        runs = [r for c in self.changes() for r in self.runs_of(c, decided)]
        done = set().union(*(done_keys(self.folder_of(c)) for c in self.changes()))
        flops = sum(run_flops(r.config) for r in runs if r.key not in done)
        return StagePlan(self.name, self.out / REPLICATE_DIR, len(runs),
                         sum(r.key in done for r in runs), flops,
                         "the baseline and every decided method again, with "
                         + ", ".join(c.name for c in self.changes()),
                         gpu_hours=hours(flops, rate))

    def status(self) -> list[StatusPart]:
        parts = []
        for data in read_replications(self.out):
            change = parse_change(data["change"])
            folder = self.folder_of(change)
            line = (f"  replication under {data['change']}: {data['replicated']} of "
                    f"{data['verdicts']} decided verdicts replicate")
            parts.append(StatusPart(folder if (folder / "index.sqlite").is_file() else None,
                                    lines=[line]))
        return parts

    def report(self, results: StudyResults, out: Path) -> list[Block]:
        return replication_section(results, out)


def _pair(method: str, before: MethodResult, after: MethodResult | None) -> dict[str, Any]:
    """One decided verdict and its replication: the sign of Δ agrees (for a failure verdict,
    the replication failed too), and the verdict replicates (the same verdict)."""
    was = str(before.verdict)
    now = str(after.verdict) if after is not None else "missing"
    failure = was in ("diverged", "stalled")
    if failure:
        sign = now in ("diverged", "stalled")
    else:
        sign = (after is not None and math.isfinite(after.delta) and after.delta != 0
                and math.copysign(1.0, after.delta) == math.copysign(1.0, before.delta))
    return {"method": method, "original": _brief(before), "replication": _brief(after),
            "sign_agrees": bool(sign), "replicates": now == was}


def _brief(r: MethodResult | None) -> dict[str, Any] | None:
    if r is None:
        return None
    d = r.to_dict()
    return {k: d.get(k) for k in ("verdict", "delta", "ci", "n", "p_adjusted")}


register(ReplicationStage)
