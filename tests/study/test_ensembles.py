"""Studies with ``ensembles``: a method's seeds train stacked in one job, with the results of
seed-by-seed training, and methods that cannot stack still train seed by seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.study.results import load_rows
from modbench.study.runner import _jobs, run_study, use_ensembles
from modbench.study.spec import expand, load_spec
from tests.study.test_study import write_spec


def spec_with(tmp: Path, methods: list[str]) -> Path:
    return write_spec(tmp, methods=methods,
                      seeds={"default": [0, 1], "noise_floor": [0, 1, 2], "anchors": []},
                      evaluation={"probes": False})


def test_jobs_group_the_seeds_of_stackable_methods(tmp_path: Path) -> None:
    spec = load_spec(spec_with(tmp_path, ["qknorm", "denseformer"]))
    runs = expand(spec)
    stacked = {j.labels: len(j.keys) for j in _jobs(tmp_path, runs, spec, stack=True)}
    assert stacked == {("tiny/baseline/s0", "tiny/baseline/s1", "tiny/baseline/s2"): 3,
                       ("tiny/qknorm/s0", "tiny/qknorm/s1"): 2,
                       ("tiny/denseformer/s0",): 1, ("tiny/denseformer/s1",): 1}
    assert all(len(j.keys) == 1 for j in _jobs(tmp_path, runs, spec, stack=False))
    # per-seed data orders never share a job: their batches differ
    tree = json.loads(json.dumps(spec.to_dict()))
    tree["data"]["order"] = "per_seed"
    (tmp_path / "p.yaml").write_text(json.dumps(tree))
    per_seed = load_spec(tmp_path / "p.yaml")
    assert all(len(j.keys) == 1
               for j in _jobs(tmp_path, expand(per_seed), per_seed, stack=True))


def test_a_stacked_study_equals_the_seed_by_seed_study(tmp_path: Path) -> None:
    spec = load_spec(spec_with(tmp_path, ["qknorm", "denseformer"]))
    on = run_study(spec, tmp_path / "on", ensembles="on", progress=False)
    off = run_study(spec, tmp_path / "off", ensembles="off", progress=False)
    assert on["trained"] == off["trained"] == 7 and not on["failures"]
    a = {(r.method, r.seed): r for r in load_rows(tmp_path / "on")}
    b = {(r.method, r.seed): r for r in load_rows(tmp_path / "off")}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].state == "done" and a[k].key == b[k].key
        assert a[k].val_loss == pytest.approx(b[k].val_loss, rel=1e-5)
    summary = json.loads((a[("qknorm", 1)].run_dir / "summary.json").read_text())
    assert summary["stacked_seeds"] == [0, 1]
    alone = json.loads((a[("denseformer", 0)].run_dir / "summary.json").read_text())
    assert "stacked_seeds" not in alone
    # run again: nothing to do
    again = run_study(spec, tmp_path / "on", ensembles="on", progress=False)
    assert again["already_done"] == 7 and again["trained"] == 0


def test_use_ensembles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (use_ensembles("auto"), use_ensembles("on"), use_ensembles("off")) == (
        False, True, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_ensembles("auto")
    with pytest.raises(ModbenchError, match="--ensembles must be one of auto, on, off"):
        use_ensembles("yes")


def test_an_interrupted_stacked_job_resumes(tmp_path: Path) -> None:
    """Members left with checkpoints at one step resume stacked; a member cut before its first
    checkpoint starts again; the results equal an uninterrupted study's."""
    from typing import Any

    from modbench.study.store import Store
    from modbench.train.trainer import Callback, train_seeds

    class Kill(Callback):
        def on_step_end(self, run: Any, step: int, record: dict[str, Any]) -> None:
            if step + 1 == 3:
                raise RuntimeError("killed")

    spec = load_spec(write_spec(tmp_path, methods=["qknorm"],
                                seeds={"default": [0, 1], "noise_floor": [0, 1], "anchors": []},
                                overrides=["train.steps=4", "train.eval_every=0",
                                           "train.checkpoint_every=2"],
                                evaluation={"probes": False}))
    runs = [r for r in expand(spec) if r.method == "qknorm"]
    store = Store(tmp_path / "cut")
    for r in runs:
        store.register(r.key, r.scale, r.method, r.seed)
    dirs = [store.run_dir(r.key) for r in runs]
    with pytest.raises(RuntimeError, match="killed"):
        train_seeds(runs[0].config, [0, 1], dirs, callbacks=[Kill()], progress=False)
    res = run_study(spec, tmp_path / "cut", ensembles="on", progress=False)
    full = run_study(spec, tmp_path / "full", ensembles="on", progress=False)
    assert res["trained"] == full["trained"] == 4 and not res["failures"]
    cut = {(r.method, r.seed): r.val_loss for r in load_rows(tmp_path / "cut")}
    assert cut == {(r.method, r.seed): r.val_loss for r in load_rows(tmp_path / "full")}
