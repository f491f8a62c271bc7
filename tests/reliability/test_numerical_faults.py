"""Numerical faults: a run forced to NaN and a run forced to stall end as outcomes (status
diverged or stalled, exit code 3) with their status, step and last grad norms in
summary.json; a study holding such runs goes on, and its report shows them (the Divergences
and stalls table, the verdicts diverged and stalled, and a warning naming the stall)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from modbench.cli import run_cli
from modbench.data import builtin_dataset, open_dataset

NAN = ["--set", "recipe.lr=1e30", "--set", "recipe.grad_clip=0", "--set",
       "recipe.warmup_frac=0"]
NAN_METHOD = "layerscale(init=.inf)"  # infinite residual scales: NaN on the first step
STALL_METHOD = "layerscale(init=-1e30)"  # saturated: every gradient is zero, nothing learns


def unigram_loss() -> float:
    """Cross-entropy of the tiny preset's validation tokens under the training unigram: the
    loss of a model that ignores its input."""
    ds = open_dataset(builtin_dataset(512, 64, progress=False))
    train = np.concatenate([np.asarray(m).ravel() for m in ds._shards["train"]])
    val = np.concatenate([np.asarray(m).ravel() for m in ds._shards["val"]])
    p = np.bincount(train, minlength=512) / train.size
    return float(-np.log(np.maximum(p[val], 1e-12)).mean())


def train_cli(tmp: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    out = tmp / "run"
    code = run_cli(["train", "--preset", "tiny", "--steps", "30", "--no-progress", "--out",
                    str(out), *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert code == (3 if summary["status"] in ("diverged", "stalled") else 0), code
    return summary


def test_a_run_forced_to_nan_ends_as_diverged(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    s = train_cli(tmp_path, capsys, *NAN)
    assert s["status"] == "diverged" and s["final_val_loss"] is None
    at = s["diverged_at_step"]
    assert isinstance(at, int) and 1 <= at <= 30 and s["steps"] == at - 1
    norms = s["last_grad_norms"]
    assert norms[-1] == {"step": at, "grad_norm": None}
    assert [n["step"] for n in norms] == list(range(max(1, at - 9), at + 1))
    last = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()][-1]
    assert last["step"] == at and last["nonfinite"] is True


def test_a_run_forced_to_stall_ends_with_its_signature(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    # 30 steps: a stretch of 20 steps at the unigram level is allowed to count (the default,
    # 100 steps, keeps short healthy runs out; tests/runtime/test_stall.py trains 120)
    s = train_cli(tmp_path, capsys, "--method", STALL_METHOD, "--set",
                  "train.stall_min_steps=20")
    assert s["status"] == "stalled" and s["steps"] == 30
    assert s["stalled_at_step"] == 10  # the first validation after warm-up (2 steps)
    assert [n["step"] for n in s["last_grad_norms"]] == list(range(21, 31))
    assert all(n["grad_norm"] == 0.0 for n in s["last_grad_norms"])
    assert s["final_val_loss"] >= unigram_loss()
    assert s["final_val_loss"] >= s["unigram_loss"]
    assert s["final_val_loss"] == pytest.approx(s["initial_val_loss"])


def test_a_study_with_faulty_runs_goes_on_and_reports_them(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          record: Any) -> None:
    spec = {"name": "faults", "baseline": "baseline", "methods": [NAN_METHOD, STALL_METHOD],
            "seeds": {"default": [0], "noise_floor": [0, 1, 2], "anchors": []},
            "scales": ["tiny"], "overrides": ["train.steps=60", "train.eval_every=20",
                                              "train.stall_min_steps=20"],
            "evaluation": {"probes": False}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "study"
    code = run_cli(["study", "run", str(tmp_path / "spec.yaml"), "--out", str(out),
                    "--workers", "1", "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "5 runs, 0 already done, 5 trained, 1 diverged, 1 stalled, 0 failed" in text
    md = (out / "report" / "report.md").read_text()
    divergences = md.split("## Divergences")[1].split("\n## ")[0]
    nan_rows = [x for x in divergences.splitlines() if f"`{NAN_METHOD}`" in x]
    assert len(nan_rows) == 1 and "| 1 |" in nan_rows[0]  # diverged at step 1
    stall_rows = [x for x in divergences.splitlines() if f"`{STALL_METHOD}`" in x]
    assert len(stall_rows) == 1 and "| stalled | 20 |" in stall_rows[0]  # from step 20
    loss = float(stall_rows[0].split("|")[6])  # its last finite validation loss
    assert loss >= unigram_loss() and math.isfinite(loss)
    table2 = md.split("## Methods against the baseline")[1].split("\n## ")[0]
    stall = next(x for x in table2.splitlines() if x.startswith(f"| `{STALL_METHOD}`"))
    nan = next(x for x in table2.splitlines() if x.startswith(f"| `{NAN_METHOD}`"))
    assert "| stalled |" in stall and "+1 stalled" in stall and "diverged" in nan
    assert "stalled at the unigram level (status stalled" in md
    assert f"`{STALL_METHOD}` seed 0 at tiny (from step 20;" in md
    record({"runs": 5, "diverged": 1, "stalled": 1, "failed": 0,
            "reported": ["Divergences and stalls table", "Table 2 verdicts diverged and "
                         "stalled", "stall warning"]})
