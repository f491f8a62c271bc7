"""``--until-decided`` as a group-sequential design: the Lan–DeMets spending functions, the
looks of :func:`modbench.analysis.stats.sequential_look`, the final verdicts, and the runner's
loop end to end through an executor that records made-up losses instead of training."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from scipy import stats as sps

from modbench.analysis import stats as S
from modbench.errors import ModbenchError
from tests.helpers import RecordingExecutor

BASE = [3.00, 3.10, 2.90]


def test_spending_functions() -> None:
    """Lan & DeMets' O'Brien–Fleming-type and Pocock-type functions: 0 at the start, alpha at
    the end, increasing, OBF far below Pocock early."""
    for kind in S.SPENDING:
        assert S.alpha_spent(0.0, 0.05, kind) == 0.0
        assert S.alpha_spent(1.0, 0.05, kind) == 0.05
        ts = [i / 20 for i in range(1, 21)]
        vals = [S.alpha_spent(t, 0.05, kind) for t in ts]
        assert all(b > a for a, b in itertools.pairwise(vals))
    assert S.alpha_spent(0.5) == pytest.approx(2 * sps.norm.sf(sps.norm.isf(0.025) / 0.5**0.5))
    assert S.alpha_spent(0.5, spending="pocock") == pytest.approx(0.05 * math.log(1 + (math.e - 1)
                                                                                  * 0.5))
    assert S.alpha_spent(0.3) < 0.001 < 0.02 < S.alpha_spent(0.3, spending="pocock")
    with pytest.raises(ValueError):
        S.alpha_spent(0.5, spending="haybittle")


def test_information_fraction_and_allocation() -> None:
    assert S.information_fraction(3, 3, 10) == pytest.approx(0.3)
    assert S.information_fraction(10, 10, 10) == 1.0
    assert S.information_fraction(12, 12, 10) == 1.0
    assert S.baseline_target(3, 5, 10) == 7  # ceil(3 sqrt 5)
    assert S.baseline_target(4, 4, 10) == 8
    assert S.baseline_target(6, 5, 10) == 10  # the cap


def table(n_base: int, n: int, shift: dict[str, float] | None = None) -> dict[str, list[float]]:
    """A baseline of n_base seeds and five methods of n seeds, spread like the baseline."""
    noise = [0.0, 0.1, -0.1, 0.05, -0.05, 0.08, -0.08, 0.02, -0.02, 0.0, 0.03, -0.03]
    out = {"baseline": [3.0 + e for e in noise[:n_base]]}
    for j in range(5):
        d = (shift or {}).get(f"m{j}", 0.0)
        out[f"m{j}"] = [3.0 + d + e for e in noise[j % 3: j % 3 + n]]
    return out


def test_first_look_adds_baseline_seeds_only() -> None:
    """3 + 5 x 3 seeds, cap 10: the first look spends OBF's alpha at t = 0.3 and asks for the
    baseline's seeds up to Dunnett's square root (7), none for the methods."""
    look = S.sequential_look(table(3, 3), (), 10, n_resamples=1)
    assert look.index == 1 and look.fraction == pytest.approx(0.3)
    assert look.alpha == pytest.approx(S.alpha_spent(0.3)) == look.alpha_spent
    assert look.decided == {} and dict(look.add) == {"baseline": 4}
    nxt = S.sequential_look(table(7, 3), [look], 10, n_resamples=1)
    assert dict(nxt.add) == {"baseline": 2, **{f"m{j}": 1 for j in range(5)}}
    assert nxt.alpha == pytest.approx(S.alpha_spent(nxt.fraction) - S.alpha_spent(0.3))


def test_looks_spend_alpha_once_and_stop_at_the_cap() -> None:
    """Adding the seeds each look asks for, the looks' alphas add up to alpha exactly when the
    open methods reach the cap, and the last look asks for nothing."""
    n = {"baseline": 3, **{f"m{j}": 3 for j in range(5)}}
    history: list[S.Look] = []
    while not history or not history[-1].last:
        full = table(10, 10)
        t = {g: full[g][:k] for g, k in n.items()}
        history.append(S.sequential_look(t, history, 10, n_resamples=1))
        for g, k in history[-1].add.items():
            n[g] += k
        assert len(history) < 20
    assert sum(lk.alpha for lk in history) == pytest.approx(0.05)
    assert history[-1].fraction == 1.0 and history[-1].alpha_spent == pytest.approx(0.05)
    assert all(b.fraction >= a.fraction for a, b in itertools.pairwise(history))
    assert n == {g: 10 for g in n}


def test_a_decided_method_gets_no_more_seeds() -> None:
    """A method far better than the baseline is decided at a look (by compare at the look's
    alpha) and asks for nothing more; the undecided ones go on."""
    t = table(7, 3, {"m0": -2.0})  # loss: 2.0 lower is 20 sigma better
    t["m1"] = [3.0, None, 3.1]  # a failed seed: a result, never extended
    look = S.sequential_look(t, [S.sequential_look(table(3, 3), (), 10, n_resamples=1)], 10,
                             higher_is_better=False, n_resamples=1)
    want = S.compare(t, alpha=look.alpha, higher_is_better=False, n_resamples=1)
    assert look.decided == {r.method: "improver" for r in want if r.verdict == "improver"}
    assert look.decided == {"m0": "improver"}
    assert "m0" not in look.add and "m1" not in look.add
    # three open methods of 3 seeds going to 4: the baseline's 7 is ceil(4 sqrt 3) already
    assert dict(look.add) == {"m2": 1, "m3": 1, "m4": 1}
    again = S.sequential_look(t, [look], 10, higher_is_better=False, n_resamples=1)
    assert "m0" not in again.decided  # decided once


def test_no_floor_spends_nothing() -> None:
    look = S.sequential_look({"baseline": [3.0], "m": [2.0]}, (), 10)
    assert look.alpha == 0.0 and look.decided == {} and dict(look.add) == {"baseline": 1}
    capped = S.sequential_look({"baseline": [3.0], "m": [2.0]}, (), 1)
    assert capped.last


def test_final_verdicts_keep_the_look_that_decided() -> None:
    """A method decided at an earlier look keeps that verdict whatever the final data say; an
    improver no look decided is within noise; notes say which."""
    t = {"baseline": BASE, "a": [2.0, 2.1, 1.9], "b": [2.95, 3.05, 3.0]}
    look = S.Look(1, {"baseline": 3, "a": 3, "b": 3}, 0.5, 0.01, 0.01, {"b": "degrader"}, {},
                  10)
    res = S.compare(t, higher_is_better=False, n_resamples=1, alpha=0.01)
    assert {r.method: str(r.verdict) for r in res} == {"baseline": "baseline",
                                                        "a": "improver", "b": "within_noise"}
    seq = {r.method: r for r in S.sequential_verdicts(res, [look])}
    assert seq["b"].verdict == "degrader" and "decided degrader at look 1 of 1" in seq["b"].note
    assert seq["a"].verdict == "within_noise" and "no look decided it" in seq["a"].note
    assert S.sequential_alpha([look]) == 0.01 and S.sequential_alpha([]) == 0.05
    assert S.Look.from_dict(json.loads(json.dumps(look.to_dict()))) == look


# ------------------------------------------------------------ the runner, end to end


def loss_of(method: str, seed: int) -> float:
    """Made-up final losses: sigma 0.05 around 3.0; 'qknorm' 0.2 (4 sigma) better."""
    spread = [0.0, 0.06, -0.06, 0.03, -0.03, 0.05, -0.05, 0.01, -0.01, 0.02][seed % 10]
    return 3.0 + spread - (0.2 if method == "qknorm" else 0.0)


def seq_spec(tmp_path: Path) -> Any:
    """The sequential tests' study: qknorm (4 sigma better by loss_of), two nulls, 3 seeds."""
    from modbench.study.spec import load_spec

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "seq", "baseline": "baseline", "methods": ["qknorm", "post_ln", "softcap"],
        "seeds": {"default": [0, 1, 2], "noise_floor": [0, 1, 2], "anchors": []},
        "scales": ["tiny"], "overrides": ["train.steps=4"], "evaluation": {"probes": False}}))
    return load_spec(spec_file)


