"""Diagnostics in studies: ``evaluation.diagnostics`` in a spec (validation, one-line errors),
the runner diagnosing the seeds it names, and the report's diagnostics tables, depth profiles
and per-layer training logs, checked against the runs' own ``diagnostics.json`` and
``metrics.jsonl``."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.report.diagnostics import (
    DIAGNOSTICS_DIR,
    DIAGNOSTICS_JSON,
    run_figures,
    training_profiles,
)
from modbench.study.jobs import _diagnose, _Member
from modbench.study.reporting import write_study_report
from modbench.study.runner import run_study
from modbench.study.spec import DiagnosticsSpec, expand, load_spec
from modbench.study.store import Store


def write_spec(tmp: Path, evaluation: Any, **kw: Any) -> Path:
    tree = {"name": "d", "baseline": "baseline", "methods": ["post_ln"],
            "seeds": {"default": [0], "noise_floor": [0, 1], "anchors": []},
            "scales": ["tiny"],
            "overrides": ["train.steps=3", "train.eval_every=0", "train.eval_sequences=8",
                          "train.log_layers=true", "train.threads=1"],
            "evaluation": evaluation, **kw}
    p = tmp / "spec.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


# ------------------------------------------------------------------------- the spec


def test_spec_forms(tmp_path: Path) -> None:
    def diag(value: Any) -> DiagnosticsSpec | None:
        return load_spec(write_spec(tmp_path, {"probes": False, "diagnostics": value})
                         ).evaluation.diagnostics

    assert diag({"batches": 3, "seeds": [1]}) == DiagnosticsSpec(batches=3, seeds=[1])
    assert diag(True) == DiagnosticsSpec()
    assert diag(None) is None and diag(False) is None
    assert load_spec(write_spec(tmp_path, {"probes": False})).evaluation.diagnostics is None


@pytest.mark.parametrize(("value", "message"), [
    ({"batch": 2}, "unknown study key 'evaluation.diagnostics.batch' (did you mean 'batches'?)"),
    ({"batches": 0}, "evaluation.diagnostics.batches must be a whole number"),
    ({"batches": "2"}, "evaluation.diagnostics.batches must be a whole number"),
    ({"batches": True}, "evaluation.diagnostics.batches must be a whole number"),
    ({"seeds": 0}, "evaluation.diagnostics.seeds must be a list of init seeds"),
    ({"seeds": []}, "evaluation.diagnostics.seeds must be a list of init seeds"),
    ({"seeds": [7]}, "evaluation.diagnostics.seeds names seed(s) [7] that no run"),
    ("yes", "study key 'evaluation.diagnostics' must be a mapping"),
])
def test_bad_diagnostics_are_refused_in_one_line(tmp_path: Path, value: Any,
                                                 message: str) -> None:
    with pytest.raises(ModbenchError) as e:
        expand(load_spec(write_spec(tmp_path, {"probes": False, "diagnostics": value})))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_diverged_run_or_another_seed_is_not_diagnosed(tmp_path: Path) -> None:
    m = _Member("k", "tiny/baseline/s1", resolve("tiny", seed=1), tmp_path / "no-run-here")
    _diagnose(m, {"status": "diverged"}, {"batches": 1, "seeds": None})
    _diagnose(m, {"status": "completed"}, {"batches": 1, "seeds": [0]})
    _diagnose(m, {"status": "completed"}, None)
    assert not (tmp_path / "no-run-here").exists()  # diagnose was never called


# ----------------------------------------------------------------- the report's numbers


def layer(var: float | None, skip: float, grad: float, max_abs: float, kurt: float | None,
          sink: float | None) -> dict[str, Any]:
    sub = {"variance": var, "max_abs": max_abs, "excess_kurtosis": kurt, "attn_sink": sink}
    return {"skip_delta_loss": skip, "grad_norm": grad, "attn": sub,
            "ffn": {"variance": 1.0, "max_abs": 0.5, "excess_kurtosis": 0.0}}


def test_run_figures_of_a_constructed_result() -> None:
    result = {
        "validation_loss": 5.0,
        "layers": [layer(0.5, 0.2, 4.0, 3.0, 1.0, 0.1), layer(1.0, -0.1, 1.0, 1.0, None, None),
                   layer(2.0, 0.5, 2.0, 9.0, 7.0, 0.3)],
        "final": {"max_abs": 2.0, "excess_kurtosis": 2.0},
        "weights": [{"layer": 0, "shape": [64, 64], "condition_number": 10.0, "alpha": 2.0},
                    {"layer": 1, "shape": [64, 64], "condition_number": None, "alpha": 4.0},
                    {"layer": 2, "shape": [8, 64], "condition_number": 30.0, "alpha": 3.0},
                    {"layer": 2, "shape": [2, 64], "condition_number": 1.5, "alpha": None},
                    {"layer": None, "shape": [512, 64], "condition_number": 1e9,
                     "alpha": 9.0}],  # the embedding; the [2, 64] side matrix: left out
        "quantization": {"w4_per_channel": {"delta": 0.25}, "w4_group": {"delta": 0.125},
                         "a8_per_token": {"loss": None, "delta": None}},
    }
    assert run_figures(result) == pytest.approx({
        "validation_loss": 5.0, "variance_growth": 2.0, "skip_mean": 0.2, "skip_min": -0.1,
        "grad_first_last": 2.0, "max_abs": 9.0, "max_kurtosis": 7.0, "attn_sink": 0.2,
        "condition_median": 20.0, "alpha_median": 3.0, "w4_per_channel": 0.25,
        "w4_group": 0.125, "a8_per_token": None})


def test_training_profiles_median_over_logged_steps() -> None:
    recs = [{"kind": "val", "step": 0},
            *[{"kind": "train", "step": s, "layers": {"grad_norm": [s, 10.0 * s],
                                                      "act_rms": [s / 10, s / 5]}}
              for s in (1, 2, 6)],
            {"kind": "train", "step": 7}]  # a record without layers (logging switched off)
    assert training_profiles(recs) == {"grad_norm": [2.0, 20.0], "act_rms": [0.6, 1.2]}
    assert training_profiles([{"kind": "train", "step": 1}]) is None


# ------------------------------------------------------------------ a study end to end


def test_a_study_with_diagnostics_end_to_end(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, {"probes": False, "primary": "val_loss",
                                           "diagnostics": {"batches": 1, "seeds": [0]}}))
    out = tmp_path / "study"
    counts = run_study(spec, out, workers=1, progress=False)
    assert counts["trained"] == 3 and not counts["failures"]
    # the spec as run keeps the request
    assert load_spec(out / "spec.yaml").evaluation.diagnostics == DiagnosticsSpec(1, [0])
    store = Store(out)
    diagnosed = {}
    for row in store.rows():
        path = store.run_dir(row["key"]) / DIAGNOSTICS_DIR / DIAGNOSTICS_JSON
        assert path.is_file() == (row["seed"] == 0), row
        if path.is_file():
            result = json.loads(path.read_text())
            assert result["batches"] == 1 and result["seed"] == 0
            diagnosed[row["method"]] = result
    assert set(diagnosed) == {"baseline", "post_ln"}
    report = write_study_report(out)
    md = (report / "report.md").read_text()
    section = md[md.index("## Diagnostics"):]
    for png in ("depth_profiles_tiny.png", "training_layers_tiny.png"):
        assert (report / png).is_file() and f"]({png})" in section
    for header in ("variance, last block / block 1", "skip Δloss, mean", "Δloss W4 per channel",
                   "Δloss W4 group", "Δloss A8 per token"):
        assert header in section
    assert "`baseline` | 1 |" in section and "`post_ln` | 1 |" in section  # one seed each
    # the CSV against the runs' own JSON, computed here
    rows = {r["method"]: r for r in csv.DictReader((report / "diagnostics.csv").open())}
    assert set(rows) == {"baseline", "post_ln"}
    for method, result in diagnosed.items():
        layers = result["layers"]
        assert float(rows[method]["w4_per_channel"]) == pytest.approx(
            result["quantization"]["w4_per_channel"]["loss"] - result["validation_loss"])
        assert float(rows[method]["grad_first_last"]) == pytest.approx(
            layers[0]["grad_norm"] / layers[-1]["grad_norm"])
        assert float(rows[method]["skip_mean"]) == pytest.approx(
            sum(x["skip_delta_loss"] for x in layers) / len(layers))
        assert math.isfinite(float(rows[method]["variance_growth"]))
