"""A claim that allows ``within_noise`` ("at least as well as the baseline") agrees only where
the test's simultaneous interval shows it: non-inferiority at the verdict's 1-sigma margin."""

from __future__ import annotations

import math

from modbench.analysis.results import check_claim, shows_within_noise
from modbench.analysis.stats import MethodResult, compare


def row(method: str, table: dict[str, list[float]], hib: bool = False) -> MethodResult:
    res = {r.method: r for r in compare(table, higher_is_better=hib, n_resamples=10)}
    return res[method]


def test_within_noise_needs_its_interval() -> None:
    base = [3.00, 3.01, 2.99, 3.005, 2.995, 3.0, 3.002, 2.998]
    # a tight method equal to the baseline (lower is better: a loss): its interval lies
    # inside +-1 sigma, so "at least as well as" is shown; so is "no effect"
    tight = {"baseline": base, "m": [3.0, 3.001, 2.999, 3.0, 3.0005, 2.9995, 3.001, 2.999]}
    r = row("m", tight)
    assert r.verdict == "within_noise"
    assert shows_within_noise(r, ["within_noise", "improver"])
    # a method 0.6 sigma worse with 2 seeds: within noise, but its interval reaches far past
    # -1 sigma: "not shown", never "agrees"
    loose = {"baseline": base, "m": [3.006, 3.008]}
    r2 = row("m", loose)
    assert r2.verdict == "within_noise"
    sigma = r2.floor.sigma
    assert r2.ci[1] > sigma  # worse by more than the margin possible
    assert not shows_within_noise(r2, ["within_noise", "improver"])
    check = check_claim({"s": [r, r2]}, {"m": ["within_noise", "improver"]})
    assert [x.outcome for x in check.rows] == ["not shown"]  # r2 is the later "m"
    assert check_claim({"s": [r]}, {"m": ["within_noise", "improver"]}).rows[0].outcome == \
        "agrees"
    # without an interval (no floor) nothing is shown
    nofloor = row("m", {"baseline": [3.0], "m": [3.0, 3.001]})  # one baseline seed
    assert math.isnan(nofloor.ci[0]) and math.isnan(nofloor.floor.sigma)
    assert not shows_within_noise(nofloor, ["within_noise"])
    # improvers still agree with the same claim
    better = row("m", {"baseline": base, "m": [2.95, 2.951, 2.949]})
    assert better.verdict == "improver"
    assert check_claim({"s": [better]}, {"m": ["within_noise", "improver"]}).summary == "agrees"