def test_until_decided_runs_the_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_study's loop: each wave is what the last recorded look asked for, the looks are in
    the study folder, and the report's verdicts are the looks' (the 4 sigma method decided at
    the look that said so, the nulls not, at the alpha of the last look)."""
    import modbench.study.runner as runner
    from modbench.analysis.results import LOOKS_FILE, read_looks
    from modbench.study.results import load_results

    rec = RecordingExecutor(lambda folder, method, seed: loss_of(method, seed)).install(
        monkeypatch)
    spec = seq_spec(tmp_path)
    out = tmp_path / "s"
    with pytest.raises(ModbenchError, match="spending"):
        runner.run_study(spec, out, until_decided=6, spending="linear", progress=False)
    assert not out.exists()
    c = runner.run_study(spec, out, until_decided=6, progress=False)
    looks = read_looks(out)["tiny"]
    assert (out / LOOKS_FILE).is_file() and looks[-1].last
    assert len(rec.waves) == len(looks)  # the spec's runs, then one wave per look that asked
    for look, wave in zip(looks, [[(m, s) for _, m, s in w] for w in rec.waves[1:]],
                          strict=False):
        asked = sorted((m, look.seeds[m] + i) for m, k in look.add.items() for i in range(k))
        assert wave == asked
    assert c["added_seeds"] == sum(len(w) for w in rec.waves[1:])
    assert sum(lk.alpha for lk in looks) <= 0.05 + 1e-12
    decided = {m: (lk.index, v) for lk in looks for m, v in lk.decided.items()}
    assert decided.get("qknorm", (0, ""))[1] == "improver" and set(decided) == {"qknorm"}
    res = {r.method: r for r in load_results(out).comparisons["tiny"]}
    assert res["qknorm"].verdict == "improver"
    assert f"at look {decided['qknorm'][0]} of {len(looks)}" in res["qknorm"].note
    assert res["post_ln"].verdict == res["softcap"].verdict == "within_noise"
    assert res["post_ln"].n == 6 and res["baseline"].n == 6  # the cap
    assert res["post_ln"].ci_level == pytest.approx(1 - looks[-1].alpha)
    from modbench.study.reporting import write_study_report

    md = (write_study_report(out) / "report.md").read_text()
    assert "## Sequential seeds" in md and f"tiny: {len(looks)} looks (--until-decided 6" in md
    # run again: nothing new to look at, no new look, no new runs
    c2 = runner.run_study(spec, out, until_decided=6, progress=False)
    assert c2["added_seeds"] == 0 and len(read_looks(out)["tiny"]) == len(looks)
    with pytest.raises(ModbenchError, match="planned for --until-decided 6"):
        runner.run_study(spec, out, until_decided=8, progress=False)


def test_a_gap_left_by_an_unfinished_run_is_filled_first(tmp_path: Path) -> None:
    """The seeds a look asks for are the method's next numbers, an earlier wave's unfinished
    seed first (here qknorm's 3, while 4 finished)."""
    from modbench.study.spec import load_spec
    from modbench.study.stages.sequential import undecided_runs
    from modbench.study.store import Store

    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "name": "gap", "baseline": "baseline", "methods": ["qknorm"],
        "seeds": {"default": [0, 1, 2], "noise_floor": [0, 1, 2], "anchors": []},
        "scales": ["tiny"], "overrides": ["train.steps=4"], "evaluation": {"probes": False}}))
    spec = load_spec(tmp_path / "spec.yaml")
    store = Store(tmp_path)
    done = [("baseline", s) for s in range(6)] + [("qknorm", s) for s in (0, 1, 2, 4)]
    for method, seed in done:
        key = f"{method}-{seed}"
        store.register(key, "tiny", method, seed)
        assert store.claim(key)
        store.finish(key, {"status": "completed", "stalled_at_step": None,
                           "final_val_loss": loss_of("baseline", seed)}, None)
    store.register("qknorm-3", "tiny", "qknorm", 3)  # its wave was cut: never finished
    new = undecided_runs(spec, tmp_path, cap=6)
    assert [(r.method, r.seed) for r in new] == [("qknorm", 3)]


