"""Scaling fits (analysis/scaling.py) on synthetic ladders with known E, A and alpha: the fit
against scipy's curve_fit run here on its own, the fallback where the full form is ill-posed,
the bootstrap intervals, the gain's trend, the compute multiplier and the leave-last-out
prediction against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import curve_fit

from modbench.analysis.scaling import (
    FULL,
    POWER,
    Point,
    PowerFit,
    Prediction,
    analyse,
    fit_power_law,
)

N = np.array([2e5, 4.2e5, 9e5, 2e6, 4.1e6])


def law(x: np.ndarray, e: float, a: float, alpha: float) -> np.ndarray:
    return e + a * np.power(x, -alpha)


@pytest.mark.parametrize("E,A,alpha", [(2.0, 50.0, 0.3), (1.5, 300.0, 0.45), (3.2, 8.0, 0.15)])
def test_noiseless_law_is_recovered(E: float, A: float, alpha: float) -> None:
    f = fit_power_law(N, law(N, E, A, alpha))
    assert f is not None and f.form == FULL and not f.fallback
    assert (f.E, f.A, f.alpha) == pytest.approx((E, A, alpha), rel=1e-5)
    assert float(f(3e6)) == pytest.approx(law(np.array(3e6), E, A, alpha), rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_noisy_fit_agrees_with_curve_fit(seed: int) -> None:
    """Noise on the rung means: our fit equals scipy's curve_fit's least-squares optimum
    (started at the truth, in the unscaled x), to the optimum's precision."""
    E, A, alpha = 2.0, 60.0, 0.33
    rng = np.random.default_rng(seed)
    y = law(N, E, A, alpha) + rng.normal(0, 0.004, N.size)
    ours = fit_power_law(N, y)
    assert ours is not None and not ours.fallback
    ref, _ = curve_fit(law, N, y, p0=(E, A, alpha), maxfev=20000)
    assert pytest.approx(ref[0], rel=1e-4) == ours.E
    assert ours.alpha == pytest.approx(ref[2], rel=1e-3)
    sse = lambda p: float(np.sum((law(N, *p) - y) ** 2))  # noqa: E731
    assert sse((ours.E, ours.A, ours.alpha)) <= sse(ref) * (1 + 1e-6)
    # and the truth lies where the data put it: alpha within 0.1 of 0.33 at this noise
    assert abs(ours.alpha - alpha) < 0.1


def test_fallback_where_E_is_not_pinned_down() -> None:
    """A pure power law (E = 0): the full fit puts E at its lower bound, so the fallback
    A x^-alpha is fitted, and it recovers A and alpha exactly (a line in log-log)."""
    y = 40.0 * np.power(N, -0.2)
    f = fit_power_law(N, y)
    assert f is not None and f.fallback and f.form == POWER and f.E == 0.0
    assert "E at the end of its range" in f.why
    assert (f.A, f.alpha) == pytest.approx((40.0, 0.2), rel=1e-9)
    ref, _ = curve_fit(lambda lx, la, a: la - a * lx, np.log(N), np.log(y))
    assert f.alpha == pytest.approx(ref[1], rel=1e-9)


def test_two_sizes_fall_back_and_one_size_has_no_fit() -> None:
    f = fit_power_law([1e5, 1e6], [3.0, 2.5])
    assert f is not None and f.fallback and "2 distinct sizes" in f.why
    assert f.alpha == pytest.approx(math.log10(3.0 / 2.5))
    assert fit_power_law([1e5, 1e5], [3.0, 2.9]) is None


def test_inverse() -> None:
    f = PowerFit(FULL, 2.0, 50.0, 0.3)
    assert f.inverse(float(f(7e5))) == pytest.approx(7e5)
    assert f.inverse(2.0) == math.inf and f.inverse(1.9) == math.inf


