"""The method catalog (what `modbench methods` lists without importing torch) equals the live
registry, and a catalog out of date is never shown."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from modbench.cli import run_cli
from modbench.methods import catalog
from modbench.methods.base import load_all


def test_catalog_is_current() -> None:
    """Fails after a method is added or edited without `python -m modbench.methods.catalog`."""
    data = catalog.read_catalog()
    assert data is not None, f"{catalog.CATALOG_FILE} is missing; run `{catalog.REWRITE}`"
    assert data["sources"] == catalog.source_hashes(), (
        f"a file of modbench/methods changed since the catalog was written; "
        f"run `{catalog.REWRITE}`")
    assert catalog.is_current(data)


def test_catalog_equals_the_live_registry() -> None:
    data = catalog.read_catalog()
    assert data is not None
    live = {name: cls for name, cls in load_all().items()
            if cls.__module__.startswith("modbench.methods.")}
    assert [r["name"] for r in data["methods"]] == sorted(live)
    for row in data["methods"]:
        cls = live[row["name"]]
        assert row == json.loads(json.dumps(cls.info())), row["name"]
        assert (row["category"], row["summary"], row["citation"]) == (
            cls.category, cls.summary, cls.citation)


def test_an_out_of_date_catalog_falls_back_to_the_registry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "catalog.json"
    shutil.copy(catalog.CATALOG_FILE, stale)
    data = json.loads(stale.read_text())
    data["sources"]["qknorm.py"] = "0" * 64  # as if qknorm.py had been edited since
    data["methods"] = data["methods"][:3]  # and its listing were short
    stale.write_text(json.dumps(data))
    monkeypatch.setattr(catalog, "CATALOG_FILE", stale)
    rows, current = catalog.method_rows()
    assert not current and rows == catalog.live_rows() and len(rows) > 3
    assert run_cli(["methods", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [r["name"] for r in json.loads(out)] == [r["name"] for r in rows]
    assert "catalog is out of date" in err and catalog.REWRITE in err
    stale.unlink()  # missing: the same
    assert catalog.method_rows() == (rows, False)


def test_write_catalog_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "catalog.json"
    written = catalog.write_catalog(out)
    assert catalog.read_catalog(out) == written
    assert written["methods"] == catalog.live_rows()