# ------------------------------------------------------------ futility (--futility)

NOISE = [0.0, 0.1, -0.1, 0.05, -0.05, 0.08, -0.08, 0.02, -0.02, 0.0]


def test_conditional_power_and_the_final_boundary_by_hand() -> None:
    """Phi((z / sqrt(t) - c) / sqrt(1 - t)); the boundary is Holm's first step over the
    methods not decided with the alpha left, or the guard's sqrt(cap / 2) if larger."""
    # z = 2 at t = 0.5 against c = 2.5: (2.828 - 2.5) / 0.7071 = 0.464, Phi = 0.679
    assert S.conditional_power(2.0, 0.5, 2.5) == pytest.approx(sps.norm.cdf(0.4645), abs=1e-4)
    assert S.conditional_power(0.0, 0.5, 2.5) == pytest.approx(sps.norm.cdf(-2.5 / 0.5**0.5))
    assert S.conditional_power(3.0, 1.0, 2.5) == 1.0 and S.conditional_power(2.0, 1.0, 2.5) == 0
    assert S.conditional_power(math.nan, 0.5, 2.5) == 1.0  # no test: nothing to stop on
    assert S.final_boundary(0.05, 5, 10) == pytest.approx(2.5758, abs=1e-4)  # z_{1-0.005}
    assert S.final_boundary(0.05, 1, 40) == pytest.approx(20**0.5)  # the guard: 1 sigma
    assert S.final_boundary(0.0, 3, 10) == math.inf
    for bad in (0.0, 1.0, -0.1, 2.0):
        with pytest.raises(ValueError, match="conditional power"):
            S.sequential_look(table(3, 3), (), 10, futility=bad)


