"""modbench in a notebook: a study's runs, verdicts and curves, and a run's files, as pandas
DataFrames (docs/studies.md, "In a notebook")::

    import modbench

    study = modbench.load_study("studies/smoke")
    study.runs        # one row per run
    study.verdicts    # one row per scale and method: the report's Table 2, as numbers
    study.curves      # long format: one row per run, step and metric of metrics.jsonl
    run = modbench.load_run(study.runs.run_dir[0])

A thin layer: the rows and the verdicts are :func:`modbench.study.results.load_results`'
(:class:`~modbench.analysis.results.StudyResults`, kept as ``Study.results``), the verdicts'
columns are the report's own (:data:`~modbench.report.columns.VERDICT_COLUMNS` and
:data:`~modbench.report.columns.TRAINED_COLUMNS`, through
:func:`~modbench.report.columns.records`), and the curves are the run folders'
``metrics.jsonl`` (:func:`~modbench.runtime.runfolder.read_metrics`). pandas is imported only
here, when a function is called (``pip install 'modbench[notebook]'``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from modbench.analysis.results import ClaimCheck, RunRow, StudyResults
from modbench.config import load_yaml
from modbench.errors import ModbenchError
from modbench.report.columns import (
    TRAINED_COLUMNS,
    VERDICT_COLUMNS,
    record_fields,
    records,
    rows_at,
)
from modbench.runtime.runfolder import CONFIG, EVAL, SUMMARY, read_metrics
from modbench.study.results import check_study_folder, load_results, load_spec_of
from modbench.study.store import INDEX

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["CURVE_COLUMNS", "RUN_CURVE_COLUMNS", "TABLE2_COLUMNS", "Run", "Study", "load_run",
           "load_study", "run_columns", "verdict_columns"]

#: The columns of a run's curves (:attr:`Run.curves`): one row per record field of
#: ``metrics.jsonl``.
RUN_CURVE_COLUMNS: Final = ("step", "metric", "value")
#: The columns of a study's curves (:attr:`Study.curves`): the run's key, scale, method and
#: seed, then :data:`RUN_CURVE_COLUMNS`.
CURVE_COLUMNS: Final = ("run", "scale", "method", "seed", *RUN_CURVE_COLUMNS)
#: The table the verdicts frame has the columns of: Table 2's two tables, in the report's order.
TABLE2_COLUMNS: Final = (*VERDICT_COLUMNS, *TRAINED_COLUMNS)
# RunRow fields that are not one value per run (the tasks become columns of their own)
_NOT_COLUMNS = ("last_grad_norms", "tasks", "task_items", "run_dir")
# metrics.jsonl fields that are not curves (nor are flags and nested tables: _curve_points)
_NOT_CURVES = ("kind", "step")


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ModbenchError("modbench.load_study and modbench.load_run need pandas; "
                            "pip install 'modbench[notebook]'") from None
    return pandas


@dataclass(frozen=True, eq=False)
class Study:
    """A study folder's results as DataFrames (:func:`load_study`).

    * ``runs``: one row per run the results read (the report's ``results.csv`` rows; a run
      whose outside method's code changed since is left out, as the report leaves it out:
      ``results.code_changed``): ``key``, ``scale``, ``method``, ``seed``,
      ``state``, ``status``, ``primary`` (the study's decision metric as the verdicts read it:
      NaN for a diverged or stalled run, or one not finished), every other value of
      :class:`~modbench.analysis.results.RunRow` (``val_loss``, ``params``, ``tokens``,
      ``steps``, ...), one column per evaluated task or probe (its score), and ``run_dir``;
    * ``verdicts``: one row per scale and method compared with the baseline (the baseline
      first): ``scale``, then every column of the report's Table 2 (the verdicts' table and
      what each method trained) as the typed values its cells show;
    * ``curves``: long format, one row per run, step and metric of the runs' metrics.jsonl
      (:data:`CURVE_COLUMNS`);
    * ``spec``: the spec the folder was last run with, as a dict (empty when it has none);
    * ``claim``: the published claim the spec tests, held against the verdicts (None without
      one); ``results``: the typed results everything here comes from."""

    name: str
    folder: Path
    metric: str
    baseline: str
    spec: dict[str, Any]
    runs: pd.DataFrame
    verdicts: pd.DataFrame
    curves: pd.DataFrame
    claim: ClaimCheck | None
    results: StudyResults

    def __repr__(self) -> str:
        scales = sorted({r.scale for r in self.results.rows})
        return (f"Study({self.name!r}, folder={str(self.folder)!r}: {len(self.runs)} runs, "
                f"scales {scales}, baseline {self.baseline!r}, metric {self.metric!r})")


@dataclass(frozen=True, eq=False)
class Run:
    """A run folder's files (:func:`load_run`): ``config`` (config.yaml, its ``meta``
    included), ``summary`` (summary.json; None for a run not finished), ``eval`` (eval.json;
    None when it was not evaluated) and ``curves`` (metrics.jsonl in long format,
    :data:`RUN_CURVE_COLUMNS`; also ``metrics``)."""

    folder: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    eval: dict[str, Any] | None
    curves: pd.DataFrame

    @property
    def metrics(self) -> pd.DataFrame:
        """The same frame as ``curves``."""
        return self.curves

    @property
    def status(self) -> str | None:
        """``completed``, ``diverged`` or ``stalled``; None for a run not finished."""
        return None if self.summary is None else self.summary.get("status")

    def __repr__(self) -> str:
        return (f"Run({str(self.folder)!r}: {self.status or 'not finished'}, "
                f"{len(self.curves)} curve points)")


def load_study(folder: str | Path, metric: str | None = None) -> Study:
    """The study in ``folder`` (a folder ``modbench study run --out`` wrote) as a
    :class:`Study`; ``metric``: the decision metric to judge (default: the spec's, as
    ``modbench study report`` judges)."""
    pd = _pandas()
    root = Path(folder)
    if not (root / INDEX).is_file():
        if (root / CONFIG).is_file():
            raise ModbenchError(f"{root} is a run folder, not a study folder; read it with "
                                f"modbench.load_run({str(root)!r})")
        if not root.is_dir():
            raise ModbenchError(f"{root} {_missing(root)}; pass a study folder (`modbench "
                                "study run --out DIR` writes one)")
        check_study_folder(root)  # its one line
    results = load_results(root, metric)
    found = load_spec_of(root)
    tasks = sorted({t for r in results.rows for t in r.tasks})
    runs = pd.DataFrame([_run_record(r, results.metric, tasks) for r in results.rows],
                        columns=run_columns(tasks))
    for c in (*_numeric_fields(), "primary"):  # a number no run has: NaN, not None
        if runs[c].dtype == object and runs[c].isna().all():
            runs[c] = runs[c].astype("float64")
    table = [{"scale": scale, **rec} for scale in results.comparisons
             for rec in records(TABLE2_COLUMNS, rows_at(results, scale))]
    verdicts = pd.DataFrame(table, columns=verdict_columns(results.metric))
    curves = pd.DataFrame(
        [(r.key, r.scale, r.method, r.seed, *point) for r in results.rows
         if r.run_dir is not None for point in _curve_points(r.run_dir)],
        columns=list(CURVE_COLUMNS))
    return Study(name=results.name, folder=root, metric=results.metric,
                 baseline=results.baseline, spec=found.to_dict() if found else {}, runs=runs,
                 verdicts=verdicts, curves=curves, claim=results.claim, results=results)


def load_run(folder: str | Path) -> Run:
    """The run in ``folder`` (one ``modbench train --out`` wrote, or a study's
    ``runs/<key>/``) as a :class:`Run`."""
    pd = _pandas()
    root = Path(folder)
    if not (root / CONFIG).is_file():
        if (root / INDEX).is_file():
            raise ModbenchError(f"{root} is a study folder, not a run folder; read it with "
                                f"modbench.load_study({str(root)!r}), its runs are in "
                                f"{root / 'runs'}")
        why = "it has no config.yaml" if root.is_dir() else f"it {_missing(root)}"
        raise ModbenchError(f"{root} is not a run folder ({why}); pass a folder `modbench "
                            "train --out` wrote, or a study's runs/<key>/")
    return Run(folder=root, config=load_yaml(root / CONFIG), summary=_json(root / SUMMARY),
               eval=_json(root / EVAL),
               curves=pd.DataFrame(list(_curve_points(root)), columns=list(RUN_CURVE_COLUMNS)))


def run_columns(tasks: list[str]) -> list[str]:
    """The columns of :attr:`Study.runs` for a study whose runs scored ``tasks``."""
    fields = [f.name for f in dataclasses.fields(RunRow) if f.name not in _NOT_COLUMNS]
    head = ["key", "scale", "method", "seed", "state", "status"]
    return [*head, "primary", *(f for f in fields if f not in head),
            *(t for t in tasks if t not in fields), "run_dir"]


def verdict_columns(metric: str) -> list[str]:
    """The columns of :attr:`Study.verdicts`: ``scale``, then the fields of the report's
    Table 2 columns (:data:`TABLE2_COLUMNS`)."""
    return ["scale", *record_fields(TABLE2_COLUMNS, metric)]


def _numeric_fields() -> list[str]:
    """The RunRow fields that hold a number (or None)."""
    hints = typing.get_type_hints(RunRow)
    return [f.name for f in dataclasses.fields(RunRow) if f.name not in _NOT_COLUMNS
            and set(typing.get_args(hints[f.name]) or (hints[f.name],)) - {type(None)}
            <= {int, float}]


def _run_record(r: RunRow, metric: str, tasks: list[str]) -> dict[str, Any]:
    d = {f.name: getattr(r, f.name) for f in dataclasses.fields(RunRow)
         if f.name not in _NOT_COLUMNS}
    return {**{t: r.tasks.get(t) for t in tasks}, **d, "primary": r.metric(metric),
            "run_dir": r.run_dir}


def _curve_points(run_dir: Path) -> Iterator[tuple[int, str, float]]:
    """(step, metric, value) for every number of every record of the run's metrics.jsonl, in
    log order: the record's fields (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
    ``tokens``; ``val_loss``, ``val_ppl``) and each probe of a validation record as
    ``probe:NAME``; NaN where the log has null (a non-finite number). Flags and per-layer
    tables (``nonfinite``, ``layers``) are not curves."""
    for rec in read_metrics(run_dir):
        step = int(rec["step"])
        for key, value in rec.items():
            if key in _NOT_CURVES:
                continue
            if key == "probes":
                for name, v in (value if isinstance(value, dict) else {}).items():
                    if _number(v):
                        yield step, f"probe:{name}", math.nan if v is None else float(v)
            elif _number(value):
                yield step, key, math.nan if value is None else float(value)


def _missing(path: Path) -> str:
    return "is not a folder" if path.exists() else "does not exist"


def _number(v: Any) -> bool:
    """A number of metrics.jsonl, or its null (written for a non-finite one); not a flag."""
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool))


def _json(path: Path) -> dict[str, Any] | None:
    """A run's JSON file as a dict; None where it is missing."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModbenchError(f"cannot read {path} ({e.__class__.__name__}: {e}); the run "
                            "folder is damaged: train the run again") from None
    if not isinstance(data, dict):
        raise ModbenchError(f"{path} is not a JSON object; the run folder is damaged: train "
                            "the run again")
    return data
