"""Table 2 is rendered from lists of columns (modbench.report.columns): a column added to the
list shows in report.md, header and cells together, and no table's header and rows disagree in
length."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from modbench.analysis.results import RunRow, StudyResults, compare_scales
from modbench.report.build import write_report
from modbench.report.columns import (
    METRIC,
    TRAINED_COLUMNS,
    VERDICT_COLUMNS,
    Column,
    Row,
    rows_at,
    table,
)


def results(tmp: Path, seeds: dict[str, int]) -> StudyResults:
    """A study by hand at scale "tiny": ``seeds[method]`` finished runs, val_loss around 3
    (method "b" 0.1 worse), no run folders."""
    rng = np.random.default_rng(3)
    rows = [RunRow(key=f"{m}-{s}", scale="tiny", method=m, seed=s, state="done",
                   status="completed", params=10**6, tokens=10**7, diverged_at_step=None,
                   steps=100, steps_planned=100,
                   val_loss=3.0 + (0.1 if m == "b" else 0.0) + 0.01 * float(rng.standard_normal()))
            for m, n in seeds.items() for s in range(n)]
    return StudyResults(name="cols", folder=tmp, baseline="baseline", metric="val_loss",
                        anchors=[], rows=rows,
                        comparisons=compare_scales(rows, "baseline", "val_loss", [], looks={}))


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(md: str) -> list[list[list[str]]]:
    """Every markdown table of ``md``: its lines' cells, the header first (no separator)."""
    out: list[list[list[str]]] = []
    lines = md.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            out.append([])
        if line.startswith("|") and not line.startswith("|---"):
            out[-1].append(cells(line))
    return out


def test_an_added_column_shows_in_the_report(tmp_path: Path) -> None:
    res = results(tmp_path, {"baseline": 3, "a": 3, "b": 2})

    def not_better(row: Row) -> str:
        return "" if row.result.is_baseline else f"{row.result.prob_not_better:.3f}"

    extra = Column("P(not better)", not_better)
    runs = Column("runs read", lambda row: str(len(row.runs)))
    md = (write_report(res, tmp_path / "report", columns=[*VERDICT_COLUMNS, extra],
                       trained_columns=[*TRAINED_COLUMNS, runs]) / "report.md").read_text()
    verdicts, trained = tables(md.split("## Methods against the baseline")[1])[:2]
    assert verdicts[0][-2:] == ["MDE", "P(not better)"] and verdicts[0][2] == "val_loss"
    assert trained[0][-1] == "runs read"
    by_method = {r.method: r for r in res.comparisons["tiny"]}
    assert [line[0] for line in verdicts[1:]] == ["`baseline`", "`a`", "`b`"]
    for line in verdicts[1:]:
        r = by_method[line[0].strip("`")]
        assert line[-1] == ("" if r.is_baseline else f"{r.prob_not_better:.3f}")
    assert {line[0]: line[-1] for line in trained[1:]} == {
        "`baseline`": "3", "`a`": "3", "`b`": "2"}
    # the default report has neither
    plain = (write_report(res, tmp_path / "plain") / "report.md").read_text()
    assert "P(not better)" not in plain and "runs read" not in plain
    assert plain.split("## Methods")[0] == md.split("## Methods")[0]


def test_a_removed_column_takes_its_header_and_cells(tmp_path: Path) -> None:
    res = results(tmp_path, {"baseline": 3, "a": 3})
    without_z = [c for c in VERDICT_COLUMNS if c.header != "z"]
    md = (write_report(res, tmp_path / "report", columns=without_z) / "report.md").read_text()
    verdicts = tables(md.split("## Methods against the baseline")[1])[0]
    assert "z" not in verdicts[0] and len(verdicts[0]) == len(VERDICT_COLUMNS) - 1
    a = next(line for line in verdicts if line[0] == "`a`")
    assert a[4] == "pooled t"  # the test column moved left into z's place


def test_every_table_has_as_many_cells_as_headers(tmp_path: Path) -> None:
    res = results(tmp_path, {"baseline": 3, "a": 3, "b": 1})
    rows = rows_at(res, "tiny")
    assert [r.result.method for r in rows] == ["baseline", "a", "b"]
    for columns in (VERDICT_COLUMNS, TRAINED_COLUMNS):
        block = table(columns, rows, res.metric)
        assert len(block.header) == len(columns)
        assert [len(cells) for cells in block.rows] == [len(columns)] * len(rows)
    assert table(VERDICT_COLUMNS, rows, "climb_avg").header[2] == "climb_avg"
    assert VERDICT_COLUMNS[2].header == METRIC
    md = (write_report(res, tmp_path / "report") / "report.md").read_text()
    found = tables(md)
    assert len(found) >= 3  # the verdicts, what was trained, all metrics
    for t in found:
        assert {len(line) for line in t} == {len(t[0])}
