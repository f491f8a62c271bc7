"""A study's report: its results (:func:`modbench.study.results.load_results`) rendered by
:mod:`modbench.report`, with the sections its stages add (:mod:`modbench.study.stages`: the
sequential looks, frozen versus tuned)."""

from __future__ import annotations

import csv
import time
from pathlib import Path

from modbench.errors import ModbenchError
from modbench.study.results import load_results, load_spec_of
from modbench.study.spec import StudySpec
from modbench.study.stages import stages_for


def write_study_report(folder: str | Path, metric: str | None = None) -> Path:
    """Write ``DIR/report/`` (``modbench.report.build.write_report``, with each of the study's
    stages' sections: :meth:`modbench.study.stages.Stage.report`); returns that folder.

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
        spec = load_spec_of(folder) or StudySpec()
        sections = [stage.report for stage in stages_for(spec, folder)]
        had = done_runs_in_report(out)
        now = sum(r.state == "done" for r in results.rows)
        if had > now:
            raise ModbenchError(f"{out} reports {had} finished runs but the study's index now "
                                f"has {now}; the report was kept; check the index with "
                                f"`modbench study status {folder}`")
        return write_report(results, out, sections=sections)
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
