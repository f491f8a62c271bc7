"""The report's curves at a glance: one colour per method (its seeds thin lines of it),
smoothed curves over faint raw ones, the legend outside the axes, the unigram level marked;
and the Table-2 view split so that neither of its tables is wider than a 1,400-pixel window."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from modbench.report import plots
from modbench.report.build import write_report
from tests.report.test_report import fake_results


def test_method_of_and_one_colour_per_method() -> None:
    assert plots.method_of("post_ln+comt/s2") == "post_ln+comt"
    assert plots.method_of("layerscale(init=1e-4)/s10") == "layerscale(init=1e-4)"
    assert plots.method_of("mqar") == "mqar" and plots.method_of("a/sx") == "a/sx"
    methods = ["baseline", *(f"m{i}" for i in range(12))]
    colours = plots.method_colours(methods, "baseline")
    assert colours["baseline"] == "#000000"
    assert len(set(colours.values())) == len(methods)  # tab20 beyond ten methods


def test_smoothed_is_a_trailing_mean() -> None:
    assert plots.smoothed([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    geo = plots.smoothed([1.0, 100.0], 2, log=True)
    assert geo[0] == pytest.approx(1.0) and geo[1] == pytest.approx(10.0)


def _drawn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **kw: Any) -> Figure:
    """The figure curves_plot draws for 3 seeds of baseline, 2 of post_ln, 1 of mix_ln
    (200 steps: smoothed over 8 points)."""
    got: dict[str, Figure] = {}

    def keep(fig: Figure, path: Path) -> Path:
        got["fig"] = fig
        return path

    monkeypatch.setattr(plots, "_save", keep)
    series = {f"{m}/s{s}": [(i, 6.0 - 0.01 * i * (k + 1) + 0.1 * math.sin(i))
                            for i in range(1, 201)]
              for k, (m, n) in enumerate((("baseline", 3), ("post_ln", 2), ("mix_ln", 1)))
              for s in range(n)}
    plots.curves_plot(series, "t", "loss", tmp_path / "x.png", baseline="baseline", **kw)
    return got["fig"]


def test_curves_one_colour_per_method_smoothed_legend_outside(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fig = _drawn(monkeypatch, tmp_path, level=5.95, level_label="unigram level (3 stalled)")
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
    assert len(lines) == 2 * 6  # each seed: a faint raw line and its smoothed line
    by_colour: dict[str, list[Any]] = {}
    for ln in lines:
        by_colour.setdefault(str(ln.get_color()), []).append(ln)
    others = plots.method_colours(["mix_ln", "post_ln"])  # in the legend's (sorted) order
    assert {c: len(v) for c, v in by_colour.items()} == {
        "#000000": 6, others["post_ln"]: 4, others["mix_ln"]: 2}
    faint = [ln for ln in lines if (ln.get_alpha() or 1) < 0.5]
    assert len(faint) == 6
    raw = faint[0].get_ydata()
    smooth = next(ln for ln in lines if ln not in faint).get_ydata()
    assert list(smooth) == pytest.approx(plots.smoothed(list(raw), 200 // 25))
    (level,) = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert set(level.get_ydata()) == {5.95}
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "baseline (3 seeds)", "mix_ln (1 seed)", "post_ln (2 seeds)", "unigram level (3 stalled)"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    assert legend.get_window_extent(renderer).x0 > ax.get_window_extent(renderer).x1


def test_short_curves_are_drawn_raw(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    got: dict[str, Figure] = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: got.setdefault("fig", fig) and path)
    plots.curves_plot({"a/s0": [(0, 1.0), (3, 0.5)], "a/s1": []}, "t", "acc", tmp_path / "p.png")
    (line,) = got["fig"].axes[0].get_lines()
    assert list(line.get_ydata()) == [1.0, 0.5] and (line.get_alpha() or 1) > 0.5


def _min_content_px(table: str) -> float:
    """A table's narrowest width: per column its longest unbreakable word (13 px text, about
    7.3 px a character, 7.8 in bold headers) plus 15 px of padding and border."""
    head = [re.sub("<.*?>", "", c) for c in re.findall(r"<th>(.*?)</th>", table)]
    rows = [[re.sub("<.*?>", "", c) for c in re.findall(r"<td>(.*?)</td>", r)]
            for r in re.findall(r"<tr>(.*?)</tr>", table.split("</thead>")[1])]
    total = 0.0
    for j, h in enumerate(head):
        w = max((len(x) * 7.8 for x in h.split()), default=0.0)
        for r in rows:
            w = max([w, *(len(x) * 7.3 for x in r[j].split())])
        total += w + 15
    return total


def test_table2_is_split_and_fits(tmp_path: Path) -> None:
    """The verdict's columns and what was trained in two tables, each narrower than the
    report's 1,100-pixel body (a 1,400-pixel window), where the one table was wider."""
    res = fake_results(tmp_path, {"baseline": 3, "post_ln+comt": 3, "ln_scaling": 2})
    page = (write_report(res, tmp_path / "report") / "report.html").read_text()
    section = page.split("Table 2 view")[1].split("<h2>")[0]
    tables = re.findall(r"<table>(.*?)</table>", section)
    assert len(tables) == 2
    assert tables[0].count("<th>") == 13 and tables[1].count("<th>") == 6
    assert "FLOPs" not in tables[0] and "verdict" not in tables[1]
    widths = [_min_content_px(t) for t in tables]
    assert max(widths) < 1100
    assert sum(widths) - 15 - 7.8 * len("method") > 1100  # as one table it would not fit
