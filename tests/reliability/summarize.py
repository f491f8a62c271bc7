"""Print the recorded reliability figures (tests/reliability/results/*.json) as a markdown
table: the numbers docs/reliability.md quotes.

    MODBENCH_RELIABILITY_RECORD=1 python -m pytest -q tests/reliability          # CI size
    MODBENCH_RELIABILITY_POINTS=300 MODBENCH_RELIABILITY_RECORD=1 \\
        python -m pytest -q -m slow tests/reliability                            # long run
    python -m tests.reliability.summarize
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
SKIP = {"test", "date", "long", "failures", "outcomes", "by_kind"}


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return "/".join(_fmt(x) for x in v)
    return str(v)


def main() -> int:
    files = sorted(RESULTS.glob("*.json"))
    if not files:
        print(f"no results in {RESULTS}; run the tests with MODBENCH_RELIABILITY_RECORD=1")
        return 1
    print("| test | run | date | figures | kill points by kind | failures |")
    print("|---|---|---|---|---|---|")
    for f in files:
        d = json.loads(f.read_text())
        figures = "; ".join(f"{k} {_fmt(v)}" for k, v in d.items() if k not in SKIP)
        print(f"| {d['test'].split('::')[-1]} | {'long' if d['long'] else 'CI'} | {d['date']} "
              f"| {figures} | {_fmt(d.get('by_kind', {}))} | {len(d.get('failures', []))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
