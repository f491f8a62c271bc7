"""Live progress: the study's ETA from measured step times (planted metrics files, a fake
clock), its plain-line display, and the trainer's progress line."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml

from modbench.study import progress as sp
from modbench.study.runner import JobResult, run_study
from modbench.study.spec import load_spec
from modbench.study.store import Store
from modbench.train import live
from modbench.train.live import StepClock, TrainProgress, format_duration
from tests.helpers import tiny


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _append(run_dir: Path, step: int, loss: float, tps: float = 1000.0) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": step, "loss": loss, "lr": 1e-3,
                            "grad_norm": 1.0, "tokens_per_s": tps, "tokens": step}) + "\n")


def _claim(store: Store, key: str, at: float) -> None:
    assert store.claim(key)
    with store._db() as db:
        db.execute("UPDATE runs SET claimed_at=? WHERE key=?", (at, key))


def test_eta_from_planted_metrics_and_plain_lines(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "POLL_S", 1e6)  # no background polls: this test polls by hand
    monkeypatch.setattr(live, "PLAIN_EVERY_S", 0.0)
    store = Store(tmp_path)
    cfg = tiny("baseline", 0, 100)
    keys = ["r0", "r1", "r2", "r3"]
    for k in keys:
        store.register(k, "tiny", "baseline", 0)
    views = [sp.RunView(k, f"tiny/baseline/{k}", 100, sp.work_per_step(cfg), 512,
                        store.run_dir(k)) for k in keys]
    clock, out = Clock(990.0), io.StringIO()
    bar = sp.StudyProgress("t", views, store, workers=2, stream=out, terminal=False,
                           clock=clock, done_before=1)
    try:
        assert bar.eta() is None  # nothing measured yet: no guess
        _claim(store, "r0", 990.0)
        _claim(store, "r1", 990.0)
        clock.t = 1000.0
        _append(store.run_dir("r0"), 20, 5.0)
        _append(store.run_dir("r1"), 10, 5.5, tps=2048.0)
        bar.poll()
        # one observation each: the records' own step time (512 tokens / tokens per s)
        assert views[1].seconds_per_step() == pytest.approx(0.25)
        clock.t = 1010.0
        _append(store.run_dir("r0"), 40, 4.0)
        _append(store.run_dir("r1"), 30, 4.5)
        bar.poll()
        # measured: 20 steps in 10 s = 0.5 s/step each. Two workers: r0 ends in 60 x 0.5 =
        # 30 s, r1 in 70 x 0.5 = 35 s; r2 (50 s) follows r0 (80 s), r3 follows r1 (85 s)
        assert bar.eta() == pytest.approx(85.0)
        clock.t = 1040.0
        _append(store.run_dir("r0"), 100, 3.0)
        _append(store.run_dir("r1"), 90, 3.5)
        bar.poll()
        clock.t = 1045.0
        bar.finished(JobResult("r0", "tiny/baseline/r0", "trained", "completed"))
        # r0 spent 1045 - 990 - 100 x 0.5 = 5 s outside its steps, 5 s after its last step:
        # r1 ends in 10 x 0.5 + 5 = 10 s; r2 starts now (50 + 5 = 55 s), r3 at 10 s -> 65 s
        assert bar.eta() == pytest.approx(65.0)
        assert bar.steps_done() == 190 and bar.runs_done() == 2
        assert bar.headline() == "2/5 runs · 48% of steps · ETA 1m05s"
    finally:
        bar.close()
    text = out.getvalue()
    assert "study t: 2/5 runs · 48% of steps · ETA 1m05s" in text
    assert "  tiny/baseline/r1: step 90/100 · loss 3.5 · 1.0k tok/s" in text
    assert "tiny/baseline/r0 completed (last loss 3)" in text


def test_metrics_tail_reads_only_complete_new_lines_and_restarts_after_a_cut(
        tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr')
    tail = sp.MetricsTail(path)
    assert [r["step"] for r in tail.records()] == [1]
    with open(path, "a") as f:
        f.write('ain", "step": 2}\n')
    assert [r["step"] for r in tail.records()] == [2]
    path.write_text('{"kind": "train", "step": 1}\n')  # cut back by a resume
    assert [r["step"] for r in tail.records()] == [1]


def test_work_per_step_weighs_scales() -> None:
    small, big = tiny(), tiny("baseline", 0, 5, "model.d_model=128", "model.d_ff=352")
    assert sp.work_per_step(big) > 2 * sp.work_per_step(small)


def test_step_clock_leaves_out_the_warm_up() -> None:
    c = StepClock()
    c.observe(100.0, 1)  # the first step ended at t=100, after a long warm-up
    assert c.seconds_per_step() is None
    c.observe(104.0, 5)
    assert c.seconds_per_step() == pytest.approx(1.0)
    assert c.eta(95) == pytest.approx(95.0)
    c.observe(200.0, 2)  # restarted from an earlier checkpoint: measure again
    assert c.seconds_per_step() is None


def test_train_progress_plain_lines() -> None:
    clock, out = Clock(0.0), io.StringIO()
    p = TrainProgress(100, 0, "baseline s0", stream=out, clock=clock, every_s=10.0)
    p.update(1, 6.0, 1000.0)
    clock.t = 4.0
    p.update(5, 5.5, 1200.0)
    assert out.getvalue() == ""
    clock.t = 12.0
    p.update(20, 5.0, 1500.0)
    eta = 80 * (12.0 - 0.0) / 19
    assert out.getvalue() == f"baseline s0: step 20/100 · loss 5 · 1.5k tok/s · ETA " \
                             f"{format_duration(eta)}\n"
    assert p.postfix() == f"loss 5 · 1.5k tok/s · ETA {format_duration(eta)}"
    p.close()
    assert out.getvalue().count("\n") == 2  # and a last line where it ended


def test_study_run_prints_progress_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sp, "POLL_S", 0.05)
    monkeypatch.setattr(live, "PLAIN_EVERY_S", 0.0)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "live", "baseline": "baseline", "methods": [],
        "seeds": {"default": [0], "noise_floor": [0], "anchors": []}, "scales": ["tiny"],
        "overrides": ["train.steps=40", "train.eval_every=0"],
        "evaluation": {"probes": False}}))
    counts = run_study(load_spec(spec), tmp_path / "study", workers=1, progress=True)
    assert counts["trained"] == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if re.search(r"step \d+/40 · loss \d", ln)]
    assert lines, err
    assert re.search(r"tiny/baseline/s0 completed \(last loss [\d.]+\) · 1/1 runs", err)


def test_progress_off_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(tmp_path)
    bar = sp.StudyProgress("t", [sp.RunView("k", "k", 10, 1.0, 1)], store, enabled=False)
    bar.finished(JobResult("k", "k", "trained", "completed"))
    bar.close()
    assert bar.thread is None and capsys.readouterr().err == ""