def ladder_points(laws: dict[str, tuple[float, float, float]], seeds: int = 3,
                  noise: float = 0.0, flops_per_param: float = 1e6, seed: int = 0
                  ) -> list[Point]:
    """Points on N with training FLOPs C = k N^2 (fixed tokens per parameter)."""
    rng = np.random.default_rng(seed)
    out = []
    for m, (e, a, alpha) in laws.items():
        for i, n in enumerate(N):
            for s in range(seeds):
                out.append(Point(m, f"rung{i}", s, float(n), flops_per_param * n * n,
                                 float(law(np.array(n), e, a, alpha)
                                       + (rng.normal(0, noise) if noise else 0.0))))
    return out


def test_a_constant_gain_is_flat() -> None:
    """A constant offset: no trend, exactly without noise; with noise, in most replications
    (the seed bootstrap of 3 seeds is somewhat narrow: docs/statistics.md)."""
    laws = {"baseline": (2.0, 50.0, 0.3), "offset": (1.9, 50.0, 0.3)}
    an = analyse(ladder_points(laws), "baseline", boot=10)
    assert an is not None
    g = an.methods["offset"]
    assert [r.gain for r in g.rungs] == pytest.approx([0.1] * 5, rel=1e-9)
    assert g.trend == "flat" and g.slope == pytest.approx(0.0, abs=1e-9)
    trends = []
    for seed in range(4):
        an = analyse(ladder_points(laws, noise=0.002, seed=seed), "baseline", boot=40)
        assert an is not None
        trends.append(an.methods["offset"].trend)
    assert trends.count("flat") >= 3, trends


def test_gain_trend_grows_shrinks_and_crosses() -> None:
    laws = {"baseline": (2.0, 50.0, 0.3),
            # gain 0.05 - 5 N^-0.3: -0.079 at the smallest rung to -0.002 at the largest
            "grows": (1.95, 55.0, 0.3),
            # gain 50 (N^-0.3 - N^-0.33): 0.40 down to 0.19, both curves near one E
            "shrinks": (2.0, 50.0, 0.33),
            # gain 0.1 - 5 N^-0.3: -0.029 to +0.048
            "crosses": (1.9, 55.0, 0.3)}
    an = analyse(ladder_points(laws, noise=0.002), "baseline", boot=60)
    assert an is not None and an.scales == [f"rung{i}" for i in range(5)]
    for name in ("grows", "shrinks", "crosses"):
        e, a, alpha = laws[name]
        exact = law(N, 2.0, 50.0, 0.3) - law(N, e, a, alpha)
        assert [r.gain for r in an.methods[name].rungs] == pytest.approx(exact, abs=0.01)
    assert an.methods["grows"].trend == "grows" and an.methods["grows"].slope > 0
    assert an.methods["shrinks"].trend == "shrinks" and an.methods["shrinks"].slope < 0
    assert an.methods["crosses"].trend == "crosses zero"
    for ms in an.methods.values():  # every rung's interval holds its point estimate
        for r in ms.rungs:
            if ms.method != "baseline":
                assert r.gain_ci[0] <= r.gain <= r.gain_ci[1]


def test_compute_multiplier_is_the_baseline_compute_ratio() -> None:
    """A method whose loss at compute C is the baseline's at k C (C = 1e6 N^2): L_m(N) =
    E + A (k C)^(-a) in C terms; the multiplier at the largest rung is k."""
    E, A, alpha_c, k = 2.0, 400.0, 0.16, 2.5
    pts = []
    for i, n in enumerate(N):
        c = 1e6 * n * n
        for s in range(2):
            pts.append(Point("baseline", f"r{i}", s, float(n), c, E + A * c ** -alpha_c))
            pts.append(Point("better", f"r{i}", s, float(n), c, E + A * (k * c) ** -alpha_c))
    an = analyse(pts, "baseline", boot=20)
    assert an is not None
    b, m = an.methods["baseline"], an.methods["better"]
    assert b.fit_c is not None and b.fit_c.alpha == pytest.approx(alpha_c, rel=1e-4)
    assert b.fit_n is not None and b.fit_n.alpha == pytest.approx(2 * alpha_c, rel=1e-4)
    assert m.multiplier == pytest.approx(k, rel=1e-3)
    assert m.multiplier_ci == pytest.approx((k, k), rel=1e-3)  # no seed spread


