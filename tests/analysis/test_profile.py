"""Learning-rate profiles (issue 45): the sensitivity of Wortsman et al. 2023
(arXiv:2309.14322, §3.1), a method's profile over the grid, verdicts on per-seed
sensitivities and the rate-dependence flag. Every expected number is worked by hand below."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from scipy import stats as sps

from modbench.analysis.profile import (
    MethodProfile,
    RateCell,
    method_profile,
    rate_dependent,
    seed_sensitivity,
    sensitivity_verdicts,
)
from modbench.analysis.stats import Verdict

T975_DF1 = float(sps.t.ppf(0.975, 1))  # 12.706...
T975_DF2 = float(sps.t.ppf(0.975, 2))  # 4.303...

# --------------------------------------------------------------------------------------------
# seed_sensitivity


def test_sensitivity_caps_a_failed_point_at_the_initial_loss() -> None:
    # capped: [3.0, 2.5, 10, 10]; l* = 2.5; differences [0.5, 0, 7.5, 7.5]; mean 15.5 / 4
    assert seed_sensitivity([3.0, 2.5, None, 12.0], 10.0) == pytest.approx(3.875)


def test_sensitivity_non_finite_losses_are_failed_points() -> None:
    # NaN and inf count as l0 = 4: capped [2.0, 4, 4, 3.0]; l* = 2; (0 + 2 + 2 + 1) / 4
    assert seed_sensitivity([2.0, math.nan, math.inf, 3.0], 4.0) == pytest.approx(1.25)


def test_sensitivity_flat_grid_is_zero_and_all_failed_is_nan() -> None:
    assert seed_sensitivity([3.1, 3.1, 3.1], 10.0) == 0.0
    # every point above l0: all capped to l0, nothing to lose: 0
    assert seed_sensitivity([12.0, 11.0], 10.0) == 0.0
    assert math.isnan(seed_sensitivity([None, None, math.nan], 10.0))
    assert math.isnan(seed_sensitivity([], 10.0))


def test_sensitivity_refuses_a_non_finite_initial_loss() -> None:
    with pytest.raises(ValueError, match="init_loss"):
        seed_sensitivity([3.0], math.nan)


# --------------------------------------------------------------------------------------------
# method_profile on a 3-rate x 3-seed table

RATES = (1e-3, 2e-3, 4e-3)
TABLE: dict[float, dict[int, float | None]] = {
    1e-3: {0: 3.22, 1: 3.20, 2: 3.21},   # mean 3.21, s = 0.01
    2e-3: {0: 3.21, 1: 3.18, 2: 3.21},   # mean 3.20, s = sqrt(0.0003), se = 0.01
    4e-3: {0: 3.19, 1: None, 2: 3.17},   # seed 1 diverged; finite mean 3.18, se = 0.01
}
INIT = {0: 10.0, 1: 11.0, 2: 10.0}


@pytest.fixture(scope="module")
def profile() -> MethodProfile:
    return method_profile("m", TABLE, INIT)


def test_cells_hold_the_means_and_t_intervals(profile: MethodProfile) -> None:
    c1, c2, c4 = profile.cells
    assert [c.rate for c in profile.cells] == list(RATES)
    # 1e-3: mean 3.21, s = 0.01, half-width t(0.975; 2) * 0.01 / sqrt(3)
    h1 = T975_DF2 * 0.01 / math.sqrt(3)
    assert (c1.seeds, c1.failed) == (3, 0)
    assert c1.mean == pytest.approx(3.21)
    assert (c1.lo, c1.hi) == (pytest.approx(3.21 - h1), pytest.approx(3.21 + h1))
    # 2e-3: deviations (0.01, -0.02, 0.01): s^2 = 0.0006 / 2, s / sqrt(3) = 0.01
    h2 = T975_DF2 * 0.01
    assert c2.mean == pytest.approx(3.20)
    assert (c2.lo, c2.hi) == (pytest.approx(3.20 - h2), pytest.approx(3.20 + h2))
    # 4e-3: one failed of three; (3.19, 3.17): s = 0.02 / sqrt(2), se = 0.01, df 1
    h4 = T975_DF1 * 0.01
    assert (c4.seeds, c4.failed) == (3, 1)
    assert c4.mean == pytest.approx(3.18)
    assert (c4.lo, c4.hi) == (pytest.approx(3.18 - h4), pytest.approx(3.18 + h4))


def test_best_rate_ignores_a_rate_with_a_failed_seed(profile: MethodProfile) -> None:
    # 4e-3 has the lowest finite mean (3.18) but a diverged seed: the best is 2e-3 (3.20)
    assert profile.best_rate == 2e-3
    assert profile.best_loss == pytest.approx(3.20)


def test_basin_and_max_stable_rate(profile: MethodProfile) -> None:
    # 1e-3 (3.21) is within 0.02 of 3.20; 4e-3 has a failed seed and ends the basin:
    # the basin is {1e-3, 2e-3}, log2(2e-3 / 1e-3) = 1
    assert profile.basin_log2 == pytest.approx(1.0)
    assert profile.max_stable_rate == 2e-3
    # a tolerance below 0.01 leaves the best rate alone
    assert method_profile("m", TABLE, INIT, tolerance=0.005).basin_log2 == 0.0


def test_per_seed_sensitivities_and_their_mean(profile: MethodProfile) -> None:
    # seed 0: [3.22, 3.21, 3.19], l* 3.19: (0.03 + 0.02 + 0) / 3
    # seed 1: [3.20, 3.18, failed -> l0 = 11], l* 3.18: (0.02 + 0 + 7.82) / 3
    # seed 2: [3.21, 3.21, 3.17], l* 3.17: (0.04 + 0.04 + 0) / 3
    want = {0: 0.05 / 3, 1: 7.84 / 3, 2: 0.08 / 3}
    assert profile.seed_sensitivities.keys() == want.keys()
    for s, v in want.items():
        assert profile.seed_sensitivities[s] == pytest.approx(v)
    assert profile.sensitivity == pytest.approx(7.97 / 9)
    vals = list(want.values())
    half = T975_DF2 * statistics.stdev(vals) / math.sqrt(3)
    assert profile.sensitivity_ci is not None
    lo, hi = profile.sensitivity_ci
    assert (lo, hi) == (pytest.approx(7.97 / 9 - half), pytest.approx(7.97 / 9 + half))


def test_one_initial_loss_for_every_seed() -> None:
    p = method_profile("m", TABLE, 10.0)
    # seed 1's failed point now costs 10 - 3.18: (0.02 + 0 + 6.82) / 3
    assert p.seed_sensitivities[1] == pytest.approx(6.84 / 3)
    with pytest.raises(KeyError, match="seed 2"):
        method_profile("m", TABLE, {0: 10.0, 1: 10.0})


def test_bootstrap_contains_the_estimate_and_is_deterministic(profile: MethodProfile) -> None:
    assert profile.best_loss_ci is not None and profile.best_rate_ci is not None
    lo, hi = profile.best_loss_ci
    # the resampled minimum lies between 3.18 (seed 1 drawn thrice) and 3.21 (seed 0 or 2)
    assert 3.18 - 1e-12 <= lo <= 3.20 <= hi <= 3.21 + 1e-12
    rlo, rhi = profile.best_rate_ci
    assert rlo in RATES and rhi in RATES and rlo <= 2e-3 <= rhi
    # at rate 2e-3 no seed is worse than at 1e-3, so 4e-3 (ineligible) never appears
    assert rhi == 2e-3
    again = method_profile("m", TABLE, INIT)
    assert (again.best_loss_ci, again.best_rate_ci) == (profile.best_loss_ci,
                                                        profile.best_rate_ci)
    other = method_profile("m", TABLE, INIT, seed=1, n_resamples=500)
    assert other.best_loss_ci is not None
    assert other.best_loss_ci[0] <= 3.20 <= other.best_loss_ci[1]


def test_one_seed_gives_point_intervals() -> None:
    p = method_profile("m", {1e-3: {7: 3.3}, 2e-3: {7: 3.1}}, 10.0)
    assert p.best_loss_ci == (pytest.approx(3.1), pytest.approx(3.1))
    assert p.best_rate_ci == (2e-3, 2e-3)
    assert p.sensitivity == pytest.approx(0.1)  # (0.2 + 0) / 2
    assert p.sensitivity_ci is None
    c = p.cells[0]
    assert (c.lo, c.hi) == (None, None)


def test_no_rate_where_every_seed_trained_falls_back_to_finite_seeds() -> None:
    table = {1e-3: {0: 3.3, 1: None}, 2e-3: {0: None, 1: 3.25}}
    p = method_profile("m", table, 10.0)
    assert p.best_rate == 2e-3 and p.best_loss == pytest.approx(3.25)
    assert p.max_stable_rate is None
    assert p.basin_log2 == 0.0  # the best rate has a failed seed: nothing joins it


def test_nothing_trained() -> None:
    p = method_profile("m", {1e-3: {0: None}, 2e-3: {0: math.nan}}, 10.0)
    assert (p.best_rate, p.best_loss, p.best_loss_ci, p.best_rate_ci) == (None,) * 4
    assert (p.basin_log2, p.max_stable_rate, p.sensitivity_ci) == (None, None, None)
    assert math.isnan(p.sensitivity) and math.isnan(p.seed_sensitivities[0])
    assert p.cells[0] == RateCell(1e-3, 1, 1, None, None, None)
    d = p.to_dict()
    assert d["sensitivity"] is None and d["seed_sensitivities"] == {"0": None}
    json.dumps(d, allow_nan=False)


def test_to_dict_is_json_ready(profile: MethodProfile) -> None:
    d = profile.to_dict()
    text = json.dumps(d, allow_nan=False)
    back = json.loads(text)
    assert back["best_rate"] == 2e-3
    assert back["best_loss_ci"] == list(profile.best_loss_ci or ())
    assert back["cells"][2]["failed"] == 1
    assert back["seed_sensitivities"]["1"] == pytest.approx(7.84 / 3)


def test_a_seed_missing_at_a_rate_has_no_sensitivity() -> None:
    table = {1e-3: {0: 3.3, 1: 3.4}, 2e-3: {0: 3.2}}
    p = method_profile("m", table, 10.0)
    assert list(p.seed_sensitivities) == [0]
    assert p.cells[1].seeds == 1


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        method_profile("m", {0.0: {0: 3.0}}, 10.0)


# --------------------------------------------------------------------------------------------
# sensitivity_verdicts

BASE = {0: 0.50, 1: 0.52, 2: 0.48, 3: 0.51, 4: 0.49}          # mean 0.50
CALM = {0: 0.20, 1: 0.22, 2: 0.18, 3: 0.21, 4: 0.19}          # mean 0.20
TOUCHY = {0: 0.80, 1: 0.82, 2: 0.78, 3: 0.81, 4: 0.79}        # mean 0.80
SAME = {0: 0.51, 1: 0.49, 2: 0.50, 3: 0.48, 4: 0.52}          # mean 0.50


def test_sensitivity_verdicts() -> None:
    out = {v.method: v for v in sensitivity_verdicts(
        {"baseline": BASE, "calm": CALM, "touchy": TOUCHY, "same": SAME}, "baseline")}
    assert [*out] == ["baseline", "calm", "touchy", "same"]
    assert out["baseline"].verdict == "baseline" and out["baseline"].delta == 0.0
    calm, touchy, same = out["calm"], out["touchy"], out["same"]
    assert calm.verdict == "less_sensitive"
    assert touchy.verdict == "more_sensitive"
    assert same.verdict == "not_shown"
    # delta = mean(method) - mean(baseline), in sensitivity units
    assert calm.delta == pytest.approx(0.20 - 0.50)
    assert touchy.delta == pytest.approx(0.80 - 0.50)
    assert same.delta == pytest.approx(0.0, abs=1e-12)
    # the interval is for that difference: below 0 for the calm one, above for the touchy
    assert calm.ci[0] < calm.delta < calm.ci[1] < 0.0
    assert 0.0 < touchy.ci[0] < touchy.delta < touchy.ci[1]
    assert same.ci[0] < 0.0 < same.ci[1]
    assert calm.p_adjusted <= 0.05 and same.p_adjusted > 0.05
    assert calm.test in ("pooled", "welch", "prediction")
    d = calm.to_dict()
    assert d["verdict"] == "less_sensitive" and isinstance(d["ci"], list)
    json.dumps(out["baseline"].to_dict(), allow_nan=False)  # its NaN p as None


def test_a_baseline_without_a_noise_floor_is_undetermined() -> None:
    # one baseline seed: no sigma to judge against (compare's "undetermined", kept)
    out = sensitivity_verdicts({"baseline": {0: 0.5}, "calm": CALM}, "baseline")
    assert [v.verdict for v in out] == ["baseline", "undetermined"]
    assert out[1].delta == pytest.approx(0.20 - 0.50)


# --------------------------------------------------------------------------------------------
# rate_dependent


@pytest.mark.parametrize(("verdicts", "want"), [
    ({1e-3: "improver", 2e-3: "within_noise", 4e-3: "degrader"}, True),
    ({1e-3: Verdict.IMPROVER, 2e-3: Verdict.DEGRADER}, True),
    ({1e-3: "improver", 2e-3: "improver", 4e-3: "within_noise"}, False),
    ({1e-3: "degrader", 2e-3: "undetermined"}, False),
    ({1e-3: "within_noise"}, False),
    ({}, False),
])
def test_rate_dependent(verdicts: dict[float, str], want: bool) -> None:
    assert rate_dependent(verdicts) is want
