"""Shared fixtures: a private cache (no test touches ~/.cache) and small helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import torch_threads


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2``), the cores shared among the workers: each worker's torch
    and the processes its tests start get cores / workers threads, not all of them each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` hands out the longest test file first (tests/scheduling.py), so the
    slow files with few tests do not run last in one worker while the other idles."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.scheduling import make_scheduler

    return make_scheduler(config, log)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point MODBENCH_CACHE at one temporary folder for the whole session, so the built-in
    tokenizer and corpus are prepared once per test session and never read from $HOME.
    Under pytest-xdist the workers share it (the session's base folder, beside the workers'
    own): a corpus, tokenizer or dataset one worker prepared is read by the other instead of
    prepared again (~10-20 s for the corpus and the tiny tokenizer). Every entry is written
    whole or not at all (a temporary file or folder renamed into place), so workers preparing
    the same entry at once each get a whole one."""
    old = os.environ.get("MODBENCH_CACHE")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "modbench-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("modbench-cache")
    os.environ["MODBENCH_CACHE"] = str(path)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    yield path
    if old is None:
        os.environ.pop("MODBENCH_CACHE", None)
    else:
        os.environ["MODBENCH_CACHE"] = old


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test: tiny models run many small ops, and one thread is many
    times faster than two on a shared 2-core machine. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    with torch_threads(1):
        yield