def test_a_null_method_is_stopped_for_futility_a_promising_one_goes_on() -> None:
    """9 baseline seeds (sigma 0.069), 'null' 0.001 above it and 'promising' 0.1 (1.4 sigma)
    above, 6 seeds each, cap 10, no look before: t = 0.2 / (1/6 + 1/9) = 0.72, OBF spends
    0.0209 and decides neither. The alpha left, 0.0291, over the 2 undecided methods gives
    c = z_{1 - 0.0291/4} = 2.443. 'null': p = 0.714, z = 0.366, conditional power
    Phi((0.366 / 0.849 - 2.443) / 0.529) = Phi(-3.80) = 7e-5 < 0.1: stopped, no seeds.
    'promising': p = 0.037, z = 2.084, Phi((2.456 - 2.443) / 0.529) = 0.51: one more seed
    (and none for the baseline: 9 >= ceil(7 sqrt 1))."""
    base = [3.0 + e for e in NOISE[:9]]
    t = {"baseline": base, "null": [3.001 + e for e in NOISE[:6]],
         "promising": [3.1 + e for e in NOISE[2:8]]}
    look = S.sequential_look(t, (), 10, futility=0.1, n_resamples=1)
    assert look.fraction == pytest.approx(0.72) and look.decided == {}
    assert look.alpha == pytest.approx(0.0209, abs=1e-4)
    res = {r.method: r for r in S.compare(t, alpha=look.alpha, n_resamples=1)}
    c = S.final_boundary(0.05 - look.alpha_spent, 2, 10)
    assert c == pytest.approx(2.443, abs=1e-3)
    cp = {m: S.conditional_power(S.normal_isf(res[m].p / 2), 0.72, c) for m in res
          if m != "baseline"}
    assert cp["null"] == pytest.approx(7.2e-5, rel=0.02) and cp["promising"] == pytest.approx(
        0.51, abs=0.01)
    assert dict(look.futile) == {"null": pytest.approx(cp["null"])}
    assert dict(look.add) == {"promising": 1}
    # the next look: 'null' is neither tested nor given seeds again, 'promising' goes on
    t["promising"].append(3.1 + NOISE[8])
    nxt = S.sequential_look(t, [look], 10, futility=0.1, n_resamples=1)
    assert "null" not in nxt.add and "null" not in nxt.futile and "null" not in nxt.decided
    assert nxt.seeds["null"] == 6
    # its final verdict: within noise, the note says where it stopped
    final = S.sequential_verdicts(S.compare(t, alpha=nxt.alpha, n_resamples=1), [look, nxt])
    null = next(r for r in final if r.method == "null")
    assert null.verdict == "within_noise"
    assert "stopped for futility at look 1 of 2 (conditional power 7.2e-05 < 0.1, 6 seeds)" \
        in null.note


