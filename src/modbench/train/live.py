"""Live progress of a training run: step/steps, loss, tokens/s and an ETA from measured step
times, as a bar in a terminal and as a plain line every so often otherwise.

The ETA is measured, not guessed: the wall time from the end of the first update (which
carries the start-up and the first step's warm-up: compilation, allocator, caches) to the
latest, per step, times the steps left. Validation and checkpoints between those updates are
inside that time, so the ETA includes them too.

:class:`TrainProgress` is what ``modbench train`` shows; :class:`StepClock`,
:func:`format_duration`, :func:`format_rate` and :func:`describe` are also used by the study's
progress display (:mod:`modbench.study.progress`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

#: seconds between two plain progress lines when the output is not a terminal
PLAIN_EVERY_S = 30.0


def format_duration(seconds: float | None) -> str:
    """``1h02m``, ``12m03s``, ``45s``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def format_rate(tokens_per_s: float | None) -> str:
    """``12.3k tok/s``; empty when unknown."""
    if tokens_per_s is None or not math.isfinite(tokens_per_s) or tokens_per_s <= 0:
        return ""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= div:
            return f"{tokens_per_s / div:.1f}{unit} tok/s"
    return f"{tokens_per_s:.0f} tok/s"


def describe(step: int | None, steps: int | None, loss: float | None,
             tokens_per_s: float | None, eta_s: float | None = None) -> str:
    """``step 120/500 · loss 4.321 · 12.3k tok/s · ETA 1m02s`` (the parts that are known)."""
    parts = []
    if step is not None:
        parts.append(f"step {step}/{steps}" if steps else f"step {step}")
    if loss is not None and math.isfinite(loss):
        parts.append(f"loss {loss:.4g}")
    if rate := format_rate(tokens_per_s):
        parts.append(rate)
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " · ".join(parts)


class StepClock:
    """Seconds per step from wall-clock observations ``(time, steps done)``: the time since
    the first observation over the steps since it (the first covers the warm-up, so it is the
    origin, not a sample)."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None
        self.last: tuple[float, int] | None = None

    def observe(self, now: float, step: int) -> None:
        if self.first is None or self.last is None or step < self.last[1]:
            self.first = self.last = (now, step)  # the first, or a restart from a checkpoint
        elif step > self.last[1]:
            self.last = (now, step)

    def seconds_per_step(self) -> float | None:
        if self.first is None or self.last is None or self.last[1] <= self.first[1]:
            return None
        return (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])

    def eta(self, steps_left: int) -> float | None:
        per = self.seconds_per_step()
        return None if per is None else max(steps_left, 0) * per


class TrainProgress:
    """The progress of ``modbench train``: a tqdm bar (terminal) or a plain line every
    :data:`PLAIN_EVERY_S` seconds and at the end (not a terminal), both showing step/steps,
    loss, tokens/s and the measured ETA. ``enabled=False`` shows nothing.

    The trainer calls :meth:`update` after each logged window of steps with the last step's
    numbers (steps done, loss, tokens/s) and :meth:`close` at the end.
    """

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True, *,
                 stream: IO[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 every_s: float | None = None) -> None:
        self.total, self.step, self.desc, self.enabled = total, initial, desc, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.clock, self.every_s = clock, PLAIN_EVERY_S if every_s is None else every_s
        self.timer = StepClock()
        self.loss: float | None = None
        self.tokens_per_s: float | None = None
        self.bar: Any = None
        self.printed_at: float | None = None
        if enabled and _is_terminal(self.stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                            dynamic_ncols=True, file=self.stream,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                       "[{elapsed}{postfix}]")

    def eta(self) -> float | None:
        return self.timer.eta(self.total - self.step)

    def postfix(self) -> str:
        """What the bar shows after the elapsed time: loss, tokens/s, ETA."""
        return describe(None, None, self.loss, self.tokens_per_s, self.eta())

    def line(self) -> str:
        """The plain progress line."""
        return f"{self.desc}: " + describe(self.step, self.total, self.loss, self.tokens_per_s,
                                           self.eta())

    def update(self, step: int, loss: float | None = None,
               tokens_per_s: float | None = None) -> None:
        """Steps done so far (``step``) and the last step's loss and tokens/s."""
        if not self.enabled:
            return
        now = self.clock()
        self.timer.observe(now, step)
        advanced, self.step = step - self.step, step
        self.loss = loss if loss is not None else self.loss
        self.tokens_per_s = tokens_per_s if tokens_per_s is not None else self.tokens_per_s
        if self.bar is not None:
            self.bar.update(advanced)
            self.bar.set_postfix_str(self.postfix(), refresh=True)
        elif self.printed_at is None:
            self.printed_at = now  # the first line after every_s, not at once
        elif now - self.printed_at >= self.every_s:
            self._print()
            self.printed_at = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.printed_at is not None:
            self._print()  # where the run ended
            self.enabled = False

    def _print(self) -> None:
        print(self.line(), file=self.stream, flush=True)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


__all__ = ["PLAIN_EVERY_S", "StepClock", "TrainProgress", "describe", "format_duration",
           "format_rate"]
