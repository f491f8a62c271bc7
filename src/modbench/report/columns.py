"""The columns of the report's Table 2 view, each a header and a cell function, in one list per
table: :data:`VERDICT_COLUMNS` (the verdict and the statistics behind it) and
:data:`TRAINED_COLUMNS` (what each method trained). A table is rendered from its list alone
(:func:`table`), so its header and its cells cannot drift apart.

A cell function is given a :class:`Row`: one method's
:class:`~modbench.analysis.stats.MethodResult` at one scale, its finished runs there, its
FLOPs, the scale and the study's metric. A column also names the typed values its cell shows
(``Δ [CI]``: ``delta``, ``ci_low``, ``ci_high``) and gives them (:meth:`Column.data`,
:func:`records`): the numbers behind the table, what ``modbench.load_study``'s ``verdicts``
frame holds, from the same list. Adding a statistic to the report is the statistic (a
field of ``MethodResult``, computed by :func:`~modbench.analysis.stats.compare`) and one
:class:`Column` here; a user passes extra columns to the writer instead::

    from modbench.report.build import write_report
    from modbench.report.columns import VERDICT_COLUMNS, Column

    write_report(results, out, columns=[*VERDICT_COLUMNS,
                                        Column("P(not better)",
                                               lambda row: f"{row.result.prob_not_better:.2f}")])

The views follow Table 2 of the seed study (arXiv 2605.20798, docs/sources.md#seed-002).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from modbench.analysis.results import MethodFlops, RunRow, StudyResults
from modbench.analysis.stats import CORRECTIONS, MethodResult
from modbench.report.blocks import Block
from modbench.report.blocks import fmt as _fmt

#: The verdicts of a method with a failed seed (analysis.stats.Verdict): no test, no average.
FAILED: Final = ("diverged", "stalled")
#: A header's stand-in for the study's metric (``val_loss``, ``climb_avg``, ...).
METRIC: Final = "{metric}"

_TEST_NAMES = {"pooled": "pooled t", "prediction": "prediction", "welch": "Welch",
               "none": "–"}


@dataclass(frozen=True)
class Row:
    """What a cell function is given: one method's comparison with the baseline at one scale
    (``result``), its finished runs there (state ``done``), its analytic FLOPs (None where not
    known), the scale and the study's metric."""

    result: MethodResult
    runs: list[RunRow]
    flops: MethodFlops | None
    scale: str
    metric: str

    @property
    def failed(self) -> bool:
        """A failure verdict (diverged, stalled): its finite seeds are not what it rests on."""
        return str(self.result.verdict) in FAILED

    @property
    def fewer(self) -> bool:
        """Fewer finite seeds than the baseline, on a verdict that rests on them (marked †)."""
        return self.result.fewer_seeds and not self.failed


@dataclass(frozen=True)
class Column:
    """One column of a table: its header (:data:`METRIC` in it stands for the study's metric),
    the function that gives its cell in a :class:`Row`, and the typed values that cell shows:
    their ``names`` and the function that gives them in a row, in that order (None: the
    column's data is its cell's text under its title)."""

    header: str
    cell: Callable[[Row], str]
    names: tuple[str, ...] = ()
    values: Callable[[Row], tuple[Any, ...]] | None = None

    def title(self, metric: str) -> str:
        return self.header.replace(METRIC, metric)

    def fields(self, metric: str) -> tuple[str, ...]:
        """The names of :meth:`data`'s values."""
        return self.names if self.values is not None else (self.title(metric),)

    def data(self, row: Row) -> dict[str, Any]:
        """The values the cell shows in ``row``, by name (:attr:`names`); a column without
        ``values``: its cell's text under its title."""
        if self.values is None:
            return {self.title(row.metric): self.cell(row)}
        return dict(zip(self.names, self.values(row), strict=True))


def rows_at(results: StudyResults, scale: str) -> list[Row]:
    """The rows of ``scale``'s tables: one per method of its comparisons, in their order (the
    baseline first)."""
    return [Row(r, [x for x in results.rows if x.scale == scale and x.method == r.method
                    and x.state == "done"], results.flops_of(scale, r.method), scale,
                results.metric)
            for r in results.comparisons.get(scale, [])]


def table(columns: Sequence[Column], rows: Sequence[Row], metric: str) -> Block:
    """A table block of ``rows``, one column per entry of ``columns``: header and cells both
    come from that one list."""
    return Block("table", header=[c.title(metric) for c in columns],
                 rows=[[c.cell(r) for c in columns] for r in rows])


