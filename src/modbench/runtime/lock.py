"""One writer per folder: an exclusive lock on a run or study folder (docs/reliability.md).

The lock is ``FOLDER/.modbench.lock``, held by ``fcntl.flock`` on an open descriptor, and
the file names its holder (PID, host, start time) for the message that refuses a second
writer. The kernel drops a flock when its holder dies, however it dies, so the lock of a
killed process is taken over by the next writer without any guess about whether the PID
in the file is still alive; the file's content is then rewritten with the new holder.

A writer that builds its output in a temporary folder and renames it into place
(``modbench export``, ``modbench remove-norm``) locks the name instead: ``beside=True``
puts the lock file next to the folder, ``PARENT/.NAME.modbench.lock``.

A released lock removes its file, and the folder too when the lock created it and it is
still empty. Acquiring checks that the file it locked is still the one at the path (a
holder releasing at that moment unlinks it), and tries again otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from modbench.errors import ModbenchError

LOCK_NAME = ".modbench.lock"


def lock_path(folder: str | Path, beside: bool = False) -> Path:
    """The lock file of ``folder`` (``beside``: next to it, for a folder renamed into place)."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}{LOCK_NAME}" if beside else folder / LOCK_NAME


def holder_of(path: Path) -> dict[str, object] | None:
    """What the lock file ``path`` says about its holder (None: no readable file)."""
    try:
        text = path.read_text()
        doc = json.loads(text)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class FolderLock:
    """An exclusive, non-blocking lock on ``folder`` for the writer ``what`` (e.g.
    ``"modbench train"``); a context manager, or :meth:`acquire` / :meth:`release`.

    A second writer gets a :class:`ModbenchError` naming the holder's PID and host."""

    def __init__(self, folder: str | Path, what: str = "modbench", *,
                 beside: bool = False) -> None:
        self.folder = Path(folder)
        self.path = lock_path(self.folder, beside)
        self.beside = beside
        self.what = what
        self.created = False  # the folder did not exist before this lock
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> FolderLock:
        if self._fd is not None:
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise ModbenchError(f"{self.folder} is a file, not a folder; choose another folder")
        home = self.path.parent
        if not home.exists():
            try:
                home.mkdir(parents=True)
                self.created = not self.beside
            except FileExistsError:
                pass
            except OSError as e:
                raise ModbenchError(f"cannot create {home} ({e.strerror}); choose a "
                                    "folder you can write") from None
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise ModbenchError(f"cannot lock {self.folder}: {self.path} cannot be opened "
                                    f"({e.strerror}); remove it if it is not a regular "
                                    "file") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ModbenchError(self._refusal()) from None
                raise ModbenchError(f"cannot lock {self.folder} ({e.strerror}); use a folder "
                                    "on a file system that supports flock") from None
            try:  # still the file at the path (not one a releasing holder just unlinked)?
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                self._write_holder()
                return self
            os.close(fd)
            time.sleep(0.01)
        raise ModbenchError(f"cannot lock {self.folder}: its lock file keeps changing; is "
                            "another writer starting and stopping there?")

    def _write_holder(self) -> None:
        assert self._fd is not None
        doc = {"pid": os.getpid(), "host": socket.gethostname(), "what": self.what,
               "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        data = (json.dumps(doc) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def _refusal(self) -> str:
        h = holder_of(self.path) or {}
        who = (f"{h.get('what', 'another modbench process')} (PID {h.get('pid', '?')} on host "
               f"{h.get('host', '?')}, since {h.get('since', '?')})")
        return (f"{self.folder} is in use by {who}; wait for it to finish or stop it, "
                "then try again")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            if same:
                self.path.unlink()
        os.close(fd)  # unlinked first: a waiting writer re-checks the path after its flock
        if self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only when empty: a set-up that failed left nothing

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
