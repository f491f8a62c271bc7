"""Stalled runs in the statistics, the claim check and the report: failures like divergences,
never ordinary values."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from scipy import stats as sps

from modbench.analysis import stats as S
from modbench.analysis.results import RunRow, check_claim, compare_scales, metric_table
from modbench.analysis.stats import Verdict
from modbench.report.build import budget_warnings, write_report
from modbench.study.spec import load_spec
from modbench.study.store import Store
from modbench.train.trainer import train
from tests.helpers import tiny

BASE = {0: 4.80, 1: 4.85, 2: 4.83}
TABLE: dict[str, dict[int, float | None]] = {
    "baseline": BASE,
    "good": {0: 4.10, 1: 4.16, 2: 4.12},
    # every seed failed (None: a failure, not a value); a method with surviving seeds is
    # judged on them and its failure rate tested (issue 29: tests/analysis/test_stats.py)
    "stuck": {0: None, 1: None, 2: None},  # three seeds stalled
    "mixed": {0: None, 1: None, 2: None},  # one stalled, two diverged
    "worse": {0: 4.95, 1: 5.0, 2: 4.98},
}


def test_stalled_seeds_are_failures_mirroring_divergence() -> None:
    # test="welch": the by-hand check below is Welch's (the default pools the error term)
    res = {r.method: r for r in S.compare(TABLE, higher_is_better=False, n_resamples=200,
                                          stalled={"stuck": 3, "mixed": 1}, test="welch")}
    assert res["stuck"].verdict == Verdict.STALLED == "stalled"
    assert (res["stuck"].n, res["stuck"].n_stalled, res["stuck"].n_diverged) == (0, 3, 0)
    assert res["mixed"].verdict == Verdict.DIVERGED  # a divergence outranks a stall
    assert (res["mixed"].n_stalled, res["mixed"].n_diverged) == (1, 2)
    # the Holm family is the two methods without a failed seed; by hand: Welch's p of each
    # against the baseline, then Holm's step-down over those two
    p = {m: float(sps.ttest_ind(list(TABLE[m].values()), list(BASE.values()),
                                equal_var=False).pvalue) for m in ("good", "worse")}
    lo, hi = sorted(p, key=p.get)  # type: ignore[arg-type]
    holm = {lo: min(1.0, 2 * p[lo])}
    holm[hi] = min(1.0, max(holm[lo], p[hi]))
    for m in ("good", "worse"):
        assert res[m].p == pytest.approx(p[m], rel=1e-9)
        assert res[m].p_adjusted["holm"] == pytest.approx(holm[m], rel=1e-9)
    assert res["good"].verdict == Verdict.IMPROVER and res["worse"].verdict == Verdict.DEGRADER
    for m in ("stuck", "mixed"):
        assert math.isnan(res[m].p_adjusted["holm"])
    # exactly what the same table gives when the stalled seeds are called diverged: only the
    # label differs
    as_div = {r.method: r for r in S.compare(TABLE, higher_is_better=False, n_resamples=200,
                                             test="welch")}
    assert as_div["stuck"].verdict == Verdict.DIVERGED
    for m in TABLE:
        assert res[m].p_adjusted == pytest.approx(as_div[m].p_adjusted, nan_ok=True)
        assert res[m].n_diverged + res[m].n_stalled == as_div[m].n_diverged
    # and a failed method is never asked for more seeds
    floor = S.noise_floor(BASE, higher_is_better=False)
    asked = {r.method for r in S.undecided(TABLE, floor, max_seeds=10)}
    assert not asked & {"stuck", "mixed"}


def test_a_stalled_seed_must_be_given_as_none() -> None:
    with pytest.raises(ValueError, match="give a stalled seed's score as None"):
        S.compare(TABLE, stalled={"good": 1}, n_resamples=10)
    assert S.decide(improvement=1.0, p_adjusted=0.0, sigma=0.1, stalled=True) == "stalled"
    assert S.decide(improvement=1.0, p_adjusted=0.0, sigma=0.1, stalled=True,
                    diverged=True) == "diverged"


def row(method: str, seed: int, loss: float, status: str = "completed",
        stalled_at: int | None = None) -> RunRow:
    return RunRow(key=f"{method}-{seed}", scale="tiny", method=method, seed=seed, state="done",
                  status=status, val_loss=loss, params=10**6, tokens=10**8,
                  diverged_at_step=None, stalled_at_step=stalled_at, unigram_loss=5.95,
                  steps=500, steps_planned=500)


def test_results_tables_and_claims_treat_a_stall_as_a_failure() -> None:
    rows = [row("baseline", s, v) for s, v in BASE.items()]
    rows += [row("post_ln", s, 5.947, "stalled", 100) for s in range(3)]
    rows += [row("mix_ln", s, 3.6 + 0.02 * s) for s in range(3)]
    assert rows[3].failed and rows[3].metric("val_loss") is None
    assert metric_table(rows, "tiny", "val_loss", "baseline")["post_ln"] == {0: None, 1: None,
                                                                            2: None}
    comp = compare_scales(rows, "baseline", "val_loss", [])
    got = {r.method: r for r in comp["tiny"]}
    assert got["post_ln"].verdict == "stalled" and got["post_ln"].n_stalled == 3
    assert got["mix_ln"].verdict == "improver"
    claim = check_claim(comp, {"post_ln": ["stalled", "diverged"], "mix_ln": ["improver"]})
    assert claim.summary == "agrees"
    # a stall where the claim expects training is a decided contradiction, not "not shown"
    claim = check_claim(comp, {"post_ln": ["within_noise", "improver"]})
    assert claim.rows[0].outcome == "contradicts"


def test_the_builtin_claim_expects_the_stall() -> None:
    spec = load_spec("builtin-cpu")
    assert spec.claim is not None
    assert "stalled" in spec.claim.expect["post_ln"] and "stalled" in spec.claim.expect[
        "deepnorm"]
    assert "degrader" not in spec.claim.expect["post_ln"]  # "stalls or diverges", as it says


# ------------------------------------------------------------------ a store and its report


@pytest.fixture(scope="module")
def stalled_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The planted stall of tests/runtime/test_stall.py, at 30 steps (a 20-step stretch
    allowed): stalled from step 10."""
    out = tmp_path_factory.mktemp("stalled") / "run"
    train(tiny("layerscale(init=-1e30)", 0, 30, "train.stall_min_steps=20"), out,
          progress=False)
    return out