def test_a_large_effect_is_never_stopped_for_futility() -> None:
    """A method 0.3 (4 sigma) better, looked at from 3 + 5 x 3 seeds to its decision with a
    threshold as high as 0.5: never stopped (its conditional power at look 1 is about 1,
    while the alpha OBF spends there is too small to decide it), the nulls (the baseline's
    own seeds) all are, at the first look that tested."""
    n = {"baseline": 3, **{f"m{j}": 3 for j in range(5)}}
    history: list[S.Look] = []
    while not history or not history[-1].last:
        full = table(10, 10, {"m0": 0.3})
        history.append(S.sequential_look({g: full[g][:k] for g, k in n.items()}, history, 10,
                                         futility=0.5, n_resamples=1))
        for g, k in history[-1].add.items():
            n[g] += k
    stopped = {m: lk.index for lk in history for m in lk.futile}
    assert "m0" not in stopped
    assert {m: lk.index for lk in history for m in lk.decided} == {"m0": 3}
    assert history[0].decided == {} and history[0].alpha < 0.001
    assert stopped == {f"m{j}": 1 for j in range(1, 5)}
    # the baseline then grows with the one open method only (ceil(4 sqrt 1) = 4), not to
    # Dunnett's 7 for five: the runs futility saves
    assert dict(history[0].add) == {"m0": 1, "baseline": 1}
    assert sum(history[-1].seeds.values()) == 5 + 5 + 4 * 3


def test_without_futility_the_looks_are_as_before() -> None:
    """futility=None: the looks of the design without it, field for field, and its file keys
    are the ones written before futility existed (tests/analysis/test_golden_results.py
    replays a recorded study's byte for byte)."""
    n = {"baseline": 3, **{f"m{j}": 3 for j in range(5)}}
    full = table(10, 10, {"m0": 0.3})
    t = {g: full[g][:k] for g, k in n.items()}
    look = S.sequential_look(t, (), 10, n_resamples=1)
    assert look == S.sequential_look(t, (), 10, futility=None, n_resamples=1)
    assert look.futility is None and look.futile == {}
    assert list(look.to_dict()) == ["index", "seeds", "fraction", "alpha", "alpha_spent",
                                    "decided", "add", "cap", "spending", "note"]
    assert S.Look.from_dict(look.to_dict()) == look
    stops = S.sequential_look(t, (), 10, futility=0.5, n_resamples=1)
    assert stops.futile and S.Look.from_dict(json.loads(json.dumps(stops.to_dict()))) == stops
    assert stops.to_dict()["futility"] == 0.5


