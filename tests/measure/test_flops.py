"""Analytic FLOPs and parameters against torch's FLOP counter and the built models, for the
baseline and the study's combinations, with the conformance kit's flops check
(modbench.conformance.kit.flops_agree); every registered method gets the same check from the
kit in tests/methods/test_registry.py. The baseline formula on the real presets; the CLI."""

from __future__ import annotations

import json

import pytest

from modbench.cli import run_cli
from modbench.config import PRESETS
from modbench.conformance.kit import flops_agree
from modbench.measure import flop_report
from modbench.measure.flops import baseline_params
from modbench.methods.build import count_params
from tests.helpers import tiny

# the registered methods one by one: the kit, in tests/methods/test_registry.py
METHODS = ["baseline", "selective+qknorm", "gated_attn+qknorm", "qknorm+geglu"]
T = 64


@pytest.mark.parametrize("method", METHODS)
def test_analytic_matches_flop_counter(method: str) -> None:
    """Forward within 2 %, forward and backward within 4 % (the fused attention kernels'
    backward formula recomputes the scores), the report's parameters the built model's."""
    cfg = tiny(method).model
    flops_agree(cfg, T)  # raises CheckFailed naming the figure that differs


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
