"""Live progress of a study run: every running run's step, loss and tokens/s, and an ETA for
the whole study from measured step times.

Runs train in worker processes, Ray tasks or SLURM jobs, so the parent learns their progress
the way any of them could be watched: a thread polls, every :data:`POLL_S` seconds, the
store's index (which runs are claimed, finished, failed) and the new lines of each claimed
run's ``metrics.jsonl`` (its last training record: step, loss, tokens/s). It works the same
for every executor, as long as the study folder is readable here.

The ETA (:func:`eta_seconds`) is measured, not extrapolated from finished-run counts:

- each running run's seconds per step, from the wall clock between polls
  (:class:`~modbench.train.live.StepClock`; until it has two observations, the step time its
  records report);
- a run not measured yet (pending) gets the median seconds per unit of work of the measured
  ones times its own work per step (tokens per step × an estimate of its parameters), so a
  study with several scales weighs them;
- the time a run spends outside its steps (start-up, the final validation, evaluation): the
  median over runs finished in this session (0 until one finishes);
- the runs still to go are then laid out on the workers (the executor's worker count, or as
  many as were seen running at once), each taking the next run when it frees up: the ETA is
  when the last one ends.

In a terminal the display is a rich progress view: the study's bar (steps done of all runs
to train, runs done, ETA) and one bar per running run; elsewhere (a log file, CI) it prints a
plain block every :data:`~modbench.train.live.PLAIN_EVERY_S` seconds and a line when a run
ends.
"""

from __future__ import annotations

import heapq
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from modbench.config import RunConfig
from modbench.runtime.runfolder import METRICS
from modbench.train import live
from modbench.train.live import StepClock, describe, format_duration

POLL_S = 1.0  # seconds between two polls of the store and the metrics logs


def work_per_step(cfg: RunConfig) -> float:
    """A run's relative cost per optimizer step: tokens per step × an estimate of its
    parameters (embedding, attention and SwiGLU matrices). Only ratios between runs matter."""
    m = cfg.model
    params = m.n_layers * (4 * m.d_model ** 2 + 3 * m.d_model * m.d_ff) + m.vocab_size * m.d_model
    return float(cfg.train.batch_size * cfg.train.seq_len * params)


