"""Family-wise false-positive rate and power of ``--until-decided`` as shipped
(:func:`modbench.analysis.stats.sequential_look`), by simulation at the built-in study's
design: a baseline of 3 seeds, 5 methods of 3 seeds, at most 10 seeds per group.

Issue 29's aims: the family-wise rate stays <= 5 % and a true 2 sigma improvement is found
with power >= 60 %. With the futility rule (``--futility 0.1``, issue 45 item 6): the
family-wise rate <= 5 %, power >= 80 % at 2 sigma, at most 6 seeds a method on average. The
procedure is ``sequential_sim.run`` (vectorised), and ``sequential_look`` itself must run the
first ``CHECK`` studies of each scenario to the same looks, seeds, alpha, verdicts and
futility stops. In CI each scenario draws ``DRAWS`` = 2,000 studies from a fixed RNG and the
bounds are the aims widened by three binomial standard errors;
``MODBENCH_SIM_DRAWS=100000 pytest -s tests/analysis/test_sequential_sim.py`` (or
``python benchmarks/verdict_power.py --sequential`` / ``--futility``) gives the long figures.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from . import sequential_sim as Q
from . import verdict_sim as V

DRAWS = int(os.environ.get("MODBENCH_SIM_DRAWS", "2000"))
CHECK = 6
N_BASE, N_SEEDS, CAP = 3, 3, 10
AIM_FWER, AIM_POWER = 0.05, 0.60


def se(rate: float) -> float:
    return math.sqrt(rate * (1 - rate) / DRAWS)


SCENARIOS = {  # name: (effects in sigmas, noise, spending)
    "normal, all null": ([0.0] * 5, "normal", "obrien_fleming"),
    "t(4), all null": ([0.0] * 5, "t4", "obrien_fleming"),
    "normal, all null, Pocock": ([0.0] * 5, "normal", "pocock"),
    "2 sigma better among 4 nulls": ([-2.0, 0, 0, 0, 0], "normal", "obrien_fleming"),
    "2 sigma better among 4 nulls, Pocock": ([-2.0, 0, 0, 0, 0], "normal", "pocock"),
}


@pytest.mark.parametrize(("name", "seed"), [(n, 70 + i) for i, n in enumerate(SCENARIOS)])
def test_until_decided_as_shipped(name: str, seed: int) -> None:
    """The aims within three binomial standard errors (scores are higher-is-better, compare's
    default: the planted method is 2 sigma lower, a degrader, found in its direction)."""
    effects, noise, spending = SCENARIOS[name]
    eff = np.asarray(effects)
    base, meth = V.simulate(np.random.default_rng(seed), DRAWS, CAP, eff, CAP, noise)
    out = Q.run(base, meth, N_BASE, N_SEEDS, CAP, spending=spending)
    Q.check_against_looks(base, meth, N_BASE, N_SEEDS, CAP, out, CHECK, spending)
    fwer, power = V.rates(out.verdicts, eff)
    print(f"\n{name}: family-wise rate {fwer:.4f}, power {power:.4f}, seeds "
          f"{out.seeds.mean():.1f}, looks {out.looks.mean():.2f} ({DRAWS} studies)")
    assert (out.spent <= 0.05 + 1e-12).all()
    assert out.seeds.max() <= 6 * CAP
    assert fwer <= AIM_FWER + 3 * se(AIM_FWER), fwer
    if not math.isnan(power):
        assert power >= AIM_POWER - 3 * se(AIM_POWER), power


FUTILITY = 0.1
AIM_FUTILE_POWER, AIM_SEEDS = 0.80, 6.0
FUTILE = {  # name: (effects in sigmas, noise, spending)
    "normal, all null": ([0.0] * 5, "normal", "obrien_fleming"),
    "2 sigma better among 4 nulls": ([-2.0, 0, 0, 0, 0], "normal", "obrien_fleming"),
    "t(4), 3 sigma better among 4 nulls, Pocock": ([3.0, 0, 0, 0, 0], "t4", "pocock"),
}


@pytest.mark.parametrize(("name", "seed"), [(n, 90 + i) for i, n in enumerate(FUTILE)])
def test_until_decided_with_futility(name: str, seed: int) -> None:
    """``--futility 0.1``: ``sequential_look`` itself stops the same methods at the same looks
    as the simulation, and the aims hold within three binomial standard errors; the seeds a
    method gets average at most 6 (measured 3.8 all null, 4.3 at 2 sigma: BENCHMARKS.md)."""
    effects, noise, spending = FUTILE[name]
    eff = np.asarray(effects)
    base, meth = V.simulate(np.random.default_rng(seed), DRAWS, CAP, eff, CAP, noise)
    out = Q.run(base, meth, N_BASE, N_SEEDS, CAP, spending=spending, futility=FUTILITY)
    Q.check_against_looks(base, meth, N_BASE, N_SEEDS, CAP, out, CHECK, spending, FUTILITY)
    fwer, power = V.rates(out.verdicts, eff)
    per_method = out.method_seeds.mean()
    print(f"\n{name}, futility {FUTILITY}: family-wise rate {fwer:.4f}, power {power:.4f}, "
          f"seeds {out.seeds.mean():.1f}, per method {per_method:.2f} ({DRAWS} studies)")
    assert (out.spent <= 0.05 + 1e-12).all()
    assert ((out.stopped > 0) & (out.verdicts != 0)).sum() == 0  # stopped: never decided
    assert fwer <= AIM_FWER + 3 * se(AIM_FWER), fwer
    assert per_method <= AIM_SEEDS
    if not math.isnan(power):
        assert power >= AIM_FUTILE_POWER - 3 * se(AIM_FUTILE_POWER), power
    if (np.abs(eff) >= 3).any():  # a large effect is rarely stopped: 3 seeds can hide it
        # (20,000 studies: 1.2 % with t(4) noise and Pocock, 0.3 % normal and OBF)
        assert (out.stopped[:, np.abs(eff) >= 3] > 0).mean() <= 0.025
