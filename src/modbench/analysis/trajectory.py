"""Verdicts over training: the study's verdict, and Δ with its interval, at every validation
step where every seed of the scale has a validation loss.

Rankings of training modifications can flip partway through training, above all as the
learning rate decays (Wen, Hall, Ma & Liang 2025, "Fantastic Pretraining Optimizers and Where
to Find Them", arXiv:2509.02046): a verdict read from an intermediate checkpoint need not be
the final one. :func:`trajectory` applies the final verdict's rule
(:func:`modbench.analysis.stats.compare`, the caller's options) to the validation losses of
each step, and :func:`late_flips` finds the methods whose verdict changes in the last third
of training. Each step is its own family: the steps are not corrected for each other, so the
trajectory is descriptive, not a test repeated until it succeeds. Pure functions over
``{method: {seed: [(step, val_loss), ...] or None}}``; a ``None`` run (failed: diverged or
stalled) is a failed seed at every step, as in the final table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from modbench.analysis.stats import compare

#: The part of training (by step, from the end) in which a verdict change is warned about.
LATE_FRACTION: Final = 1.0 / 3.0

Curve = Sequence[tuple[int, float]]
#: method -> seed -> its validation curve, or None for a failed run
Curves = Mapping[str, Mapping[int, Curve | None]]

_VERDICTS = ("improver", "degrader", "within_noise")


@dataclass(frozen=True)
class StepVerdict:
    """One method's comparison with the baseline at one validation step."""

    step: int
    method: str
    n: int
    delta: float  # mean(method) - mean(baseline), validation loss
    ci: tuple[float, float]  # the verdict's interval for delta
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci"] = list(self.ci)
        return d


def common_steps(curves: Curves) -> list[int]:
    """The steps at which every run that did not fail has a finite validation loss."""
    sets = [{s for s, v in c if math.isfinite(v)} for seeds in curves.values()
            for c in seeds.values() if c is not None]
    return sorted(set.intersection(*sets)) if sets else []


def trajectory(curves: Curves, baseline: str = "baseline", **compare_kw: Any
               ) -> list[StepVerdict]:
    """:func:`~modbench.analysis.stats.compare` of the validation losses at each of
    :func:`common_steps` (``compare_kw``: the study's verdict options, e.g.
    ``higher_is_better=False``), one :class:`StepVerdict` per method and step, by step then in
    the table's order; empty without a baseline or a common step."""
    if baseline not in curves:
        return []
    out: list[StepVerdict] = []
    kw = {"n_resamples": 1, **compare_kw}
    for step in common_steps(curves):
        table = {m: {seed: (None if c is None else dict(c).get(step)) for seed, c in s.items()}
                 for m, s in curves.items()}
        for r in compare(table, baseline, **kw):
            if not r.is_baseline:
                out.append(StepVerdict(step, r.method, r.n, r.delta, r.ci, str(r.verdict)))
    return out


@dataclass(frozen=True)
class Flip:
    """A method whose verdict against the baseline changed late in training."""

    method: str
    step: int  # the first step with the new verdict
    before: str
    after: str
    last_step: int

    def sentence(self) -> str:
        return (f"{self.method}: {self.before} at the step before {self.step}, {self.after} "
                f"from step {self.step} (of {self.last_step}): its verdict against the "
                "baseline changed in the last third of training")


def late_flips(points: Sequence[StepVerdict], late: float = LATE_FRACTION) -> list[Flip]:
    """Per method, the last change of verdict (improver / degrader / within_noise; steps with
    no verdict are skipped) at a step in the last ``late`` fraction of the last common step,
    so that a reader knows the final ranking may not have settled (Wen et al. 2025)."""
    if not points:
        return []
    last = max(p.step for p in points)
    start = last * (1.0 - late)
    out: list[Flip] = []
    for m in dict.fromkeys(p.method for p in points):
        seq = [p for p in points if p.method == m and p.verdict in _VERDICTS]
        for prev, cur in zip(reversed(seq[:-1]), reversed(seq[1:]), strict=True):
            if cur.verdict != prev.verdict:
                if cur.step > start:
                    out.append(Flip(m, cur.step, prev.verdict, cur.verdict, last))
                break
    return out
