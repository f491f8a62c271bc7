"""The study report: its tables agree with the runs it was built from."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from modbench.cli import run_cli
from modbench.runtime.runfolder import curves
from modbench.study.runner import run_study
from modbench.study.spec import load_spec


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
    base = [float(r["val_loss"]) for r in rows if r["method"] == "baseline"]
    sigma, mean = statistics.stdev(base), statistics.fmean(base)
    res = {r["method"]: r for r in json.loads((rep / "results.json").read_text())["tiny"]}
    for m in ("qknorm", "post_ln", "layerscale"):
        (v,) = [float(r["val_loss"]) for r in rows if r["method"] == m]
        z = -(v - mean) / sigma  # lower loss is better: positive z = better
        assert res[m]["z"] == pytest.approx(z, rel=1e-9)
        p = math.erfc(abs(z) / math.sqrt(2))
        assert res[m]["p"] == pytest.approx(p, rel=1e-6, abs=1e-300)
        assert res[m]["p_adjusted"]["bonferroni"] == pytest.approx(min(1.0, 3 * p), rel=1e-6,
                                                                    abs=1e-300)
    md = (rep / "report.md").read_text()
    assert f"σ = {sigma:.4f}" in md
    assert "| `qknorm` | 1 |" in md and "No run diverged." in md


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
