"""Analytic FLOPs and parameters against torch's FLOP counter and the built models, for every
registered method (generic over the registry) and the study's combinations."""

from __future__ import annotations

import json

import pytest

from modbench.analysis import flop_report, measure_flops
from modbench.analysis.flops import baseline_params
from modbench.cli import run_cli
from modbench.config import PRESETS
from modbench.methods import load_all
from modbench.methods.build import build_model, count_params
from tests.helpers import tiny

METHODS = ["baseline", *sorted(load_all()), "selective+qknorm", "gated_attn+qknorm",
           "qknorm+geglu"]
T = 64


@pytest.mark.parametrize("method", METHODS)
def test_analytic_matches_flop_counter(method: str) -> None:
    cfg = tiny(method).model
    report = flop_report(cfg, T)
    model = build_model(cfg, seed=0)
    fwd = measure_flops(model, T)
    assert report.forward_flops_per_token == pytest.approx(fwd, rel=0.02), method
    # backward: 2x forward for matrices; the fused attention kernels' backward formula
    # recomputes the scores (2.5x), so training agrees within a few percent, not exactly
    train = measure_flops(model, T, train=True)
    assert report.train_flops_per_token == pytest.approx(train, rel=0.04), method
    assert report.params == count_params(cfg)


def test_baseline_formula_on_real_presets() -> None:
    for name in ("cpu-small", "llama-130m", "climb-1.2b"):
        cfg = PRESETS[name].model
        assert baseline_params(cfg) == count_params(cfg), name
    r = flop_report(PRESETS["climb-1.2b"].model, 1024)
    # Appendix C: 24 L (4 T d^2-ish projections + 4 T^2 d + 6 T d d_ff) + head, per token
    d, ff, L, V = 2048, 5632, 24, PRESETS["climb-1.2b"].model.vocab_size
    dkv = 8 * 64
    per_layer = 2 * d * d * 2 + 2 * 2 * d * dkv + 4 * 1024 * d + 6 * d * ff
    assert r.forward_flops_per_token == per_layer * L + 2 * d * V
    assert r.train_flops_per_token == 3 * r.forward_flops_per_token


def test_flops_cli(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["flops", "--preset", "tiny", "--method", "diff_attn", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and len(rows) == 1
    r = rows[0]
    assert r["method"] == "diff_attn" and r["seq_len"] == 64
    assert r["params"] == count_params(tiny("diff_attn").model)
    assert r["train_flops_per_token"] == 3 * r["forward_flops_per_token"]
    assert r["flops_ratio"] > 1.0
    code = run_cli(["flops", "--preset", "tiny"])
    out = capsys.readouterr().out
    assert code == 0 and "baseline" in out and "relu2" in out and "softpick" in out
    assert run_cli(["flops", "--help"]) == 0 and "Example" in capsys.readouterr().out
    assert run_cli(["flops", "--preset", "tiny", "--method", "softpik"]) == 2
    assert "did you mean 'softpick'" in capsys.readouterr().err
