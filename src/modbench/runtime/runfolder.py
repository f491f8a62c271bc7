"""The files of a run folder, their names and readers (docs/runs.md has the formats)::

    RUN/config.yaml            the fully resolved config, then ``meta`` (code version, slots)
    RUN/metrics.jsonl          one JSON object per line: train steps and validation points
    RUN/summary.json           written once, at the end (status completed | diverged | stalled)
    RUN/eval.json              ``modbench eval`` (validation loss, probes, harness tasks)
    RUN/checkpoints/last.pt    the latest checkpoint
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import platform
import resource
import subprocess
from pathlib import Path
from typing import IO, Any

import torch

import modbench
from modbench.errors import ModbenchError

CONFIG = Path("config.yaml")
METRICS = Path("metrics.jsonl")
SUMMARY = Path("summary.json")
#: summary.json's keys that measure this process's time, not the run's result: two runs with
#: equal results differ in these only
SUMMARY_TIMINGS = ("tokens_per_s", "train_time_s", "val_time_s", "first_step_s")
EVAL = Path("eval.json")
CHECKPOINT = Path("checkpoints") / "last.pt"

# The offline probes (modbench.eval.probes), as named in eval.json's "tasks" and in the
# "probes" of metrics.jsonl's validation records; their mean is the study metric probe_avg.
PROBES = ("mqar", "induction", "cloze")


def code_version() -> dict[str, Any]:
    """What produced a run: modbench's version and git commit, torch and Python."""
    git = None
    with contextlib.suppress(Exception):
        here = Path(modbench.__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            git = out.stdout.strip()
    return {"modbench": modbench.__version__, "git_commit": git, "torch": str(torch.__version__),
            "python": platform.python_version()}


class MetricsLog:
    """``metrics.jsonl``, appended one record a line and flushed at once. A resumed run first
    cuts the file back to ``truncate_at`` bytes: the log as of its checkpoint.

    A record the file system refuses (a full disk, a quota, an I/O error) is not left half
    written: the log is cut back to the record before it and closed, and the write raises a
    :class:`~modbench.errors.ModbenchError` of one line (:func:`write_failure`). The folder is
    remembered (:func:`runs_written`) for the line an interrupted command prints."""

    def __init__(self, path: Path, truncate_at: int | None = None) -> None:
        self.path = Path(path)
        if truncate_at is not None:
            with open(path, "r+b") as f:
                f.truncate(truncate_at)
        self._file: IO[str] = open(path, "a")  # noqa: SIM115 - closed by close()
        _RUNS_WRITTEN.append(self.path.parent)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False) + "\n"
        start = self._file.tell()
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            self._abandon(start)
            raise write_failure(e, self.path, f"the log is kept whole up to step "
                                f"{_last_step(self.path)}, and the run's last checkpoint "
                                "resumes it once there is room") from None

    def _abandon(self, size: int) -> None:
        """Close the file without its unwritten buffer and cut it back to ``size`` bytes (a
        record cut short by the failed write goes; shrinking a file needs no space)."""
        with contextlib.suppress(OSError):
            self._file.close()  # its flush fails again, but the descriptor is closed
        with contextlib.suppress(OSError):
            os.truncate(self.path, size)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


#: the run folders whose metrics log this process opened (:func:`runs_written`)
_RUNS_WRITTEN: list[Path] = []


def runs_written(since: int = 0) -> list[Path]:
    """The run folders this process has trained into (opened a metrics log in), in order,
    each once; ``since``: only those opened after the first ``since`` openings
    (:func:`runs_mark`). What an interrupted ``modbench train`` reports (``modbench.cli``)."""
    return list(dict.fromkeys(_RUNS_WRITTEN[since:]))


def runs_mark() -> int:
    """The count of metrics logs opened so far: :func:`runs_written`'s ``since`` for what a
    command about to start opens."""
    return len(_RUNS_WRITTEN)


