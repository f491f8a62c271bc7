"""Filesystem helpers: the cache directory and atomic writes."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from modbench.errors import ModbenchError
from modbench.fsutil import umask

CACHE_ENV = "MODBENCH_CACHE"


def cache_dir() -> Path:
    """Return the modbench cache directory, creating it if needed.

    ``$MODBENCH_CACHE`` when set (and non-empty), else ``~/.cache/modbench``.
    """
    env = os.environ.get(CACHE_ENV, "").strip()
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "modbench"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModbenchError(
            f"cannot create the cache directory {path} ({exc.strerror}); "
            f"set {CACHE_ENV} to a writable directory"
        ) from exc
    return path


def make_tmp_dir_next_to(target: Path) -> Path:
    """Create a fresh hidden temporary directory in ``target``'s parent directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700; the final dir should not be
    return tmp


def remove_tree(path: Path) -> None:
    """Remove a directory tree, ignoring errors (used for cleanup on failure)."""
    shutil.rmtree(path, ignore_errors=True)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's contents."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
