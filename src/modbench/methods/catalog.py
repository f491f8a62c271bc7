"""The method catalog: what ``modbench methods`` lists, read without importing torch.

``catalog.json`` (next to this file) holds every registered method's :meth:`Method.info`
and the sha256 of each Python file of this package that can shape it (every file but
``__init__.py``, ``build.py`` and this one). :func:`method_rows` returns its rows
while those files are unchanged; when one was added, edited or removed since the catalog was
written, it lists the live registry instead (:func:`~modbench.methods.base.load_all`, which
imports torch) and says so, so the listing is never stale, only slower.

Rewrite it after adding or changing a method::

    python -m modbench.methods.catalog

``tests/methods/test_catalog.py`` fails while it is out of date.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CATALOG_FILE = Path(__file__).with_name("catalog.json")
REWRITE = "python -m modbench.methods.catalog"
# files of this package that register no method and play no part in Method.info()
NOT_HASHED = ("__init__.py", "build.py", "catalog.py", "options.py", "plugins.py",
              "registry.py")


def source_hashes() -> dict[str, str]:
    """sha256 of the ``.py`` files of this package that can change the catalog (the method
    modules, ``base.py`` and the shared ``_*.py`` helpers), by file name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(__file__).parent.glob("*.py"))
        if p.name not in NOT_HASHED
    }


def live_rows() -> list[dict[str, Any]]:
    """The registry's ``info()`` rows, sorted by name, as JSON would give them back (methods
    registered from outside this package, such as a test's, left out). Imports torch."""
    from modbench.methods.base import load_all

    rows = [cls.info() for name, cls in sorted(load_all().items())
            if cls.__module__.startswith(f"{__package__}.")]
    return json.loads(json.dumps(rows))  # type: ignore[no-any-return]


def read_catalog(path: Path | None = None) -> dict[str, Any] | None:
    """The catalog file's contents (default :data:`CATALOG_FILE`), or None when it is missing
    or unreadable."""
    try:
        data = json.loads((path or CATALOG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("methods"), list):
        return None
    return data


def is_current(data: dict[str, Any] | None) -> bool:
    """Whether ``data`` was written from this package's files as they are now."""
    return data is not None and data.get("sources") == source_hashes()


def method_rows() -> tuple[list[dict[str, Any]], bool]:
    """The methods' info rows and whether they came from the catalog (True) or from the live
    registry because the catalog is missing or out of date (False)."""
    data = read_catalog()
    if data is not None and is_current(data):
        return list(data["methods"]), True
    return live_rows(), False


def write_catalog(path: Path | None = None) -> dict[str, Any]:
    """Write the catalog (default :data:`CATALOG_FILE`) from the live registry, atomically,
    and return it."""
    from modbench.fsutil import atomic_write_text

    data = {
        "note": f"Written by `{REWRITE}` from the method registry; do not edit by hand.",
        "sources": source_hashes(),
        "methods": live_rows(),
    }
    atomic_write_text(path or CATALOG_FILE, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data


if __name__ == "__main__":
    written = write_catalog()
    print(f"wrote {CATALOG_FILE}: {len(written['methods'])} methods")
