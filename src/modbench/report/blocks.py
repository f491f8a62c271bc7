"""The report's building blocks and how they are written: a report is a list of :class:`Block`
(heading, paragraph, list, table, figure), rendered once as markdown (:func:`to_markdown`) and
once as self-contained HTML (:func:`to_html`); :func:`fmt` formats a table cell.

The sections (:mod:`modbench.report.build`, :mod:`modbench.report.diagnostics`) each build
blocks from here; neither imports the other for them.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Block:
    """One piece of a report."""

    kind: str  # h1 | h2 | p | ul | table | img
    text: str = ""
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    path: Path | None = None
    items: list[str] = field(default_factory=list)


def fmt(v: Any, digits: int = 4) -> str:
    """A table cell: None and NaN as a dash, booleans as yes/no, integers with thousands
    separators, floats to ``digits`` decimals (significant digits when very small or large)."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if math.isinf(v):
            return "∞" if v > 0 else "−∞"
        return f"{v:.{digits}g}" if abs(v) < 1e-3 or abs(v) >= 1e5 else f"{v:.{digits}f}"
    return str(v)


def to_markdown(blocks: list[Block], out: Path) -> str:
    """``blocks`` as markdown; figure paths relative to the report folder ``out``."""
    lines: list[str] = []
    for b in blocks:
        if b.kind == "h1":
            lines += [f"# {b.text}", ""]
        elif b.kind == "h2":
            lines += [f"## {b.text}", ""]
        elif b.kind == "p":
            lines += [b.text, ""]
        elif b.kind == "ul":
            lines += [*(f"- {item}" for item in b.items), ""]
        elif b.kind == "table":
            lines.append("| " + " | ".join(b.header) + " |")
            lines.append("|" + "---|" * len(b.header))
            lines += ["| " + " | ".join(r) + " |" for r in b.rows]
            lines.append("")
        elif b.kind == "img" and b.path is not None:
            lines += [f"![{b.text}]({b.path.relative_to(out)})", ""]
    return "\n".join(lines)


def inline_html(text: str) -> str:
    """Markdown's inline code (`x`) and bold (**x**) as HTML, the rest escaped."""
    parts = html.escape(text).split("`")
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(f"<code>{part}</code>")
        else:
            bold = part.split("**")
            out.append("".join(f"<b>{b}</b>" if j % 2 else b for j, b in enumerate(bold)))
    return "".join(out)


def to_html(blocks: list[Block]) -> str:
    """``blocks`` as one self-contained HTML page (figures embedded as base64 PNG)."""
    body: list[str] = []
    for b in blocks:
        if b.kind in ("h1", "h2"):
            body.append(f"<{b.kind}>{inline_html(b.text)}</{b.kind}>")
        elif b.kind == "p":
            body.append(f"<p>{inline_html(b.text)}</p>")
        elif b.kind == "ul":
            body.append("<ul>" + "".join(f"<li>{inline_html(i)}</li>" for i in b.items)
                        + "</ul>")
        elif b.kind == "table":
            head = "".join(f"<th>{inline_html(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{inline_html(c)}</td>" for c in r) + "</tr>"
                           for r in b.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif b.kind == "img" and b.path is not None:
            data = base64.b64encode(b.path.read_bytes()).decode()
            body.append(f"<figure><img alt='{html.escape(b.text)}' "
                        f"src='data:image/png;base64,{data}'><figcaption>"
                        f"{inline_html(b.text)}</figcaption></figure>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;"
             "padding:0 1em}table{border-collapse:collapse;margin:1em 0;font-size:13px}"
             "th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}"
             "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}"
             "img{max-width:100%}code{font-size:12px}")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>modbench report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")
