"""A study's one inductor cache (``<study>/.cache/inductor``): set for its workers and runs
before they start, a cache the user chose kept, this process's environment restored."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modbench.study.runner import COMPILE_CACHE, share_compile_cache

KEY = "TORCHINDUCTOR_CACHE_DIR"


def test_the_study_cache_is_set_then_restored(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY, raising=False)
    restore = share_compile_cache(tmp_path / "study")
    assert os.environ[KEY] == str((tmp_path / "study" / COMPILE_CACHE).resolve())
    assert not (tmp_path / "study").exists()  # nothing written: inductor makes it when used
    restore()
    assert KEY not in os.environ


def test_a_cache_the_user_set_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY, str(tmp_path / "mine"))
    restore = share_compile_cache(tmp_path / "study")
    assert os.environ[KEY] == str(tmp_path / "mine")
    restore()
    assert os.environ[KEY] == str(tmp_path / "mine")
