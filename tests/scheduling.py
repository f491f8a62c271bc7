"""The order in which ``-n 2 --dist loadfile`` hands test files to its workers: longest first.

pytest-xdist's ``loadfile`` gives each worker the next file of its queue when the worker is
almost out of tests, and orders that queue by each file's number of tests (most first). Our
slowest files have few tests (a kill-and-resume sweep, a study killed at every point, the GPU
acceptance script's dry path: one to three tests of a minute or more each), so they came last
and one worker ran them alone while the other had finished: the suite's tail. Handing out the
longest file first (the classic longest-processing-time rule) keeps both workers busy to the
end.

A file's expected seconds come from ``tests/durations.json`` (per-file totals of a whole run
on the 2-core machine; ``python -m tests.scheduling JUNIT.xml`` writes it from a run's
``--junitxml`` report, ``-o junit_family=xunit1``); a file it does not list counts
:data:`UNKNOWN_TEST_S` a test. Only the order changes: every file still runs whole in one
worker, and a stale or missing table only makes the order worse, never a test wrong.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DURATIONS = Path(__file__).with_name("durations.json")

#: the seconds a test of a file missing from the table is expected to take (the suite's median
#: file is a few seconds for a handful of tests)
UNKNOWN_TEST_S = 0.5


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """The per-file seconds table, empty when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}


def scope_file(scope: str) -> str:
    """A loadfile scope (a nodeid's file part, maybe prefixed by the rootdir) as the table's
    key: the path from ``tests/`` on."""
    scope = scope.replace("\\", "/")
    cut = scope.rfind("tests/")
    return scope[cut:] if cut >= 0 else scope


def expected_seconds(scope: str, tests: int, durations: Mapping[str, float]) -> float:
    """A file's expected seconds: its table entry, else :data:`UNKNOWN_TEST_S` a test."""
    return durations.get(scope_file(scope), UNKNOWN_TEST_S * tests)


def longest_first(workqueue: Mapping[str, Mapping[str, Any]],
                  durations: Mapping[str, float]) -> str:
    """The scope to hand out next: the longest expected one (ties: the queue's order, as
    ``max`` keeps the first)."""
    return max(workqueue, key=lambda scope: expected_seconds(scope, len(workqueue[scope]),
                                                             durations))


def make_scheduler(config: Any, log: Any, table: Path = DURATIONS) -> Any:
    """xdist's ``loadfile`` scheduler, handing out the longest expected file first (by
    ``table``)."""
    from xdist.scheduler import LoadFileScheduling

    durations = load_durations(table)

    class LongestFileFirst(LoadFileScheduling):  # type: ignore[misc]
        def _assign_work_unit(self, node: Any) -> None:
            if self.workqueue:
                self.workqueue.move_to_end(longest_first(self.workqueue, durations),
                                           last=False)
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


def durations_from_junit(path: Path) -> dict[str, float]:
    """Per-file total seconds (setup, call and teardown) of a ``--junitxml`` report written
    with ``-o junit_family=xunit1`` (whose test cases carry their ``file``)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file")
        if file:
            totals[scope_file(file)] += float(case.get("time") or 0.0)
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.scheduling JUNIT.xml  (writes tests/durations.json)",
              file=sys.stderr)
        return 2
    table = durations_from_junit(Path(argv[0]))
    DURATIONS.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{DURATIONS}: {len(table)} files, {sum(table.values()):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
