"""A study folder's results: its spec, its runs and their statistics
(:class:`modbench.analysis.results.StudyResults`), and the report built from them."""

from __future__ import annotations

import csv
import time
from pathlib import Path

from modbench.analysis.flops import flop_report
from modbench.analysis.results import (
    MethodFlops,
    RunRow,
    StudyResults,
    check_claim,
    compare_scales,
    default_metric,
)
from modbench.errors import ModbenchError
from modbench.study.spec import StudySpec, load_spec, run_spec
from modbench.study.store import Store


def check_study_folder(root: Path) -> None:
    """Refuse a folder that no study has run in (no results index)."""
    if not (root / "index.sqlite").is_file():
        raise ModbenchError(f"{root} is not a study folder (no index.sqlite); run "
                            "`modbench study run` first")


def load_rows(folder: str | Path) -> list[RunRow]:
    """One :class:`RunRow` per run in the study's index (by scale, method, seed)."""
    root = Path(folder)
    check_study_folder(root)
    store = Store(root)
    return [RunRow.from_record(r, store.run_dir(r["key"])) for r in store.rows()]


def load_spec_of(folder: str | Path) -> StudySpec | None:
    """The spec a study folder was last run with (``DIR/spec.yaml``), None if it has none."""
    path = Path(folder) / "spec.yaml"
    return load_spec(path) if path.is_file() else None


def method_flops(spec: StudySpec, scale: str, method: str, seed: int = 0) -> MethodFlops:
    """Training FLOPs per token and the FLOPs ratio of ``method`` at ``scale``, from the run
    config the spec gives it."""
    cfg = run_spec(spec, scale, method, seed).config
    r = flop_report(cfg.model, cfg.train.seq_len)
    return MethodFlops(float(r.train_flops_per_token), float(r.flops_ratio))


def load_results(folder: str | Path, metric: str | None = None) -> StudyResults:
    """The study's runs, their per-scale comparison with the baseline on ``metric`` (default:
    the spec's decision metric) and each method's FLOPs per scale."""
    root = Path(folder)
    rows = load_rows(root)
    found = load_spec_of(root)
    spec = found or StudySpec()
    metric = metric or default_metric(spec.evaluation.primary, spec.evaluation.tasks)
    anchors = list(spec.seeds.anchors)
    flops: dict[str, dict[str, MethodFlops]] = {}
    for r in rows:  # by scale, method, seed: the first seed of each method
        per_scale = flops.setdefault(r.scale, {})
        if r.method not in per_scale:
            per_scale[r.method] = method_flops(spec, r.scale, r.method, r.seed)
    comparisons = compare_scales(rows, spec.baseline, metric, anchors)
    claim = (check_claim(comparisons, spec.claim.expect, spec.claim.source, spec.claim.text)
             if spec.claim else None)
    return StudyResults(
        name=found.name if found else root.name, folder=root, baseline=spec.baseline,
        metric=metric, anchors=anchors, rows=rows, comparisons=comparisons, flops=flops,
        claim=claim, data_order=spec.data.order)


def write_study_report(folder: str | Path, metric: str | None = None) -> Path:
    """Write ``DIR/report/`` (``modbench.report.build.write_report``); returns that folder.

    One report writer at a time (:class:`modbench.runtime.lock.FolderLock` next to
    ``report/``; a second waits for the first, up to :data:`REPORT_WAIT_S`), and a report
    with fewer finished runs than the one already there is refused, not written: the index
    lost runs the run folders still hold (``modbench study status`` rebuilds a damaged one)."""
    from modbench.report.build import write_report
    from modbench.runtime.lock import FolderLock

    out = Path(folder) / "report"
    lock = FolderLock(out, "modbench study report", beside=True)
    deadline = time.monotonic() + REPORT_WAIT_S
    while True:
        try:
            lock.acquire()
            break
        except ModbenchError:
            if time.monotonic() > deadline or not lock.path.exists():
                raise
            time.sleep(0.5)
    try:
        results = load_results(folder, metric)
        had = done_runs_in_report(out)
        now = sum(r.state == "done" for r in results.rows)
        if had > now:
            raise ModbenchError(f"{out} reports {had} finished runs but the study's index now "
                                f"has {now}; the report was kept; check the index with "
                                f"`modbench study status {folder}`")
        return write_report(results, out)
    finally:
        lock.release()


REPORT_WAIT_S = 120.0


def done_runs_in_report(out: Path) -> int:
    """Finished runs listed in an existing ``report/results.csv`` (0: none, or unreadable)."""
    try:
        with open(out / "results.csv", newline="", encoding="utf-8") as f:
            return sum(row.get("state") == "done" for row in csv.DictReader(f))
    except (OSError, ValueError, csv.Error):
        return 0
