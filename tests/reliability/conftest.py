"""Fixtures of the reliability tests: the forkserver that children are forked from, the
number of cases to try, and the record of what was tried (docs/reliability.md).

CI runs a bounded number of cases. The long variants (``@pytest.mark.slow``) run only when
``MODBENCH_RELIABILITY_POINTS`` is set; it is the number of training kill points, and the
other fault classes scale with it::

    MODBENCH_RELIABILITY_POINTS=300 MODBENCH_RELIABILITY_RECORD=1 \\
        python -m pytest -q -m slow tests/reliability

With ``MODBENCH_RELIABILITY_RECORD=1`` every test writes what it tried and how it came out
to ``tests/reliability/results/<test>.json`` (``python -m tests.reliability.summarize``
prints them as the tables of docs/reliability.md).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).parent / "results"
POINTS_ENV = "MODBENCH_RELIABILITY_POINTS"
RECORD_ENV = "MODBENCH_RELIABILITY_RECORD"


def long_points() -> int:
    """Training kill points of the long local run (0: not asked for)."""
    raw = os.environ.get(POINTS_ENV, "").strip()
    return int(raw) if raw else 0


def long_variant(fn: Callable[..., Any]) -> Any:
    """A long variant: marked slow, and skipped unless MODBENCH_RELIABILITY_POINTS is set."""
    skip = pytest.mark.skipif(not long_points(), reason=f"long variant: set {POINTS_ENV}")
    return pytest.mark.slow(skip(fn))

PRELOAD = ["tests.reliability.harness", "modbench.train.trainer", "modbench.cli",
           "modbench.study.runner", "modbench.study.results", "modbench.report.build",
           "modbench.eval.run", "modbench.eval.probes"]


@pytest.fixture(scope="session")
def forkserver(_private_cache: Path) -> Any:
    """A multiprocessing context whose children fork from a server that has imported torch
    and modbench once (and done nothing else: no thread pools), with the tiny preset's
    built-in data prepared in the shared cache before it starts."""
    if platform.system() != "Linux":
        pytest.skip("the kill tests use fork and /proc (Linux)")
    from modbench.data import builtin_dataset

    builtin_dataset(512, 64, progress=False)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[dict[str, Any]], None]:
    """``record(figures)``: keep this test's figures (with the env var set) for the docs."""

    def write(figures: dict[str, Any]) -> None:
        if not os.environ.get(RECORD_ENV):
            return
        RESULTS.mkdir(exist_ok=True)
        name = request.node.name.replace("[", "-").replace("]", "")
        doc = {"test": request.node.nodeid, "date": time.strftime("%Y-%m-%d"),
               "long": request.node.originalname.endswith("_long"), **figures}
        (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")

    return write