def test_leave_last_out_on_an_exact_law_predicts_exactly() -> None:
    laws = {"baseline": (2.0, 50.0, 0.3), "m": (1.95, 45.0, 0.3)}
    an = analyse(ladder_points(laws), "baseline", boot=10)
    assert an is not None
    for ms in an.methods.values():
        p = ms.prediction
        assert p is not None and p.scale == "rung4" and p.params == N[-1]
        assert p.loss == pytest.approx(p.observed, rel=1e-6)
    p = an.methods["m"].prediction
    assert p is not None
    expected_gain = law(N[-1], 2.0, 50.0, 0.3) - law(N[-1], 1.95, 45.0, 0.3)
    assert p.gain == pytest.approx(expected_gain, rel=1e-4)
    assert p.observed_gain == pytest.approx(expected_gain, rel=1e-9)


def test_leave_last_out_interval_covers_noisy_truth_and_z_is_the_error_in_half_widths(
) -> None:
    laws = {"baseline": (2.0, 50.0, 0.3)}
    inside = 0
    for seed in range(8):
        an = analyse(ladder_points(laws, noise=0.01, seed=seed), "baseline", boot=40)
        assert an is not None
        p = an.methods["baseline"].prediction
        assert p is not None and p.loss_pi[0] < p.loss < p.loss_pi[1]
        inside += abs(p.loss_z) <= 1
    assert inside >= 5  # a 95 % interval: most of 8 replications inside it
    z = Prediction.z(observed=2.3, predicted=2.0, pi=(1.9, 2.2))
    assert z == pytest.approx(1.5)  # 0.3 over the upper half-width 0.2
    assert Prediction.z(1.95, 2.0, (1.9, 2.2)) == pytest.approx(-0.5)


def test_bootstrap_is_reproducible_and_needs_three_scales() -> None:
    pts = ladder_points({"baseline": (2.0, 50.0, 0.3), "m": (2.0, 45.0, 0.3)}, noise=0.01)
    a1, a2 = analyse(pts, "baseline", boot=30), analyse(pts, "baseline", boot=30)
    assert a1 is not None and a2 is not None
    assert a1.methods["m"].alpha_ci == a2.methods["m"].alpha_ci
    assert a1.methods["m"].alpha_ci[0] < a1.methods["m"].fit_n.alpha < \
        a1.methods["m"].alpha_ci[1]  # type: ignore[union-attr]
    two = [p for p in pts if p.scale in ("rung0", "rung1")]
    assert analyse(two, "baseline") is None


def test_extrapolated_gain_follows_the_curves() -> None:
    laws = {"baseline": (2.0, 50.0, 0.3), "m": (1.9, 50.0, 0.3)}
    an = analyse(ladder_points(laws, noise=0.002), "baseline", boot=40)
    assert an is not None
    g, (lo, hi) = an.extrapolated_gain("m", 1e9, 1e9)
    assert g == pytest.approx(0.1, abs=0.03) and lo <= g <= hi


def test_a_method_that_trained_at_one_rung_is_not_labelled_the_baseline() -> None:
    """A method whose seeds failed at every rung but the first (Post-LN on ladder-cpu) has no
    fit and no trend: its fit-table row says so ("–"), not "(baseline)", and a note gives the
    rungs it trained at."""
    from modbench.report.scaling import _fit_table

    laws = {"baseline": (2.0, 50.0, 0.3), "ok": (1.9, 50.0, 0.3), "fails": (2.1, 50.0, 0.3)}
    points = [p for p in ladder_points(laws) if p.method != "fails" or p.scale == "rung0"]
    an = analyse(points, "baseline", boot=10)
    assert an is not None and an.methods["fails"].fit_n is None
    table, notes = _fit_table(an)
    rows = {r[0]: r for r in table.rows}
    assert rows["`baseline`"][6] == "(baseline)" and rows["`ok`"][6] == "flat"
    assert rows["`fails`"][6] == "–"
    assert ("`fails`: no fit and no trend: its seeds trained at 1 of 5 rungs (at the others "
            "every seed diverged or stalled; a fit needs 3, a trend 2)") in notes.items