class MetricsTail:
    """The new complete lines of a growing ``metrics.jsonl`` since the last read (a file cut
    back by a resume is read again from its start)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""

    def records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < self.offset:
                    self.offset, self.rest = 0, b""
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


@dataclass
class RunView:
    """What the parent knows of one run it is waiting for."""

    key: str
    label: str
    steps: int  # planned
    work: float  # work_per_step
    tokens_per_step: int
    run_dir: Path | None = None
    state: str = "pending"  # pending | running | done | failed
    step: int = 0  # steps done, from its last training record
    loss: float | None = None
    tokens_per_s: float | None = None
    status: str | None = None  # completed | diverged | ... once done
    claimed_at: float | None = None
    finished_at: float | None = None
    clock: StepClock = field(default_factory=StepClock)
    tail: MetricsTail | None = None

    def seconds_per_step(self) -> float | None:
        """Measured wall-clock seconds per step, else the step time its records report."""
        per = self.clock.seconds_per_step()
        if per is None and self.tokens_per_s:
            per = self.tokens_per_step / self.tokens_per_s
        return per

    def overheads(self) -> tuple[float, float] | None:
        """A finished run's time outside its steps: ``(all of it, the part after its last
        step was seen)``, when this session saw it start, train and end."""
        per = self.clock.seconds_per_step()
        last = self.clock.last
        if (self.state != "done" or per is None or last is None or self.claimed_at is None
                or self.finished_at is None or last[1] < self.steps):
            return None
        total = self.finished_at - self.claimed_at - self.steps * per
        return max(total, 0.0), max(self.finished_at - last[0], 0.0)


def eta_seconds(views: Sequence[RunView], slots: int) -> float | None:
    """Seconds until every run in ``views`` has ended, with ``slots`` runs at a time (see the
    module docstring); None until some step time is known."""
    rates = [(v.seconds_per_step(), v.work) for v in views]
    per_work = [per / work for per, work in rates if per is not None and work > 0]
    if not per_work:
        return None
    unit = statistics.median(per_work)
    seen = [o for o in (v.overheads() for v in views) if o is not None]
    start_end = statistics.median(o[0] for o in seen) if seen else 0.0
    tail = statistics.median(o[1] for o in seen) if seen else 0.0
    running, pending = [], []
    for v in views:
        per = v.seconds_per_step() or unit * v.work
        if v.state == "running":
            running.append(max(v.steps - v.step, 0) * per + tail)
        elif v.state == "pending":
            pending.append(v.steps * per + start_end)
    ends = running + [0.0] * max(slots - len(running), 0)
    if not ends:
        ends = [0.0]
    heapq.heapify(ends)
    for d in pending:
        heapq.heappush(ends, heapq.heappop(ends) + d)
    return max(ends)


class StudyProgress:
    """The live display of :func:`modbench.study.runner.run_study` (see the module docstring).

    ``views``: the runs to train; ``done_before``: runs of the study already done;
    ``workers``: runs the executor trains at once, when it knows (the local executor);
    ``enabled=False``: nothing is shown and nothing is polled. Call :meth:`finished` with each
    result the executor returns and :meth:`close` at the end.
    """

    def __init__(self, name: str, views: list[RunView], store: Any, *, done_before: int = 0,
                 workers: int | None = None, enabled: bool = True,
                 stream: IO[str] | None = None, terminal: bool | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.name, self.views, self.store = name, views, store
        self.done_before, self.workers, self.enabled = done_before, workers, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.most_running = 0
        self.printed_at = self.started = clock()
        self.by_key = {v.key: v for v in views}
        self.view: Any = None  # the rich display, in a terminal
        self.tasks: dict[str, Any] = {}
        self.thread: threading.Thread | None = None
        if not enabled or not views:
            self.enabled = False
            return
        if terminal is None:
            terminal = _is_terminal(self.stream)
        if terminal:
            self.view = _rich_view(self.stream)
        if self.view is not None:
            self.main = self.view.add_task(f"study {name}", total=self.total_steps(), info="")
            self.view.start()
        self.thread = threading.Thread(target=self._loop, name="study-progress", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------ numbers

    def total_steps(self) -> int:
        return sum(v.steps for v in self.views)

    def steps_done(self) -> int:
        """Steps trained of the runs to train (a run that ended counts whole: nothing is left
        of it to train)."""
        return sum(v.steps if v.state in ("done", "failed") else min(v.step, v.steps)
                   for v in self.views)

    def runs_done(self) -> int:
        return self.done_before + sum(v.state in ("done", "failed") for v in self.views)

    def slots(self) -> int:
        return max(self.workers or 0, self.most_running, 1)

    def eta(self) -> float | None:
        return eta_seconds(self.views, self.slots())

    def headline(self) -> str:
        total = self.total_steps()
        share = f"{100 * self.steps_done() / total:.0f}% of steps" if total else ""
        runs = f"{self.runs_done()}/{self.done_before + len(self.views)} runs"
        return " · ".join(p for p in (runs, share, f"ETA {format_duration(self.eta())}") if p)

    # ------------------------------------------------------------------------ polling

    def _loop(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # a display must never stop the study
                continue

    def poll(self) -> None:
        """Read the store and the running runs' metrics; refresh the display."""
        rows = {r["key"]: r for r in self.store.rows()}
        now = self.clock()
        with self.lock:
            for v in self.views:
                row = rows.get(v.key)
                if row is None or v.state not in ("pending", "running"):
                    continue
                claimed = row.get("claimed_at")
                if isinstance(claimed, float) and claimed >= self.started:  # this session's
                    v.claimed_at = claimed
                if row["state"] == "running":
                    v.state = "running"
                if v.state == "running" and v.run_dir is not None:
                    self._read(v, now)
            self.most_running = max(self.most_running,
                                    sum(v.state == "running" for v in self.views))
            self._show(now)

    def _read(self, v: RunView, now: float | None) -> None:
        """The run's new training records; ``now``: when they were seen (None: do not time
        them, a run that has ended)."""
        if v.tail is None:
            v.tail = MetricsTail(v.run_dir / METRICS)  # type: ignore[operator]
        train = [r for r in v.tail.records() if r.get("kind") == "train"
                 and isinstance(r.get("step"), int)]
        if train:
            last = train[-1]
            v.step = last["step"]
            v.loss = last.get("loss") if isinstance(last.get("loss"), float) else v.loss
            tps = last.get("tokens_per_s")
            v.tokens_per_s = float(tps) if isinstance(tps, int | float) else v.tokens_per_s
            if now is not None:
                v.clock.observe(now, v.step)

    def finished(self, result: Any) -> None:
        """A result from the executor (``outcome``: trained, skipped, failed, busy or paused)."""
        if not self.enabled:
            return
        with self.lock:
            v = self.by_key.get(result.key)
            if v is None:
                return
            if v.run_dir is not None:
                self._read(v, None)  # its last numbers (its final step is not a step time)
            v.state = {"failed": "failed", "paused": "paused"}.get(result.outcome, "done")
            v.status = result.status or result.outcome
            v.finished_at = self.clock()
            if v.status == "completed":
                v.step = v.steps
            text = f"{v.label} {v.status}"
            if v.loss is not None and result.outcome == "trained":
                text += f" (last loss {v.loss:.4g})"
            self._note(f"{text} · {self.headline()}")
            self._show(self.clock())

    def close(self) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join(5)
            self.thread = None
        if self.view is not None:
            self.view.stop()
            self.view = None

    # ------------------------------------------------------------------------ display

    def _note(self, text: str) -> None:
        if self.view is not None:
            self.view.console.print(f"[dim]study {self.name}:[/dim] {text}", highlight=False)
        else:
            print(f"study {self.name}: {text}", file=self.stream, flush=True)

    def _show(self, now: float) -> None:
        running = [v for v in self.views if v.state == "running"]
        if self.view is None:
            if now - self.printed_at < live.PLAIN_EVERY_S:
                return
            self.printed_at = now
            lines = [f"study {self.name}: {self.headline()}"]
            lines += [f"  {v.label}: " + (describe(v.step, v.steps, v.loss, v.tokens_per_s)
                                          if v.tail is not None and v.clock.last else
                                          "starting") for v in running]
            print("\n".join(lines), file=self.stream, flush=True)
            return
        self.view.update(self.main, completed=self.steps_done(), info=self.headline())
        for key in [k for k in self.tasks if self.by_key[k].state != "running"]:
            self.view.remove_task(self.tasks.pop(key))
        for v in running:
            info = describe(v.step, v.steps, v.loss, v.tokens_per_s) if v.clock.last else \
                "starting"
            if v.key not in self.tasks:
                self.tasks[v.key] = self.view.add_task(f"  {v.label}", total=v.steps, info=info)
            self.view.update(self.tasks[v.key], completed=min(v.step, v.steps), info=info)
        self.view.refresh()


def _rich_view(stream: IO[str]) -> Any:
    """A rich progress view on ``stream`` (None without rich: plain lines instead)."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn
    except ImportError:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(bar_width=24),
                    TextColumn("{task.fields[info]}"), console=Console(file=stream),
                    auto_refresh=False, transient=False)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def views_for(runs: Sequence[Any], store: Any) -> list[RunView]:
    """A :class:`RunView` for each of the study's runs to train (``RunSpec``)."""
    return [RunView(r.key, r.label, r.config.train.steps, work_per_step(r.config),
                    r.config.train.batch_size * r.config.train.seq_len, store.run_dir(r.key))
            for r in runs]


__all__ = ["POLL_S", "MetricsTail", "RunView", "StudyProgress", "eta_seconds", "views_for",
           "work_per_step"]
