"""Side-by-side timing shared by the benchmark scripts: every round runs each case once, in a
fresh random order, so load from other work on a shared machine falls on all cases alike."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable


def interleaved_medians(cases: dict[str, Callable[[], object]], rounds: int, *,
                        steps: int = 1, seed: int = 0) -> dict[str, float]:
    """Median seconds per call of each case: one warm-up call each, then ``rounds`` rounds
    timing ``steps`` calls of every case in a shuffled order."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {n: [] for n in cases}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(cases.items())
        rng.shuffle(order)
        for name, fn in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t0) / steps)
    return {n: statistics.median(v) for n, v in times.items()}
