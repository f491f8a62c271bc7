"""The record of a prepared dataset's verified files: a corpus is hashed once, not once per run.

Opening a dataset with ``verify`` checks every shard's sha256 (and the tokenizer file's),
which reads every byte: 46 GB for the 1.2B runs, at every start and every resume of every
run. ``verified.json`` in the dataset folder records, for each file whose sha256 passed, the
file's size, ``mtime_ns``, ``ctime_ns`` and inode at that check and the sha256 it had. A later
open accepts a file whose four values are unchanged and whose recorded sha256 is the one
``metadata.json`` names without reading it; any other file is hashed as before (and refused
when it fails, recorded when it passes). The record holds the dataset's fingerprint
(:meth:`~modbench.data.dataset.TokenDataset.fingerprint`): a changed manifest voids it.

Where the folder cannot be written (a shared read-only corpus) the record goes to the user's
cache (``cache_dir()/verified/``); where neither can be written nothing is recorded and
every open hashes as before: the record never makes an open fail. Concurrent runs each
write a whole record by atomic rename, so the last writer wins and no record is torn.

A file written less than :data:`RECENT_S` seconds before it was hashed is not recorded (its
timestamps may not yet tell a later write apart: coarse file-system clocks); the next open
hashes and records it.

**Known limit.** The record trusts the file system's metadata: bytes changed beneath it (a
disk's silent corruption, a block device written directly) or a file altered with its size,
mtime and ctime all restored (which takes setting the clock back) pass unseen. ``modbench
data verify`` (:meth:`~modbench.data.dataset.TokenDataset.verify`) always hashes every file,
whatever the record says.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from modbench.errors import ModbenchError
from modbench.fsutil import atomic_write_text

RECORD_FILE = "verified.json"
RECORD_FORMAT = "modbench-verified"
RECORD_VERSION = 1
RECENT_S = 5.0
_STAT_KEYS = ("size", "mtime_ns", "ctime_ns", "ino")


def _stat(path: Path) -> dict[str, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino}


def cache_record_path(folder: Path) -> Path | None:
    """Where the record of ``folder`` goes when the folder cannot be written: the user's
    cache, named by a hash of the folder's absolute path (None: no usable cache)."""
    from modbench.data._fs import cache_dir

    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    try:
        return cache_dir() / "verified" / f"{key}.json"
    except ModbenchError:
        return None


class VerifyRecord:
    """The verified files of one dataset folder: read at open, written once after it.

    ``trusted(name, sha256)`` says whether a file may be accepted unread; ``hashing(name,
    sha256)`` wraps a file's full check and records it when the check passes; ``save()``
    writes the record (never raising)."""

    def __init__(self, folder: Path, fingerprint: str) -> None:
        self.folder = folder
        self.fingerprint = fingerprint
        self._cache = cache_record_path(folder)
        places = [folder / RECORD_FILE] + ([self._cache] if self._cache else [])
        self._known = [self._read(p) for p in places]
        self._files: dict[str, dict[str, Any]] = {}

    def _read(self, path: Path) -> dict[str, dict[str, Any]]:
        """A record's files; empty when it is missing, unreadable, malformed or for another
        manifest (then every file is hashed, as without a record)."""
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        ok = (isinstance(rec, dict) and rec.get("format") == RECORD_FORMAT
              and rec.get("version") == RECORD_VERSION
              and rec.get("fingerprint") == self.fingerprint
              and isinstance(rec.get("files"), dict))
        return {k: v for k, v in rec["files"].items() if isinstance(v, dict)} if ok else {}

    def trusted(self, name: str, sha256: str) -> bool:
        """Whether file ``name`` is unchanged since a check recorded it with ``sha256``."""
        now = _stat(self.folder / name)
        for files in self._known:
            entry = files.get(name)
            if (now is not None and entry is not None and entry.get("sha256") == sha256
                    and all(entry.get(k) == now[k] for k in _STAT_KEYS)):
                self._files[name] = entry
                return True
        return False

    @contextlib.contextmanager
    def hashing(self, name: str, sha256: str) -> Iterator[None]:
        """Around the full check of file ``name``: when it passes (no exception), the file's
        stat from before the check is recorded, unless the file was written too recently
        for its timestamps to be trusted (:data:`RECENT_S`)."""
        before = _stat(self.folder / name)
        started = time.time_ns()
        yield
        if before is not None and before["mtime_ns"] < started - int(RECENT_S * 1e9):
            self._files[name] = {**before, "sha256": sha256}

    def save(self) -> None:
        """Write the record of the files trusted or checked by this open: in the dataset
        folder, else in the user's cache, else nowhere. Nothing is written when a record
        already says the same."""
        if not self._files or any(self._files == files for files in self._known):
            return
        text = json.dumps({"format": RECORD_FORMAT, "version": RECORD_VERSION,
                           "fingerprint": self.fingerprint, "files": self._files},
                          indent=1, sort_keys=True) + "\n"
        for place in (self.folder / RECORD_FILE, self._cache):
            if place is not None:
                with contextlib.suppress(OSError):
                    atomic_write_text(place, text)
                    return
