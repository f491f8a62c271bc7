"""Atomic file writes: a temporary file in the same folder, then ``os.replace``.

A crash mid-write leaves the previous file (or nothing) in place, never a torn one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@functools.lru_cache(maxsize=1)
def umask() -> int:
    """The process umask (read once: reading it means briefly setting it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path``, on any
    error it is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp_name, 0o666 & ~umask())  # mkstemp makes 0600; the final file should not be
        yield Path(tmp_name)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