def store_with(tmp: Path, stalled_run: Path, *, old_summary: bool) -> Path:
    """A study folder: three hand-made baseline runs and the planted stall, whose summary is
    the trainer's, or (``old_summary``) as written before stall detection existed."""
    folder = tmp / ("old" if old_summary else "new")
    folder.mkdir()
    (folder / "spec.yaml").write_text(yaml.safe_dump({
        "name": "s", "methods": ["layerscale(init=-1e30)"], "scales": ["tiny"],
        "seeds": {"default": [0], "noise_floor": [0, 1, 2]}, "evaluation": {"probes": False},
        "overrides": ["train.steps=30", "train.stall_min_steps=20"]}))
    store = Store(folder)
    for seed, loss in BASE.items():
        store.register(f"b{seed}", "tiny", "baseline", seed)
        assert store.claim(f"b{seed}")
        store.finish(f"b{seed}", {"status": "completed", "final_val_loss": loss,
                                  "stalled_at_step": None, "params": 1000}, None)
    summary = json.loads((stalled_run / "summary.json").read_text())
    if old_summary:
        summary["status"] = "completed"
        for k in ("stalled_at_step", "unigram_loss", "unigram_entropy"):
            del summary[k]
    shutil.copytree(stalled_run, store.run_dir("stall"))
    store.register("stall", "tiny", "layerscale(init=-1e30)", 0)
    assert store.claim("stall")
    store.finish("stall", summary, None)
    return folder


@pytest.mark.parametrize("old_summary", [False, True])
def test_the_report_lists_the_stall(stalled_run: Path, tmp_path: Path,
                                    old_summary: bool) -> None:
    from modbench.study.results import load_results

    res = load_results(store_with(tmp_path, stalled_run, old_summary=old_summary))
    (r,) = [x for x in res.rows if x.key == "stall"]
    assert (r.status, r.stalled_at_step, r.stall_rederived) == ("stalled", 10, old_summary)
    assert {x.method: x.verdict for x in res.comparisons["tiny"]}[r.method] == "stalled"
    warning = next(w for w in budget_warnings(res) if "stalled at the unigram level" in w)
    assert f"`{r.method}` seed 0 at tiny (from step 10; {r.val_loss:.4f}, unigram level " \
           f"{r.unigram_loss:.4f})" in warning
    assert ("judged by this report" in warning) == old_summary
    out = write_report(res, tmp_path / f"report{old_summary}")
    md = (out / "report.md").read_text()
    table = md.split("## Divergences and stalls")[1].split("\n## ")[0]
    (line,) = [x for x in table.splitlines() if f"`{r.method}`" in x]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:7] == ["tiny", f"`{r.method}`", "0", "stalled", "10", f"{r.val_loss:.4f}",
                         f"{r.unigram_loss:.4f}"]
    table2 = md.split("## Methods against the baseline")[1].split("\n## ")[0]
    # the verdict's table first, then the table of what each method trained
    line = next(x for x in table2.splitlines() if x.startswith(f"| `{r.method}`"))
    header = next(x for x in table2.splitlines() if x.startswith("| method |"))
    cols = [c.strip() for c in header.strip().strip("|").split("|")]
    assert "(fewer than baseline; +1 stalled)" not in line and "+1 stalled" in line
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    assert cells[cols.index("verdict")] == "stalled"  # the verdict cell
    csv_rows = {x["key"]: x for x in csv.DictReader((out / "results.csv").open())}
    assert (csv_rows["stall"]["status"], csv_rows["stall"]["stalled_at_step"]) == ("stalled",
                                                                                   "10")
    verdicts = {x["method"]: x for x in json.loads((out / "results.json").read_text())["tiny"]}
    assert verdicts[r.method]["verdict"] == "stalled" and verdicts[r.method]["n_stalled"] == 1
