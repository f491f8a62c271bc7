"""Successive halving for the learning-rate profile (``lr_profile.halving``; docs/studies.md,
"Learning-rate profiles"; docs/statistics.md, "Successive halving").

The profile's runs train in rungs: every grid point of every method to the first fraction of
``train.steps`` in ``halving.at`` (the run pauses there, validated and checkpointed: the
trainer's ``until``), then the rule (:func:`modbench.analysis.profile.halving_drops`) compares
each method's points at that step on the profile's seeds, and a point clearly worse than the
method's best on every seed is **dropped**: its runs (its selection seeds' too) end there with
status ``dropped`` in ``summary.json`` and the index, their loss at the drop recorded. The
others go on to the next rung, and at the end to ``train.steps``. A point that diverged or
stalled before a rung has ended by itself and is not compared.

Dropping is reversible and replayable: every ``study run`` first reopens the dropped runs
(their checkpoints are kept), then decides each rung again from the validation losses the runs
logged, so a killed study, or one run again with another rule (or none), trains nothing twice
and keeps no decision of a rule it no longer has.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from modbench.analysis.profile import halving_drops
from modbench.fsutil import atomic_write_text
from modbench.runtime.runfolder import read_metrics, val_points
from modbench.study.spec import RunSpec, StudySpec
from modbench.study.stages.base import Session
from modbench.study.store import Store

#: the status of a run the halving rule stopped (its summary.json and the index)
DROPPED = "dropped"


class ProfilePoint(Protocol):
    """A run of the profile at grid point ``index`` (:class:`modbench.study.stages.profile.
    Point`)."""

    @property
    def index(self) -> int: ...

    @property
    def run(self) -> RunSpec: ...


@dataclass(frozen=True)
class Halving:
    """The rule of a profile: the rungs (fractions of ``train.steps``) and the margin."""

    at: tuple[float, ...]
    margin: float

    @classmethod
    def of(cls, settings: dict[str, Any]) -> Halving:
        return cls(tuple(float(x) for x in settings["at"]), float(settings["margin"]))


def rung_step(fraction: float, steps: int, eval_every: int) -> int | None:
    """The step a rung at ``fraction`` of ``steps`` pauses at: the validation step (a multiple
    of ``eval_every``) nearest to it (a tie: the later), at least one validation in; None when
    that is not before the end (the run then simply trains on)."""
    if eval_every < 1:
        return None
    at = max(1, math.floor(fraction * steps / eval_every + 0.5)) * eval_every  # half up
    return at if at < steps else None


def loss_at(run_dir: Path, step: int) -> float | None:
    """A run's validation loss logged at ``step`` (None: no validation there)."""
    for s, v in val_points(read_metrics(run_dir)):
        if s == step:
            return v
    return None


def reopen_dropped(store: Store, keys: Sequence[str]) -> int:
    """Make the dropped runs among ``keys`` runs to resume again (their summary.json goes, their
    checkpoint stays): the rungs then decide again. Returns how many."""
    wanted, n = set(keys), 0
    for row in store.rows():
        if row["key"] in wanted and row["status"] == DROPPED:
            (store.run_dir(row["key"]) / "summary.json").unlink(missing_ok=True)
            store.reopen(row["key"])
            n += 1
    return n


def run_rungs(points: Sequence[ProfilePoint], seeds: Sequence[int], labels: Sequence[str],
              rule: Halving, session: Session, spec: StudySpec, folder: Path
              ) -> list[dict[str, Any]]:
    """Train ``points`` rung by rung under ``rule`` through ``session`` (their study folder
    ``folder``, its spec ``spec``), dropping what the rule drops; returns the decisions, one
    per dropped point (scale, method, grid point, the rung, its step, the best point then and
    the gaps), in the order they were made. The runs left are not trained to the end here."""
    store = Store(folder)
    reopen_dropped(store, [p.run.key for p in points])
    dropped: set[tuple[str, str, int]] = set()
    decisions: list[dict[str, Any]] = []
    for fraction in rule.at:
        live = [p for p in points if (p.run.scale, p.run.method, p.index) not in dropped]
        steps: dict[int, list[ProfilePoint]] = {}
        for p in live:
            tc = p.run.config.train
            at = rung_step(fraction, tc.steps, tc.eval_every)
            if at is not None:
                steps.setdefault(at, []).append(p)
        for at, group in steps.items():
            session.execute(spec, folder, [p.run for p in group], until=at)
            for d in _decide(group, seeds, labels, rule.margin, at, fraction, store):
                dropped.add((d["scale"], d["method"], d["index"]))
                decisions.append(d)
    session.counts["dropped"] = session.counts.get("dropped", 0) + sum(
        1 for p in points if (p.run.scale, p.run.method, p.index) in dropped)
    return decisions


def _decide(group: Sequence[ProfilePoint], seeds: Sequence[int], labels: Sequence[str],
            margin: float, at: int, fraction: float, store: Store) -> list[dict[str, Any]]:
    """One rung's decisions for the points in ``group`` (paused at step ``at``): per scale and
    method, the points' losses there on the profile's ``seeds`` through the rule; the dropped
    points' runs are recorded as dropped."""
    rows = {r["key"]: r for r in store.rows()}
    by_method: dict[tuple[str, str], dict[int, list[ProfilePoint]]] = {}
    for p in group:
        by_method.setdefault((p.run.scale, p.run.method), {}).setdefault(p.index, []).append(p)
    out: list[dict[str, Any]] = []
    for (scale, method), by_index in by_method.items():
        losses: list[dict[int, float | None] | None] = [None] * len(labels)
        for i, pts in by_index.items():
            runs = [p for p in pts if p.run.seed in seeds]
            ended = any(rows.get(p.run.key, {}).get("status") in ("diverged", "stalled")
                        for p in runs)
            if runs and not ended:
                losses[i] = {p.run.seed: loss_at(store.run_dir(p.run.key), at) for p in runs}
        for d in halving_drops(losses, margin):
            decision = {"scale": scale, "method": method, "index": d.point,
                        "point": labels[d.point], "at": fraction, "step": at,
                        "best": labels[d.best], "gap": d.gap, "min_gap": d.min_gap}
            if [_drop(store, p.run, at, rows.get(p.run.key), decision)
                    for p in by_index[d.point]].count(True):
                out.append(decision)
    return out


def _drop(store: Store, run: RunSpec, at: int, row: dict[str, Any] | None,
          decision: dict[str, Any]) -> bool:
    """Record ``run`` as dropped at step ``at`` (a run that finished already keeps its own
    outcome: it trained to the end before this rule was set; False)."""
    if row is not None and row["state"] == "done":
        return False
    folder = store.run_dir(run.key)
    vals = dict(val_points(read_metrics(folder)))  # step -> validation loss, read once
    tc = run.config.train
    summary = {"status": DROPPED, "method": run.config.model.method, "seed": run.seed,
               "steps": at, "steps_planned": tc.steps,
               "tokens": at * tc.batch_size * tc.seq_len,
               "initial_val_loss": vals.get(0), "final_val_loss": None,
               "dropped_at_step": at, "val_loss_at_drop": vals.get(at),
               "halving": {k: decision[k] for k in ("at", "best", "gap", "min_gap")}}
    atomic_write_text(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
    store.finish(run.key, summary, None)
    return True