def record_fields(columns: Sequence[Column], metric: str) -> list[str]:
    """The keys of :func:`records`' dicts, in order: each column's :meth:`Column.fields`, a
    name that two columns give (``method``, first in both of Table 2's lists) once."""
    return list(dict.fromkeys(f for c in columns for f in c.fields(metric)))


def records(columns: Sequence[Column], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The typed data of the table of ``columns`` and ``rows``: per row, every column's
    :meth:`Column.data` (keys: :func:`record_fields`; a repeated name keeps its first
    column's value)."""
    out = []
    for r in rows:
        d: dict[str, Any] = {}
        for c in columns:
            for k, v in c.data(r).items():
                d.setdefault(k, v)
        out.append(d)
    return out


# ------------------------------------------------------------------ cell formats


def span(values: list[Any], fmt: Any = str) -> str:
    """"a" when all values are equal, "a–b" (min–max) otherwise, "–" when there are none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    lo, hi = min(vals), max(vals)
    return fmt(lo) if lo == hi else f"{fmt(lo)}–{fmt(hi)}"


def dof(v: Any) -> str:
    """Degrees of freedom: an integer as one ("2"), Welch's fractional ones to 3 digits."""
    if isinstance(v, int | float) and math.isfinite(v) and float(v).is_integer():
        return str(int(v))
    return _fmt(v, 3) if isinstance(v, float) and math.isfinite(v) else "–"


def count(v: int | float) -> str:
    """A count in 3 significant digits with a k / M / B suffix (12.3k, 23.1B)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.3g}{unit}"
    return f"{v:g}"


def against_baseline(cell: Callable[[Row], str]) -> Callable[[Row], str]:
    """``cell``, left empty in the baseline's row (a comparison of the baseline with itself)."""
    def cell_or_empty(row: Row) -> str:
        return "" if row.result.is_baseline else cell(row)

    return cell_or_empty


def values_against_baseline(values: Callable[[Row], tuple[Any, ...]]
                            ) -> Callable[[Row], tuple[Any, ...]]:
    """``values``, each None in the baseline's row (where :func:`against_baseline` leaves the
    cell empty)."""
    def values_or_none(row: Row) -> tuple[Any, ...]:
        got = values(row)
        return tuple(None for _ in got) if row.result.is_baseline else got

    return values_or_none


# ------------------------------------------------------------------ the verdict columns


def _seeds(row: Row) -> str:
    r = row.result
    notes = (["fewer than baseline"] if row.fewer else []) + (
        [f"+{r.n_diverged} diverged"] if r.n_diverged else []) + (
        [f"+{r.n_stalled} stalled"] if r.n_stalled else [])
    return f"{r.n}" + (f" ({'; '.join(notes)})" if notes else "")


def _mean(row: Row) -> str:
    r = row.result
    return _fmt(r.mean) + (f" ± {_fmt(r.std, 2)}" if r.n > 1 else "")


def delta_text(r: MethodResult) -> str:
    """Δ and, where the test gave one, its simultaneous interval: ``-0.0123 [-0.02, -0.004]``."""
    lo, hi = r.ci
    if isinstance(lo, float) and math.isfinite(lo) and math.isfinite(hi):
        return f"{_fmt(r.delta)} [{_fmt(lo)}, {_fmt(hi)}]"
    return _fmt(r.delta)


def _test(row: Row) -> str:
    return _TEST_NAMES.get(row.result.test, row.result.test)


def _t_df(row: Row) -> str:
    r = row.result
    return "" if r.test == "none" else f"{_fmt(r.t, 3)} ({dof(r.df)})"


def _p_adjusted(correction: str) -> Column:
    def cell(row: Row) -> str:
        r = row.result
        return (_fmt(r.p_adjusted[correction], 3)
                + (" *" if r.significant.get(correction) else ""))

    def values(row: Row) -> tuple[Any, ...]:
        r = row.result
        return r.p_adjusted[correction], r.significant.get(correction)

    return Column(f"p {correction}", against_baseline(cell),
                  (f"p_{correction}", f"significant_{correction}"),
                  values_against_baseline(values))


def _verdict(row: Row) -> str:
    return str(row.result.verdict) + (" †" if row.fewer else "")


def mde_text(r: MethodResult) -> str:
    """The minimum detectable |Δ| at 80 % power, with its size in σ: ``0.021 (3.1σ)``."""
    mde, ms = r.mde, r.mde_sigma
    if isinstance(mde, float) and math.isfinite(mde):
        return f"{_fmt(mde)} ({ms:.1f}σ)"
    return "–"


def _method(row: Row) -> str:
    return f"`{row.result.method}`"


#: Table 2's verdict columns: the seeds (and failed ones), the metric, Δ with the test's
#: interval, z, the test with t and df, p raw and under each correction (* at or below α), the
#: verdict († fewer seeds than the baseline) and the minimum detectable effect.
VERDICT_COLUMNS: Final[tuple[Column, ...]] = (
    Column("method", _method, ("method",), lambda row: (row.result.method,)),
    Column("seeds", _seeds, ("n", "n_diverged", "n_stalled"),
           lambda row: (row.result.n, row.result.n_diverged, row.result.n_stalled)),
    Column(METRIC, _mean, ("mean", "std"), lambda row: (row.result.mean, row.result.std)),
    Column("Δ [CI]", against_baseline(lambda row: delta_text(row.result)),
           ("delta", "ci_low", "ci_high"),
           values_against_baseline(lambda row: (row.result.delta, *row.result.ci))),
    Column("z", against_baseline(lambda row: _fmt(row.result.z, 3)), ("z",),
           values_against_baseline(lambda row: (row.result.z,))),
    Column("test", against_baseline(_test), ("test",),
           values_against_baseline(lambda row: (row.result.test,))),
    Column("t (df)", against_baseline(_t_df), ("t", "df"),
           values_against_baseline(lambda row: (row.result.t, row.result.df))),
    Column("p", against_baseline(lambda row: _fmt(row.result.p, 3)), ("p",),
           values_against_baseline(lambda row: (row.result.p,))),
    *(_p_adjusted(c) for c in CORRECTIONS),
    Column("verdict", _verdict, ("verdict", "fewer_seeds"),
           lambda row: (str(row.result.verdict), row.fewer)),
    Column("MDE", against_baseline(lambda row: mde_text(row.result)), ("mde", "mde_sigma"),
           values_against_baseline(lambda row: (row.result.mde, row.result.mde_sigma))),
)


# ------------------------------------------------------------------ what each method trained


def _steps(row: Row) -> str:
    """Steps trained, with the planned ones where a run stopped short: ``600 of 1000``."""
    steps = [r.steps for r in row.runs]
    planned = [r.steps_planned for r in row.runs]
    short = any(s is not None and p is not None and s < p
                for s, p in zip(steps, planned, strict=True))
    return span(steps) + (f" of {span(planned)}" if short else "")


def _params(row: Row) -> str:
    return _fmt(row.runs[0].params if row.runs else None)


def _train_flops(row: Row) -> str:
    return _fmt(row.flops.train_flops_per_token if row.flops else None, 4)


def _flops_ratio(row: Row) -> str:
    return _fmt(row.flops.flops_ratio if row.flops else None, 4)


def _steps_values(row: Row) -> tuple[Any, ...]:
    steps = [r.steps for r in row.runs if r.steps is not None]
    planned = [r.steps_planned for r in row.runs if r.steps_planned is not None]
    return (min(steps, default=None), max(steps, default=None), max(planned, default=None))


def _tokens_values(row: Row) -> tuple[Any, ...]:
    tokens = [r.tokens for r in row.runs if r.tokens is not None]
    return min(tokens, default=None), max(tokens, default=None)


#: Table 2's "what each method trained" columns: steps, tokens, parameters and FLOPs.
TRAINED_COLUMNS: Final[tuple[Column, ...]] = (
    Column("method", _method, ("method",), lambda row: (row.result.method,)),
    Column("steps", _steps, ("steps_min", "steps_max", "steps_planned"), _steps_values),
    Column("tokens", lambda row: span([x.tokens for x in row.runs], count),
           ("tokens_min", "tokens_max"), _tokens_values),
    Column("params", _params, ("params",),
           lambda row: (row.runs[0].params if row.runs else None,)),
    Column("train FLOPs/token", _train_flops, ("train_flops_per_token",),
           lambda row: (row.flops.train_flops_per_token if row.flops else None,)),
    Column("FLOPs ×", _flops_ratio, ("flops_ratio",),
           lambda row: (row.flops.flops_ratio if row.flops else None,)),
)
