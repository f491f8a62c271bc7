"""Gather a study folder's results into plain rows (one per run) and curves."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modbench.errors import ModbenchError
from modbench.study.store import Store


@dataclass
class RunRow:
    key: str
    scale: str
    method: str
    seed: int
    state: str
    status: str | None
    val_loss: float | None
    params: int | None
    tokens: int | None
    diverged_at_step: int | None
    last_grad_norms: list[dict[str, Any]] = field(default_factory=list)
    tasks: dict[str, float] = field(default_factory=dict)  # task -> score (accuracy etc.)
    task_items: dict[str, list[float]] = field(default_factory=dict)
    climb_avg: float | None = None

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    def metric(self, name: str) -> float | None:
        """The value of a study metric: ``val_loss``, ``probe_avg``, ``climb_avg`` or a task."""
        if self.diverged:
            return None
        if name == "val_loss":
            return self.val_loss
        if name == "climb_avg":
            return self.climb_avg
        if name == "probe_avg":
            probes = [v for k, v in self.tasks.items() if k in ("mqar", "induction", "cloze")]
            return sum(probes) / len(probes) if probes else None
        return self.tasks.get(name)


HIGHER_IS_BETTER = {"val_loss": False}


def higher_is_better(metric: str) -> bool:
    return HIGHER_IS_BETTER.get(metric, True)


def default_metric(primary: str | None, tasks: list[str] | None) -> str:
    """A study's decision metric: its ``evaluation.primary``, else ``climb_avg`` when it runs
    harness tasks, else ``val_loss``."""
    return primary or ("climb_avg" if tasks else "val_loss")


def collect(study: str | Path) -> list[RunRow]:
    root = Path(study)
    if not (root / "index.sqlite").is_file():
        raise ModbenchError(f"{root} is not a study folder (no index.sqlite); run "
                            "`modbench study run` first")
    rows = []
    for r in Store(root).rows():
        s = r["summary"] or {}
        ev = r["eval"] or {}
        tasks, items = {}, {}
        for name, t in (ev.get("tasks") or {}).items():
            score = t.get("accuracy", t.get("score"))
            if isinstance(score, int | float) and math.isfinite(score):
                tasks[name] = float(score)
                items[name] = [float(i.get("score", i.get("acc", math.nan)))
                               for i in t.get("items", [])]
        rows.append(RunRow(
            key=r["key"], scale=r["scale"], method=r["method"], seed=int(r["seed"]),
            state=r["state"], status=r["status"], val_loss=s.get("final_val_loss"),
            params=s.get("params"), tokens=s.get("tokens"),
            diverged_at_step=s.get("diverged_at_step"),
            last_grad_norms=s.get("last_grad_norms") or [], tasks=tasks, task_items=items,
            climb_avg=ev.get("climb_avg")))
    return rows


_SERIES = ("loss", "grad_norm", "val_loss")  # per-step fields of metrics.jsonl records


def curves(study: str | Path, key: str) -> dict[str, list[tuple[int, float]]]:
    """Training loss, grad norm and validation loss against step, from metrics.jsonl, and
    ``probe:NAME`` for each held-out probe scored at validation (``train.eval_probes``)."""
    path = Path(study) / "runs" / key / "metrics.jsonl"
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in _SERIES}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        found = {k: rec.get(k) for k in _SERIES}
        if rec.get("kind") == "val" and isinstance(rec.get("probes"), dict):
            found.update({f"probe:{k}": v for k, v in rec["probes"].items()})
        for k, v in found.items():
            if isinstance(v, int | float) and math.isfinite(v):
                out.setdefault(k, []).append((int(rec["step"]), float(v)))
    return out
