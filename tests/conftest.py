"""Shared fixtures: a private cache (no test touches ~/.cache) and small helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point MODBENCH_CACHE at one temporary folder for the whole session, so the built-in
    tokenizer and corpus are prepared once per test session and never read from $HOME."""
    old = os.environ.get("MODBENCH_CACHE")
    path = tmp_path_factory.mktemp("modbench-cache")
    os.environ["MODBENCH_CACHE"] = str(path)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    yield path
    if old is None:
        os.environ.pop("MODBENCH_CACHE", None)
    else:
        os.environ["MODBENCH_CACHE"] = old