def test_an_old_looks_file_reads_back_unchanged(tmp_path: Path) -> None:
    """A looks file written before --futility (the golden tiny-seq study's) reads as looks
    without futility and writes back byte for byte."""
    from modbench.analysis.results import LOOKS_FILE, looks_json, read_looks

    old = Path(__file__).parent / "golden" / "tiny-seq" / LOOKS_FILE
    (tmp_path / LOOKS_FILE).write_bytes(old.read_bytes())
    looks = read_looks(tmp_path)
    assert looks and all(lk.futility is None and lk.futile == {} for lk in looks["tiny"])
    assert looks_json(looks) == old.read_text(encoding="utf-8")


def test_futility_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_study with futility=0.1: the two nulls (the baseline's own losses) are stopped at
    the first look and get no seed past their 3, qknorm (4 sigma) is decided; the report and
    results.json say so; running on without --futility, or with another threshold, is refused
    in one line, and so is adding it to looks planned without."""
    import modbench.study.runner as runner
    from modbench.analysis.results import read_looks
    from modbench.study.results import load_results

    rec = RecordingExecutor(lambda folder, method, seed: loss_of(method, seed)).install(
        monkeypatch)
    spec = seq_spec(tmp_path)
    out = tmp_path / "s"
    runner.run_study(spec, out, until_decided=6, futility=0.1, progress=False)
    looks = read_looks(out)["tiny"]
    assert looks[0].futility == 0.1 and set(looks[0].futile) == {"post_ln", "softcap"}
    assert all(lk.futility == 0.1 for lk in looks)
    ran = {m: sorted(s for _, mm, s in rec.ran if mm == m) for m in ("post_ln", "softcap")}
    assert ran == {"post_ln": [0, 1, 2], "softcap": [0, 1, 2]}  # no seed after the stop
    res = {r.method: r for r in load_results(out).comparisons["tiny"]}
    assert res["qknorm"].verdict == "improver"
    assert res["post_ln"].verdict == "within_noise" and res["post_ln"].n == 3
    assert "stopped for futility at look 1" in res["post_ln"].note
    from modbench.study.reporting import write_study_report

    written = write_study_report(out)
    md = (written / "report.md").read_text()
    assert "obrien_fleming spending, futility below 0.1: 2 stopped)" in md
    rule = json.loads((written / "results.json").read_text())["rule"]["sequential"]["tiny"]
    assert rule["futility"] == 0.1 and rule["futile"] == ["post_ln", "softcap"]
    from modbench.study.stages.base import RunSettings
    from modbench.study.stages.sequential import SequentialStage

    status = SequentialStage(spec, out, RunSettings(6, futility=0.1)).status()[0].lines
    assert "(--until-decided 6, obrien_fleming spending, futility below 0.1: 2 stopped)" \
        in status[0]
    for futility, says in ((None, "--futility 0.1"), (0.2, "--futility 0.1")):
        with pytest.raises(ModbenchError, match=f"planned for --until-decided 6 --spending "
                                                f"obrien_fleming {says}; go on") as e:
            runner.run_study(spec, out, until_decided=6, futility=futility, progress=False)
        assert "\n" not in str(e.value)


def test_futility_added_to_looks_planned_without_is_refused(tmp_path: Path) -> None:
    """Looks recorded without futility (a study already under way) refuse --futility."""
    from modbench.analysis.results import LOOKS_FILE
    from modbench.study.spec import load_spec
    from modbench.study.stages.sequential import undecided_runs

    study = tmp_path / "tiny-seq"
    shutil.copytree(Path(__file__).parent / "golden" / "tiny-seq", study)
    spec = load_spec(study / "spec.yaml")
    with pytest.raises(ModbenchError) as e:
        undecided_runs(spec, study, 5, futility=0.1)
    assert str(e.value) == (f"the looks of tiny were planned for --until-decided 5 --spending "
                            f"obrien_fleming without --futility; go on with those, or remove "
                            f"{study / LOOKS_FILE} to start a new design")
    assert undecided_runs(spec, study, 5) == []  # as planned: its last look asked for none
