"""The study report: its tables agree with the runs it was built from."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from modbench.analysis.results import RunRow, StudyResults, check_claim, compare_scales
from modbench.analysis.stats import MethodResult, Verdict, compare
from modbench.cli import run_cli
from modbench.report.build import budget_warnings, write_report
from modbench.runtime.runfolder import curves
from modbench.study.runner import run_study
from modbench.study.spec import load_spec

scipy_stats = pytest.importorskip("scipy.stats")
multitest = pytest.importorskip("statsmodels.stats.multitest")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    spec = {"name": "r", "baseline": "baseline", "methods": ["qknorm", "post_ln", "layerscale"],
            "seeds": {"default": [0], "noise_floor": [0, 1, 2], "anchors": []},
            "scales": ["tiny"],
            "overrides": ["train.steps=6", "train.eval_every=3", "train.eval_probes=4"],
            "evaluation": {"probes": True, "limit": 6}}
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp / "study"
    run_study(load_spec(tmp / "spec.yaml"), out, progress=False)
    return out


def test_report_files_and_numbers(study: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["study", "report", str(study)]) == 0
    rep = study / "report"
    for name in ("report.md", "report.html", "results.csv", "results.json", "loss_tiny.png",
                 "gradnorm_tiny.png", "task_delta_tiny.png", "probe_mqar_tiny.png",
                 "probe_induction_tiny.png", "probe_cloze_tiny.png"):
        assert (rep / name).is_file(), name
    assert "data:image/png;base64," in (rep / "report.html").read_text()
    rows = list(csv.DictReader((rep / "results.csv").open()))
    assert len(rows) == 6  # baseline x3, qknorm, post_ln, layerscale
    assert {r["steps"] for r in rows} == {r["steps_planned"] for r in rows} == {"6"}
    base = [float(r["val_loss"]) for r in rows if r["method"] == "baseline"]
    sigma, mean = statistics.stdev(base), statistics.fmean(base)
    res = {r["method"]: r for r in json.loads((rep / "results.json").read_text())["tiny"]}
    methods = ("qknorm", "post_ln", "layerscale")
    ps = []
    for m in methods:
        (v,) = [float(r["val_loss"]) for r in rows if r["method"] == m]
        z = -(v - mean) / sigma  # lower loss is better: positive z = better
        assert res[m]["z"] == pytest.approx(z, rel=1e-9)
        # one seed: the prediction test, t reference with 3 - 1 = 2 df
        t = z / math.sqrt(1 + 1 / 3)
        p = 2 * scipy_stats.t.sf(abs(t), 2)
        assert res[m]["test"] == "prediction" and res[m]["df"] == 2 and res[m]["fewer_seeds"]
        assert res[m]["t"] == pytest.approx(t, rel=1e-9)
        assert res[m]["p"] == pytest.approx(p, rel=1e-6, abs=1e-300)
        assert res[m]["p_adjusted"]["bonferroni"] == pytest.approx(min(1.0, 3 * p), rel=1e-6,
                                                                    abs=1e-300)
        ps.append(p)
    holm = multitest.multipletests(ps, method="holm")[1]
    for m, h in zip(methods, holm, strict=True):
        assert res[m]["p_adjusted"]["holm"] == pytest.approx(h, rel=1e-6, abs=1e-300)
    md = (rep / "report.md").read_text()
    assert f"σ = {sigma:.4f} over 3 seeds (2 degrees of freedom" in md
    tokens = {json.loads(p.read_text())["tokens"] for p in (study / "runs").glob("*/summary.json")}
    assert len(tokens) == 1
    row = next(line for line in md.splitlines() if line.startswith("| `qknorm` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "1 (fewer than baseline)"
    assert cells[5] == "prediction" and cells[6].endswith("(2)")
    assert cells[11].endswith(" †")  # the verdict, marked: fewer seeds than the baseline
    # what was trained: its own table under the verdicts' (the two fit 1,400 pixels)
    trained = [line for line in md.splitlines() if line.startswith("| `qknorm` |")][1]
    cells = [c.strip() for c in trained.strip("|").split("|")]
    assert cells[1:3] == ["6", f"{tokens.pop() / 1e3:.3g}k"]
    header, desc = [line for line in md.splitlines() if line.startswith("| method |")][:2]
    assert "| method | seeds | val_loss |" in header and "| test | t (df) | p |" in header
    assert "| method | steps | tokens | params | train FLOPs/token |" in desc
    assert "No run diverged or stalled." in md
    # the warnings come first: 1-seed methods, 6 steps (few tokens per parameter)
    head = md.split("## Methods against the baseline")[0]
    assert head.index("## Warnings") < head.index("Verdict rule")
    assert "1 seed for `layerscale`, `post_ln`, `qknorm`" in head
    assert "tokens per parameter" in head
    assert "Holm-corrected p ≤ α = 0.05" in head and "|Δ| > 1σ" in head
    assert "<li>" in (rep / "report.html").read_text()


def test_probe_curves_follow_the_validation_records(study: Path) -> None:
    """Each run's probe curve has one point per validation (steps 0, 3, 6) and ends at the
    run's final_probes."""
    for run in sorted((study / "runs").iterdir()):
        c = curves(run)
        final = json.loads((run / "summary.json").read_text())["final_probes"]
        for name in ("mqar", "induction", "cloze"):
            assert [s for s, _ in c[f"probe:{name}"]] == [0, 3, 6]
            assert c[f"probe:{name}"][-1][1] == final[name]
            assert all(0.0 <= v <= 1.0 for _, v in c[f"probe:{name}"])


