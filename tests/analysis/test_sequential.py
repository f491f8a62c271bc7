"""``--until-decided`` as a group-sequential design: the Lan–DeMets spending functions, the
looks of :func:`modbench.analysis.stats.sequential_look`, the final verdicts, and the runner's
loop end to end through an executor that records made-up losses instead of training."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

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


def test_until_decided_runs_the_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_study's loop: each wave is what the last recorded look asked for, the looks are in
    the study folder, and the report's verdicts are the looks' (the 4 sigma method decided at
    the look that said so, the nulls not, at the alpha of the last look)."""
    import modbench.study.runner as runner
    from modbench.analysis.results import LOOKS_FILE, read_looks
    from modbench.study.results import load_results
    from modbench.study.spec import load_spec

    rec = RecordingExecutor(lambda folder, method, seed: loss_of(method, seed)).install(
        monkeypatch)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "seq", "baseline": "baseline", "methods": ["qknorm", "post_ln", "softcap"],
        "seeds": {"default": [0, 1, 2], "noise_floor": [0, 1, 2], "anchors": []},
        "scales": ["tiny"], "overrides": ["train.steps=4"], "evaluation": {"probes": False}}))
    spec = load_spec(spec_file)
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
