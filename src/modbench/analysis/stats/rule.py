"""The verdict rule's settings (:class:`VerdictRule`) and its registry of score tests
(docs/statistics.md, "The verdict rule, step by step" and "Adding a test").

:class:`VerdictRule` holds every option of the rule in one frozen, documented object; a study
writes it into ``results.json`` (``"rule"``), so each report says which rule produced it. A score
test is one function of a :class:`Design` (what the rule knows about the scale once it has the
noise floor and the pooled error term) and a method's name, returning a :class:`TestOutcome`;
registering it is one line, ``@score_test("name")``, after which ``compare(..., test="name")``
(or ``VerdictRule(test="name")``) uses it for every method, inside the rule's correction
family, intervals and verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from modbench.analysis.stats.bootstrap import DEFAULT_RESAMPLES
from modbench.analysis.stats.corrections import CORRECTIONS, Correction
from modbench.analysis.stats.floor import NoiseFloor, SigmaSource
from modbench.analysis.stats.scores import NAN
from modbench.analysis.stats.tests import HOMOGENEITY_ALPHA, MDE_POWER, WelchResult

#: The smallest estimated sigma a verdict may rest on, as a fraction of |baseline mean|.
RESOLUTION: Final = 1e-6
#: Finite seeds a baseline with failed seeds needs to keep its noise floor.
MIN_SURVIVING_BASELINE: Final = 3


@dataclass(frozen=True)
class VerdictRule:
    """Every option of the verdict rule (docs/statistics.md states each), frozen.

    * ``alpha``: the level of the corrected tests (improver / degrader at corrected p <= alpha);
    * ``correction``: the family-wise correction of the score and failure-rate tests,
      ``"holm"`` (default), ``"bonferroni"``, ``"bh"`` or ``"none"`` (raw p);
    * ``floor_sigmas``: the verdict's guard, |delta| > ``floor_sigmas`` sigma of the floor;
    * ``sigma``: the noise floor's sigma, the baseline's std (``"baseline"``), pooled with
      the references (``"pooled"``) or the largest of theirs (``"max"``);
    * ``test``: ``"auto"`` (the pooled t when the Brown–Forsythe check does not reject equal
      variances at ``homogeneity_alpha``, else ``"welch"``: each method's prediction test or
      Welch's t) or a registered score test by name (:data:`SCORE_TESTS`);
    * ``resolution``: no verdict from an estimated sigma at or below this fraction of
      |baseline mean|;
    * ``min_surviving_baseline``: finite seeds a baseline with failed seeds needs to keep its
      noise floor;
    * ``mde_power``: the power of the stated minimum detectable effect;
    * ``n_resamples``, ``confidence``, ``seed``, ``paired``: the seed bootstrap (descriptive:
      no verdict reads it).

    Invalid values are refused on construction (ValueError), a ``test`` not registered too.
    """

    alpha: float = 0.05
    correction: Correction = "holm"
    floor_sigmas: float = 1.0
    sigma: SigmaSource = "baseline"
    test: str = "auto"
    homogeneity_alpha: float = HOMOGENEITY_ALPHA
    resolution: float = RESOLUTION
    min_surviving_baseline: int = MIN_SURVIVING_BASELINE
    mde_power: float = MDE_POWER
    n_resamples: int = DEFAULT_RESAMPLES
    confidence: float = 0.95
    seed: int = 0
    paired: bool | None = None

    def __post_init__(self) -> None:
        if self.correction not in (*CORRECTIONS, "none"):
            raise ValueError(f"unknown correction {self.correction!r}")
        if self.test != "auto" and self.test not in SCORE_TESTS:
            raise ValueError(f"test must be auto or a registered score test "
                             f"({', '.join(SCORE_TESTS)}), not {self.test!r}")

    def to_dict(self) -> dict[str, Any]:
        """The rule as plain data (``results.json``'s ``"rule"`` record holds it)."""
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Score tests: what one sees, what one returns, and the registry


@dataclass(frozen=True)
class Design:
    """What a score test sees at one scale: each configuration's finite seeds, the noise
    floor, the methods compared (those with a finite seed, not flagged diverged), the pooled
    error term of the baseline and those methods, the Brown–Forsythe p, the test chosen and
    the rule."""

    baseline: str
    seeds: Mapping[str, npt.NDArray[np.float64]]
    floor: NoiseFloor
    compared: tuple[str, ...]
    pooled_sigma: float
    pooled_df: int
    homogeneity_p: float
    test: str
    rule: VerdictRule

    @property
    def baseline_seeds(self) -> npt.NDArray[np.float64]:
        return self.seeds[self.baseline]

    def improvement(self, method: str) -> float:
        """The method's mean less the baseline's, signed so that positive = better."""
        return self.floor.sign * (float(self.seeds[method].mean()) - self.floor.mean)


@dataclass(frozen=True)
class TestOutcome:
    """One method's score test: its name for the report (``test``), ``t`` signed like the
    improvement, ``df``, the two-sided ``p``; ``se``, the standard error of delta the interval
    uses (NaN: no interval), and ``scale``, the sigma of the test's error term the detectable
    effect is stated in; ``welch``, Welch's raw result where Welch decided; ``note``, why there
    is no p (zero spread)."""

    __test__ = False  # not a pytest class

    test: str
    t: float
    df: float
    p: float
    se: float = NAN
    scale: float = NAN
    welch: WelchResult | None = None
    note: str = ""


#: The outcome of a method the rule does not test (the baseline, a failed or empty method, no
#: noise floor).
NOT_TESTED: Final = TestOutcome("none", NAN, NAN, NAN)

ScoreTestFn = Callable[[Design, str], TestOutcome]
F = TypeVar("F", bound=ScoreTestFn)


@dataclass(frozen=True)
class ScoreTest:
    """A registered score test: its function and ``label``, the test column's entry when the
    floor's own sigma is too small for any verdict (the function is then not called)."""

    name: str
    run: ScoreTestFn
    label: str
    doc: str = field(default="", compare=False)


#: The registered score tests by name (:func:`score_test`); ``compare(test=NAME)`` uses one.
SCORE_TESTS: dict[str, ScoreTest] = {}


def score_test(name: str, *, label: str | None = None) -> Callable[[F], F]:
    """Register the decorated function as the score test ``name`` (one line above it):
    ``compare(..., test=name)`` then calls it for each compared method once the rule has a
    noise floor. ``label`` is what the test column says when the floor's sigma is below the
    resolution (default: ``name``). A name registered twice is refused."""

    def register(fn: F) -> F:
        if name in SCORE_TESTS or name == "auto":
            raise ValueError(f"a score test named {name!r} is already registered")
        SCORE_TESTS[name] = ScoreTest(name, fn, name if label is None else label,
                                      (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return register