def _last_step(path: Path) -> int:
    """The step of the last whole record of a metrics log (0: none)."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
        for line in reversed(f.read().decode(errors="replace").splitlines()):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                return int(json.loads(line)["step"])
    return 0


# ------------------------------------------------------------------ failed writes

#: what each errno of a refused write means, in words
_WRITE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file size limit was reached",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "the storage reported an I/O error",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
}
#: below this many free bytes a failed write is put down to a full disk
FULL_BELOW = 1 << 20


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged process may still write on the file system of ``path`` (or of
    its nearest existing parent); None where that cannot be asked."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def is_storage_error(error: BaseException) -> bool:
    """An ``OSError`` whose errno says the storage refused a write (full, quota, size limit,
    read-only, I/O error, permissions): what the command line reports in one line."""
    return isinstance(error, OSError) and error.errno in _WRITE_ERRNOS


def is_torch_write_error(error: BaseException) -> bool:
    """The ``RuntimeError`` ``torch.save`` raises when its writes fail (a full disk gives
    "[enforce fail at inline_container.cc] unexpected pos", or "file write failed"): no
    errno, so :func:`write_problem` asks the file system instead."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        k in text for k in ("inline_container", "PytorchStreamWriter", "file write failed"))


def write_problem(error: BaseException, path: Path, written: int | None = None) -> str:
    """What stopped a write to ``path``, in words: from the errno of an ``OSError``; for
    torch's errno-less ``RuntimeError``, from the free space left (below :data:`FULL_BELOW`:
    the disk is full) or the process's file size limit (``written``: the bytes the file
    reached)."""
    free = free_bytes(path)
    room = "" if free is None else f", {free / 1e6:.1f} MB free"
    if isinstance(error, OSError):
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{_WRITE_ERRNOS[error.errno]} ({error.strerror}{room})"
        if error.errno in _WRITE_ERRNOS:
            return f"{_WRITE_ERRNOS[error.errno]} ({error.strerror})"
        return f"the write failed ({error.strerror or error})"
    if free is not None and free < FULL_BELOW:
        return f"the disk is full (torch.save could not write{room})"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and written is not None and written >= limit - 65536:
        return f"the file size limit was reached (ulimit -f: {limit} bytes)"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"the write failed (torch: {first[:100]}{room})"


def write_failure(error: BaseException, path: Path, kept: str,
                  written: int | None = None) -> ModbenchError:
    """The one line for a write to ``path`` that failed: what failed (:func:`write_problem`),
    where, and ``kept``: what is kept and how to go on."""
    return ModbenchError(f"cannot write {path}: {write_problem(error, path, written)}; {kept}")


def read_metrics(run: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl`` (none when the file is missing); ``upto``:
    only its first ``upto`` bytes (the log as of a checkpoint's ``metrics_offset``)."""
    path = Path(run) / METRICS
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        text = f.read(-1 if upto is None else upto).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def val_points(records: list[dict[str, Any]]) -> list[tuple[int, float | None]]:
    """The (step, validation loss) of each validation record, in log order."""
    return [(int(r["step"]), r.get("val_loss")) for r in records if r.get("kind") == "val"]


CURVES = ("loss", "grad_norm", "val_loss")  # per-step fields of metrics.jsonl records


def curves(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Training loss, grad norm and validation loss against step, from ``metrics.jsonl``, and
    ``probe:NAME`` for each held-out probe scored at validation (``train.eval_probes``)."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in CURVES}
    for rec in read_metrics(run):
        found = {k: rec.get(k) for k in CURVES}
        if rec.get("kind") == "val" and isinstance(rec.get("probes"), dict):
            found.update({f"probe:{k}": v for k, v in rec["probes"].items()})
        for k, v in found.items():
            if isinstance(v, int | float) and math.isfinite(v):
                out.setdefault(k, []).append((int(rec["step"]), float(v)))
    return out