def test_divergence_table(tmp_path: Path) -> None:
    spec = {"name": "d", "methods": ["qknorm"], "seeds": {"default": [0], "noise_floor": []},
            "scales": ["tiny"], "evaluation": {"probes": False},
            "overrides": ["train.steps=20", "recipe.lr=1e30", "recipe.grad_clip=0",
                          "recipe.warmup_frac=0"]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run_study(load_spec(tmp_path / "spec.yaml"), tmp_path / "s", progress=False)
    assert run_cli(["study", "report", str(tmp_path / "s")]) == 0
    md = (tmp_path / "s" / "report" / "report.md").read_text()
    steps = {json.loads(p.read_text())["diverged_at_step"]
             for p in (tmp_path / "s" / "runs").glob("*/summary.json")}
    section = md.split("## Divergences")[1].split("##")[0]
    assert "| tiny | `qknorm` | 0 |" in section and "| tiny | `baseline` | 0 |" in section
    assert all(f"| {s} |" in section for s in steps)


def test_report_of_a_non_study(tmp_path: Path) -> None:
    assert run_cli(["study", "report", str(tmp_path)]) == 2


# ------------------------------------------------------------------ warnings on a study by hand


def fake_results(tmp: Path, seeds: dict[str, int], *, last_drop: float = 0.001,
                 steps: int = 1000, planned: int = 1000, tokens: int = 10**8,
                 extra: list[RunRow] | None = None) -> StudyResults:
    """A study written by hand: ``seeds[method]`` runs per method at scale "tiny", val_loss
    around 3.0, each run folder with a metrics.jsonl whose validation loss falls 10 → 3.1 →
    3.1 (1 - last_drop) over steps 0, steps/2, steps; 1e6 parameters."""
    rng = np.random.default_rng(5)
    rows = []
    for method, n in seeds.items():
        for seed in range(n):
            run = tmp / "runs" / f"{method}-{seed}"
            run.mkdir(parents=True)
            vals = [10.0, 3.1, 3.1 * (1 - last_drop)]
            (run / "metrics.jsonl").write_text("".join(
                json.dumps({"kind": "val", "step": s, "val_loss": v}) + "\n"
                for s, v in zip((0, steps // 2, steps), vals, strict=True)))
            rows.append(RunRow(key=f"{method}-{seed}", scale="tiny", method=method, seed=seed,
                               state="done", status="completed",
                               val_loss=3.0 + 0.01 * float(rng.standard_normal()),
                               params=10**6, tokens=tokens, diverged_at_step=None,
                               run_dir=run, steps=steps, steps_planned=planned))
    rows += extra or []
    return StudyResults(name="fake", folder=tmp, baseline="baseline", metric="val_loss",
                        anchors=[], rows=rows,
                        comparisons=compare_scales(rows, "baseline", "val_loss", []))


def test_no_warnings_with_three_seeds_and_flat_final_losses(tmp_path: Path) -> None:
    res = fake_results(tmp_path, {"baseline": 3, "a": 3, "b": 3})
    assert budget_warnings(res) == []
    md = (write_report(res, tmp_path / "report") / "report.md").read_text()
    assert "Warnings" not in md and "†" not in md
    rows = {r.method: r for r in res.comparisons["tiny"]}
    # equal spreads: the pooled error term of the scale's 9 seeds (6 df) decides
    assert rows["a"].test == "pooled" and not rows["a"].fewer_seeds
    line = next(x for x in md.splitlines() if x.startswith("| `a` |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "3"
    assert cells[5] == "pooled t"
    assert cells[6] == f"{rows['a'].t:.3f} (6)"
    lo, hi = rows["a"].ci  # Δ with the test's simultaneous interval, and the 80 % MDE
    assert lo < rows["a"].delta < hi and cells[3].count("[") == 1
    assert cells[12].endswith(f"({rows['a'].mde_sigma:.1f}σ)")
    trained = [x for x in md.splitlines() if x.startswith("| `a` |")][1]
    assert [c.strip() for c in trained.strip("|").split("|")][1:3] == ["1000", "100M"]


def test_one_seed_methods_warn_and_are_marked(tmp_path: Path) -> None:
    res = fake_results(tmp_path, {"baseline": 3, "a": 1, "b": 1})
    (warning,) = budget_warnings(res)
    assert "Fewer than 3 finite seeds" in warning and "1 seed for `a`, `b`" in warning
    md = (write_report(res, tmp_path / "report") / "report.md").read_text()
    assert md.index("## Warnings") < md.index("Verdict rule") < md.index("## Methods")
    assert "| `a` | 1 (fewer than baseline) |" in md
    assert "† fewer finite seeds than the baseline (3)" in md
    # with 2 methods and 2 df, one seed must be ~7.2 sigma away (t quantile, Bonferroni step)
    thr = scipy_stats.t.isf(0.05 / 4, 2) * math.sqrt(1 + 1 / 3)
    assert f"more than {thr:.1f}σ" in md


def test_short_runs_falling_losses_and_unfinished_runs_warn(tmp_path: Path) -> None:
    failed = RunRow(key="x", scale="tiny", method="a", seed=9, state="failed", status=None,
                    val_loss=None, params=None, tokens=None, diverged_at_step=None)
    res = fake_results(tmp_path, {"baseline": 3, "a": 3}, last_drop=0.05, steps=800,
                       planned=1000, tokens=10**6, extra=[failed])
    text = "\n".join(budget_warnings(res))
    assert "6 finished run(s) stopped before their planned steps" in text
    assert "`a` seed 0 at tiny (800 of 1000)" in text
    assert "1 run(s) did not finish (failed: 1)" in text
    assert "still falling fast" in text and "by more than 1% of its value" in text
    assert "3 of its runs fell 5.0% over steps 400→800" in text
    assert "1 tokens per parameter" in text  # 1e6 tokens, 1e6 parameters < 10
    md = (write_report(res, tmp_path / "report") / "report.md").read_text()
    line = [x for x in md.splitlines() if x.startswith("| `a` |")][1]  # what was trained
    assert "| 800 of 1000 | 1M |" in line
    # a scale whose baseline never finished: no verdicts there, and a warning says so
    other = RunRow(key="y", scale="small", method="a", seed=0, state="done",
                   status="completed", val_loss=2.0, params=10**6, tokens=10**8,
                   diverged_at_step=None, steps=10, steps_planned=10)
    res2 = fake_results(tmp_path / "two", {"baseline": 3, "a": 3}, extra=[other])
    assert list(res2.comparisons) == ["tiny"]
    assert "at small: no finished `baseline` run" in "\n".join(budget_warnings(res2))


# ------------------------------------------------------------------ the claim a study tests


def with_verdict(method: str, verdict: str) -> MethodResult:
    """A method's result with the given verdict (the numbers of one compared seed)."""
    r = compare({"baseline": [1.0, 1.1, 0.9], "m": [1.0]}, n_resamples=1)[1]
    return dataclasses.replace(r, method=method, verdict=Verdict(verdict),
                               is_baseline=verdict == "baseline")


def test_check_claim_outcomes() -> None:
    comparisons = {"tiny": [with_verdict("baseline", "baseline"),
                            with_verdict("a", "degrader"),
                            with_verdict("b", "improver"),
                            with_verdict("c", "within_noise"),
                            with_verdict("d", "diverged")]}
    expect = {"a": ["degrader", "diverged"], "b": ["degrader"], "c": ["improver"],
              "d": ["degrader", "diverged"], "e": ["improver"]}
    check = check_claim(comparisons, expect, "a paper", "a claim")
    assert [(r.method, r.outcome) for r in check.rows] == [
        ("a", "agrees"), ("b", "contradicts"), ("c", "not shown"), ("d", "agrees"),
        ("e", "not run")]
    assert check.summary == "contradicted"
    only_agree = check_claim(comparisons, {"a": ["degrader"], "d": ["diverged"]})
    assert only_agree.summary == "agrees"
    assert check_claim(comparisons, {"a": ["degrader"], "c": ["improver"]}).summary == \
        "partly shown"


def test_the_claim_opens_the_report(tmp_path: Path) -> None:
    res = fake_results(tmp_path, {"baseline": 3, "a": 3, "b": 3})
    verdicts = {r.method: str(r.verdict) for r in res.comparisons["tiny"]}
    res.claim = check_claim(res.comparisons, {"a": [verdicts["a"]], "b": ["improver"]},
                            "Someone et al. 2025, Table 3", "A and B both help.")
    out = write_report(res, tmp_path / "report")
    md = (out / "report.md").read_text()
    lines = md.splitlines()
    assert lines[0] == "# Study report: fake" and lines[2] == "## The claim this study tests"
    assert "**Claim** (Someone et al. 2025, Table 3): A and B both help." in md
    b_outcome = "agrees" if verdicts["b"] == "improver" else (
        "contradicts the claim" if verdicts["b"] in ("degrader", "diverged")
        else "not shown at this budget")
    assert f"`b` at tiny: measured **{verdicts['b']}**, the claim predicts improver: " \
           f"{b_outcome}." in md
    assert md.index("## The claim this study tests") < md.index("## Methods")
    html_text = (out / "report.html").read_text()
    assert "<b>Claim</b>" in html_text and "**" not in html_text


# ------------------------------------------------------------------ what the runs saw


def _with_hashes(res: StudyResults, hashes: dict[tuple[str, int], str | None]) -> StudyResults:
    for r in res.rows:
        r.batches_sha256 = hashes.get((r.method, r.seed), "same")
    return res


def test_runs_that_saw_different_batches_are_flagged(tmp_path: Path) -> None:
    """data.order fixed: every finished run at a scale with the same steps must share one
    batch hash; a run that saw other batches is named in a warning at the top."""
    res = _with_hashes(fake_results(tmp_path / "a", {"baseline": 3, "a": 3}),
                       {("a", 1): "other" * 8})
    (warning,) = budget_warnings(res)
    assert warning.startswith("Runs that should have seen the same batches did not")
    assert "at tiny, 1000 steps: 2 sequences" in warning
    assert "otherother… for `a` seed 1" in warning
    assert "same… for `baseline` seed 0, `baseline` seed 1, `baseline` seed 2, `a` seed 0, " \
           "`a` seed 2" in warning
    md = (write_report(res, tmp_path / "a" / "report") / "report.md").read_text()
    assert md.index("Runs that should have seen") < md.index("## Methods")


def test_one_hash_per_scale_and_steps_and_old_runs_are_not_flagged(tmp_path: Path) -> None:
    same = _with_hashes(fake_results(tmp_path / "a", {"baseline": 3, "a": 3}), {})
    assert budget_warnings(same) == []
    # runs without a hash (older runs) are skipped; so are diverged ones
    old = _with_hashes(fake_results(tmp_path / "b", {"baseline": 3, "a": 3}),
                       {("a", 1): None, ("a", 2): None})
    assert budget_warnings(old) == []
    # runs of other lengths form their own group
    short = RunRow(key="s", scale="tiny", method="a", seed=7, state="done", status="completed",
                   val_loss=3.0, params=10**6, tokens=10**8, diverged_at_step=None,
                   steps=500, steps_planned=500, batches_sha256="short")
    mixed = _with_hashes(fake_results(tmp_path / "c", {"baseline": 3, "a": 3}, extra=[short]),
                         {("a", 7): "short"})
    assert not any("same batches" in w for w in budget_warnings(mixed))


def test_per_seed_orders_compare_runs_of_one_seed(tmp_path: Path) -> None:
    """data.order per_seed: each init seed has its own batch sequence; only runs of one
    seed must agree."""
    hashes = {(m, s): f"seed{s}" for m in ("baseline", "a") for s in range(3)}
    res = _with_hashes(fake_results(tmp_path / "a", {"baseline": 3, "a": 3}), hashes)
    assert any("same batches" in w for w in budget_warnings(res))  # as if fixed
    res.data_order = "per_seed"
    assert budget_warnings(res) == []
    res.rows[-1].batches_sha256 = "other"  # `a` seed 2
    (warning,) = budget_warnings(res)
    assert "at tiny, 1000 steps, seed 2: 2 sequences" in warning
    assert "(data.order per_seed)" in warning


def test_the_data_order_comes_from_the_spec(tmp_path: Path) -> None:
    from modbench.study.results import load_results
    from modbench.study.store import Store

    for order in ("fixed", "per_seed"):
        folder = tmp_path / order
        folder.mkdir()
        spec = {"name": "o", "methods": [], "scales": ["tiny"], "data": {"order": order},
                "seeds": {"default": [0], "noise_floor": []}}
        (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
        Store(folder)
        assert load_results(folder).data_order == order


def test_runs_that_did_not_learn_are_flagged(tmp_path: Path) -> None:
    res = fake_results(tmp_path, {"baseline": 3, "a": 3})
    for r in res.rows:
        r.initial_val_loss = 6.2
    res.rows[-1].val_loss = 6.2383  # `a` seed 2: not below its initial loss
    (warning,) = budget_warnings(res)
    assert warning == ("1 finished run(s) did not learn (final validation loss not below the "
                       "initial one): `a` seed 2 at tiny (6.2000 → 6.2383).")
