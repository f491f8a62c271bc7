"""Child-process side of the reliability tests: train or run a study in a process that
SIGKILLs itself at a chosen point, and the checks the parent runs afterwards.

Children are forked from a forkserver that has imported torch and modbench once (see
``conftest.forkserver``), so a kill point costs a fork, not an interpreter start; each child
is still a separate process that dies by SIGKILL, with nothing flushed or cleaned up. The
few ``python -m modbench`` cases in the tests cover the real command line the same way.

Kill points (``kill`` dicts) hook only stable, low-level calls, never the trainer's internals:

========================  ==============================================================
``after_write`` n          right after the n-th line of metrics.jsonl is written (a step or
                           a validation just ended)
``mid_write`` n, frac      inside the n-th metrics.jsonl write: part of the line is on disk
``ckpt_torn`` n, frac      inside the n-th checkpoint write: ``frac`` of the temporary file
                           is on disk, the rename never happens
``ckpt_unrenamed`` n       the n-th checkpoint's temporary file complete, not yet renamed
``ckpt_renamed`` n         right after the n-th checkpoint is in place
``replace`` name, n        before the n-th atomic rename onto a file called ``name``
                           (config.yaml, summary.json, eval.json, report files ...)
``eval`` n                 inside evaluation, when the n-th probe set is scored
``store`` op, n, when      before or after the n-th ``Store.<op>`` (claim, finish) call
========================  ==============================================================

The parent may also kill a child from outside after a random delay (``timer``).
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from modbench.config import from_dict
from modbench.methods import load_all
from modbench.runtime.callback import Callback
from modbench.runtime.runfolder import MetricsLog

load_all()  # imported once in the forkserver (torch._dynamo alone takes 1.5 s)



def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached


class Counter:
    """Counts the hooked events of this process (written to ``path`` at exit by the child)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def tick(self, what: str) -> int:
        self.counts[what] = self.counts.get(what, 0) + 1
        return self.counts[what]


def install(kill: dict[str, Any] | None, counter: Counter) -> None:
    """Patch the hooked calls of this (child) process so that it dies at ``kill``."""
    kind = (kill or {}).get("kind")
    n = (kill or {}).get("n", 0)
    frac = (kill or {}).get("frac", 0.5)

    write = MetricsLog.write

    def hooked_write(self: MetricsLog, record: dict[str, Any]) -> None:
        i = counter.tick("write")
        if i == n and kind == "mid_write":
            line = json.dumps(record, allow_nan=False) + "\n"
            self._file.write(line[: max(1, int(len(line) * frac))])
            self._file.flush()
            _die()
        write(self, record)
        if i == n and kind == "after_write":
            _die()

    MetricsLog.write = hooked_write  # type: ignore[method-assign]

    save = torch.save

    def hooked_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        i = counter.tick("save")
        if i == n and kind == "ckpt_torn":
            buf = io.BytesIO()
            save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            with open(f, "wb") as fh:
                fh.write(data[: int(len(data) * frac)])
                fh.flush()
                os.fsync(fh.fileno())
            _die()
        save(obj, f, *args, **kwargs)
        if i == n and kind == "ckpt_unrenamed":
            _die()

    torch.save = hooked_save

    replace = os.replace

    def hooked_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        name = Path(dst).name
        i = counter.tick(f"replace:{name}")
        if kind == "replace" and name == kill.get("name") and i == n:  # type: ignore[union-attr]
            _die()
        replace(src, dst, *args, **kwargs)
        if kind == "ckpt_renamed" and name == "last.pt" and i == n:
            _die()

    os.replace = hooked_replace

    import modbench.eval.run as eval_run

    score = eval_run.score

    def hooked_score(*args: Any, **kwargs: Any) -> Any:
        i = counter.tick("eval")
        if kind == "eval" and i == n:
            _die()
        return score(*args, **kwargs)

    eval_run.score = hooked_score  # type: ignore[assignment]

    from modbench.study.store import Store

    for op in ("claim", "finish"):
        real = getattr(Store, op)

        def hooked(self: Store, *args: Any, _op: str = op, _real: Any = real,
                   **kwargs: Any) -> Any:
            i = counter.tick(_op)
            hit = kind == "store" and kill.get("op") == _op and i == n  # type: ignore[union-attr]
            if hit and kill.get("when") == "before":  # type: ignore[union-attr]
                _die()
            out = _real(self, *args, **kwargs)
            if hit:
                _die()
            return out

        setattr(Store, op, hooked)


class StartStep(Callback):
    """Records the step a (resumed) run starts from."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, run: Any) -> None:
        self.path.write_text(json.dumps({"start_step": run.step}))


def train_child(cfg: dict[str, Any], out: str, resume: bool, kill: dict[str, Any] | None,
                report: str | None) -> None:
    """Train ``cfg`` into ``out`` (resuming), dying at ``kill``; write what happened to
    ``report`` (start step, event counts, wall time) when it finishes."""
    from modbench.train.trainer import train

    torch.set_num_threads(1)
    counter = Counter()
    install(kill, counter)
    t0 = time.perf_counter()
    callbacks = [StartStep(Path(report).with_suffix(".start"))] if report else []
    train(from_dict(cfg), out, resume=resume, callbacks=callbacks, progress=False)
    if report:
        Path(report).write_text(json.dumps({"counts": counter.counts,
                                            "seconds": time.perf_counter() - t0}))


def study_child(spec: str, out: str, kill: dict[str, Any] | None, report: str | None,
                workers: int = 1, ensembles: str = "off", setsid: bool = False) -> None:
    """``modbench study run SPEC --out OUT`` (with its report), dying at ``kill``; exits with
    the command's code. ``setsid``: lead a new process group (so the parent can kill the
    study and its worker processes at once, as a pre-empted machine would)."""
    from modbench.cli import run_cli

    if setsid:
        os.setsid()
    torch.set_num_threads(1)
    counter = Counter()
    install(kill, counter)
    t0 = time.perf_counter()
    code = run_cli(["study", "run", spec, "--out", out, "--no-progress",
                    "--workers", str(workers), "--ensembles", ensembles])
    if report:
        Path(report).write_text(json.dumps({"counts": counter.counts, "code": code,
                                            "seconds": time.perf_counter() - t0}))
    os._exit(code)  # no atexit work: the parent only wants the code


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def ensemble_child(cfg: dict[str, Any], seeds: list[int], outs: list[str], resume: bool,
                   kill: dict[str, Any] | None, report: str | None) -> None:
    """Train ``seeds`` of ``cfg`` stacked in one process (``train_seeds``), dying at
    ``kill``. A refusal (ModbenchError) is written to ``report`` and exits with code 3."""
    from modbench.errors import ModbenchError
    from modbench.train.trainer import train_seeds

    torch.set_num_threads(1)
    counter = Counter()
    install(kill, counter)
    try:
        train_seeds(from_dict(cfg), seeds, outs, resume=resume, progress=False)
    except ModbenchError as e:
        if report:
            Path(report).write_text(json.dumps({"error": str(e)}))
        os._exit(3)
    if report:
        Path(report).write_text(json.dumps({"counts": counter.counts}))


def run_study_child(spec: str, out: str, report: str) -> None:
    """``run_study`` (one worker, no report) with its counts written to ``report``."""
    from modbench.study.runner import run_study
    from modbench.study.spec import load_spec

    torch.set_num_threads(1)
    counts = run_study(load_spec(spec), out, workers=1, ensembles="off", progress=False)
    Path(report).write_text(json.dumps(counts))
