"""Study specs, the runner (skip what is done, resume what was cut) and the store."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.study.runner import run_study, study_status
from modbench.study.spec import builtin_specs, expand, load_spec
from modbench.study.store import Store


def write_spec(tmp: Path, **kw: object) -> Path:
    tree = {"name": "t", "baseline": "baseline", "methods": ["qknorm"],
            "seeds": {"default": [0], "noise_floor": [0, 1], "anchors": []},
            "scales": ["tiny"], "overrides": ["train.steps=4", "train.eval_every=0"],
            "data": {"probe_mix": 0.25}, "evaluation": {"probes": True, "limit": 5}}
    tree.update(kw)
    p = tmp / "spec.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


@pytest.mark.parametrize("name", sorted(builtin_specs()))
def test_builtin_specs_validate(name: str) -> None:
    runs = expand(load_spec(name))
    assert runs and len({r.key for r in runs}) == len(runs)


def test_expand_seeds_and_keys(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, methods=["qknorm", "post_ln"],
                                seeds={"default": [0], "noise_floor": [0, 1, 2],
                                       "anchors": ["qknorm"]}))
    runs = expand(spec)
    got = sorted((r.method, r.seed) for r in runs)
    assert got == [("baseline", 0), ("baseline", 1), ("baseline", 2), ("post_ln", 0),
                   ("qknorm", 0), ("qknorm", 1), ("qknorm", 2)]
    assert [r.key for r in expand(spec)] == [r.key for r in runs]  # stable
    assert all(r.config.train.steps == 4 and r.config.data.probe_mix == 0.25 for r in runs)


def test_data_order_per_seed(tmp_path: Path) -> None:
    """per_seed: init seed s trains on data seed data_seed + s, the same for every method;
    fixed (the default): one data order for all runs."""
    seeds = {"default": [0], "noise_floor": [0, 1, 2], "anchors": ["qknorm"]}
    per = expand(load_spec(write_spec(tmp_path, seeds=seeds,
                                      data={"data_seed": 7, "order": "per_seed"})))
    assert sorted((r.method, r.seed, r.config.data.data_seed) for r in per) == [
        ("baseline", 0, 7), ("baseline", 1, 8), ("baseline", 2, 9),
        ("qknorm", 0, 7), ("qknorm", 1, 8), ("qknorm", 2, 9)]
    fixed = expand(load_spec(write_spec(tmp_path, seeds=seeds, data={"data_seed": 7})))
    assert {r.config.data.data_seed for r in fixed} == {7}
    assert {r.key for r in fixed if r.seed == 0} == {r.key for r in per if r.seed == 0}


def test_probe_loss_reaches_runs_and_keeps_old_keys(tmp_path: Path) -> None:
    """data.probe_loss passes to every run; at its default ``all`` the run key is the hash the
    config had before the key existed, so finished runs of older stores are not retrained
    (the same for train.parallel and train.activation_checkpointing, added later)."""
    plain = expand(load_spec(write_spec(tmp_path, data={"probe_mix": 0.5})))
    masked = expand(load_spec(write_spec(tmp_path, data={"probe_mix": 0.5,
                                                         "probe_loss": "answers"})))
    assert {r.config.data.probe_loss for r in plain} == {"all"}
    assert {r.config.data.probe_loss for r in masked} == {"answers"}
    assert not {r.key for r in plain} & {r.key for r in masked}
    for r in plain:
        before = r.config.to_dict()
        del before["data"]["probe_loss"]
        # train.seq_len = model.max_seq_len here: no second length to key (issue 18)
        assert before["model"].pop("train_seq_len") is None
        assert before["train"].pop("parallel") == "ddp"
        assert before["train"].pop("fsdp_param_dtype") == "auto"  # issue 28
        assert before["train"].pop("activation_checkpointing") is False
        assert before["train"].pop("trackers") == []  # an execution key: never in the hash
        assert before["train"]["compile"] == "auto"  # an execution key: hashed as it was
        before["train"]["compile"] = False
        assert before["train"].pop("log_layers") is False  # execution keys, added later
        assert before["train"].pop("log_layers_every") == 0
        # the stall rule's keys at their defaults (docs/runs.md: it only labels an outcome)
        assert before["train"].pop("stall_margin") == 0.1
        assert before["train"].pop("stall_patience") == 0.5
        assert before["train"].pop("stall_min_steps") == 100
        # issue 27: how a run fits and survives on a cluster, at their defaults
        assert before["train"].pop("dist_timeout") == 1800.0  # an execution key
        # issue 46: the step timeout and torchrun's restarts, execution keys
        assert before["train"].pop("dist_step_timeout") == 300.0
        assert before["train"].pop("max_restarts") == 0
        assert before["train"].pop("device_memory_gb") is None
        assert before["train"].pop("onednn") is True  # issue 45: a replication factor
        # the stall stop's looks (studies: every 100 steps) where every validation is a look
        # anyway (here no validation before the end): hashed as before the key
        assert before["train"].pop("stop_stalled_every") == 100
        # recipe.optimizer=muon's keys at their defaults (issue 18)
        assert before["recipe"].pop("muon_momentum") == 0.95
        assert before["recipe"].pop("muon_nesterov") is True
        assert before["recipe"].pop("muon_ns_steps") == 5
        assert before["recipe"].pop("muon_adjust_lr") == "match_rms_adamw"
        assert before["recipe"].pop("muon_lr_ratio") == 1.0
        assert before["recipe"].pop("muon_layerwise_lr") == "none"
        assert before["recipe"].pop("muon_noise_beta") == 0.99
        assert before["recipe"].pop("muon_noise_max_ratio") == 10.0
        blob = json.dumps(before, sort_keys=True, separators=(",", ":"))
        assert r.key == hashlib.sha256(blob.encode()).hexdigest()[:16]


@pytest.mark.parametrize("kw,msg", [
    ({"method": ["x"]}, "unknown study key 'method'.*did you mean 'methods'"),
    ({"data": {"order": "shuffled"}}, "data.order must be one of fixed, per_seed"),
    ({"data": {"probe_loss": "keys"}}, "data.probe_loss must be all or answers"),
    ({"methods": ["qknrom"]}, "unknown method 'qknrom'"),
    ({"seeds": {"anchors": ["post_ln"]}}, "not in 'methods'"),
    ({"scales": ["tiny-x"]}, "unknown preset"),
    ({"overrides": ["train.stepz=3"]}, "unknown config key"),
    # a recipe that clashes once the methods' recipe exceptions apply (the baseline's adamw)
    ({"overrides": ["recipe.muon_layerwise_lr=noise"], "methods": ["osp"]},
     r"add recipe\.optimizer=muon"),
])
def test_bad_specs(tmp_path: Path, kw: dict, msg: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ModbenchError, match=msg):
        expand(load_spec(write_spec(tmp_path, **kw)))


def test_a_method_may_set_the_recipe_key_another_needs(tmp_path: Path) -> None:
    """osp sets optimizer=muon itself, so its runs take muon_layerwise_lr=noise (checked
    after the recipe exceptions), while the same override on the baseline is refused."""
    spec = load_spec(write_spec(tmp_path, baseline="osp", methods=["osp+qknorm"],
                                overrides=["train.steps=4", "recipe.muon_layerwise_lr=noise"]))
    runs = expand(spec)
    assert runs and all(r.config.recipe.muon_layerwise_lr == "noise" for r in runs)


def test_run_skip_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = load_spec(write_spec(tmp_path))
    out = tmp_path / "study"
    c = run_study(spec, out, progress=False)
    assert (c["total"], c["trained"], c["failed"]) == (3, 3, 0)
    rows = study_status(out)
    assert all(r["state"] == "done" and r["status"] == "completed" for r in rows)
    assert all(r["eval"]["tasks"]["mqar"]["n"] == 5 for r in rows)
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/summary.json")}

    # everything done: nothing is trained again
    again = run_study(spec, out, progress=False)
    assert (again["already_done"], again["trained"]) == (3, 0)
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("runs/*/summary.json")}

    # a run killed mid-way: claimed by a dead process, no summary; the rerun finishes it only
    victim = rows[1]["key"]
    (out / "runs" / victim / "summary.json").unlink()
    (out / "runs" / victim / "eval.json").unlink()
    db = sqlite3.connect(out / "index.sqlite")
    import socket

    db.execute("UPDATE runs SET state='running', worker=? WHERE key=?",
               (f"{socket.gethostname()}:999999999", victim))
    db.commit()
    db.close()
    assert run_cli(["study", "status", str(out)]) == 0
    assert "interrupted" in capsys.readouterr().out  # not "running": its worker is gone
    third = run_study(spec, out, progress=False)
    assert (third["already_done"], third["trained"]) == (2, 1)
    assert json.loads((out / "runs" / victim / "summary.json").read_text())["steps"] == 4
    others = {p: s for p, s in stamps.items() if victim not in str(p)}
    assert others == {p: p.stat().st_mtime_ns for p in others}  # untouched


def test_diverged_run_is_a_result(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, methods=[], seeds={"default": [0], "noise_floor": []},
                                overrides=["train.steps=20", "recipe.lr=1e30",
                                           "recipe.grad_clip=0", "recipe.warmup_frac=0"]))
    c = run_study(spec, tmp_path / "s", progress=False)
    assert c["diverged"] == 1 and c["failed"] == 0
    (row,) = study_status(tmp_path / "s")
    assert row["state"] == "done" and row["status"] == "diverged" and row["eval"] is None


def test_claims_are_exclusive(tmp_path: Path) -> None:
    a, b = Store(tmp_path), Store(tmp_path)
    a.register("k1", "tiny", "baseline", 0)
    assert a.claim("k1") is True
    import modbench.study.store as st

    original = st.worker_id
    st.worker_id = lambda: "elsewhere:1"  # type: ignore[assignment]
    try:
        assert b.claim("k1") is False  # held by a live worker
    finally:
        st.worker_id = original


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path)
    assert run_cli(["study", "validate", str(spec)]) == 0
    assert "valid — 3 runs" in capsys.readouterr().out
    assert run_cli(["study", "run", str(spec), "--out", str(tmp_path / "s"),
                    "--no-progress"]) == 0
    capsys.readouterr()
    assert run_cli(["study", "status", str(tmp_path / "s")]) == 0
    assert "3 completed" in capsys.readouterr().out
    assert run_cli(["study", "status", str(tmp_path)]) == 2
    assert run_cli(["study", "run", "no-such-spec", "--no-progress"]) == 2


def test_until_decided_adds_seeds_up_to_the_cap(tmp_path: Path) -> None:
    from modbench.analysis.results import read_looks
    from modbench.study.results import load_rows

    spec = load_spec(write_spec(tmp_path, methods=["qknorm", "post_ln"],
                                evaluation={"probes": False}))
    out = tmp_path / "s"
    c = run_study(spec, out, until_decided=3, progress=False)
    rows = load_rows(out)
    table: dict[str, dict[int, float | None]] = {}
    for r in rows:
        table.setdefault(r.method, {})[r.seed] = r.metric("val_loss")
    assert all(len(s) <= 3 for s in table.values())
    assert c["added_seeds"] == len(rows) - 4  # 2 baseline + 2 methods from the spec
    looks = read_looks(out)["tiny"]
    assert looks[-1].last  # the last look asked for nothing more
    decided = {m for lk in looks for m in lk.decided}
    # whatever no look decided has reached the cap, unless a seed failed (a result)
    assert all(len(s) == 3 or m in decided or None in s.values() for m, s in table.items())


# A small fake study: the store's rows are written by hand (no training, no run folders).
FAKE_LOSSES = {("baseline", 0): 3.0, ("baseline", 1): 3.1, ("baseline", 2): 2.9,
               ("qknorm", 0): 1.5,  # 15 sigma better than the floor: decided
               ("post_ln", 0): 3.5,  # 5 sigma worse, within the threshold's reach: undecided
               ("layerscale", 0): None}  # diverged
FAKE_TABLE: dict[str, dict[int, float | None]] = {  # what the tables must be, by hand
    "baseline": {0: 3.0, 1: 3.1, 2: 2.9}, "layerscale": {0: None}, "post_ln": {0: 3.5},
    "qknorm": {0: 1.5}}


def fake_study(tmp: Path) -> Path:
    write_spec(tmp, methods=["qknorm", "post_ln", "layerscale"],
               seeds={"default": [0], "noise_floor": [0, 1, 2], "anchors": []},
               overrides=["train.steps=4", "model.n_layers=3"], evaluation={"probes": False})
    store = Store(tmp)
    for (method, seed), loss in FAKE_LOSSES.items():
        key = f"{method}-{seed}"
        store.register(key, "tiny", method, seed)
        assert store.claim(key)
        summary = ({"status": "diverged", "diverged_at_step": 2} if loss is None
                   else {"status": "completed", "final_val_loss": loss, "params": 1000})
        store.finish(key, summary, None)
    store.register("qknorm-1", "tiny", "qknorm", 1)  # pending: in neither table
    store.register("post_ln-1", "tiny", "post_ln", 1)
    assert store.claim("post_ln-1")
    store.fail("post_ln-1", "boom")  # failed: in neither table
    store.register("cs", "cpu-small", "qknorm", 0)  # another scale, without a baseline
    assert store.claim("cs")
    store.finish("cs", {"status": "completed", "final_val_loss": 1.0}, None)
    return tmp


def test_runner_and_report_share_one_table(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's undecided-seed table and the report's comparison table are built by the
    same function (analysis.results.metric_table), and both equal the hand-built table."""
    import modbench.analysis.results as ar
    from modbench.analysis.stats import compare, sequential_look
    from modbench.study.results import load_results
    from modbench.study.spec import run_spec
    from modbench.study.stages.sequential import undecided_runs

    folder = fake_study(tmp_path)
    spec = load_spec(folder / "spec.yaml")
    built: list[tuple[str, object]] = []
    original = ar.metric_table

    def spy(rows: list[ar.RunRow], scale: str, metric: str,
            baseline: str) -> dict[str, dict[int, float | None]]:
        table = original(rows, scale, metric, baseline)
        built.append((scale, table))
        return table

    monkeypatch.setattr(ar, "metric_table", spy)

    results = load_results(folder)
    report_tables = dict(built)
    built.clear()
    new = undecided_runs(spec, folder, cap=3)
    runner_tables = dict(built)

    assert report_tables["tiny"] == runner_tables["tiny"] == FAKE_TABLE
    assert list(report_tables["tiny"]) == ["baseline", "layerscale", "post_ln", "qknorm"]
    assert report_tables["cpu-small"] == {"qknorm": {0: 1.0}}

    # the report's statistics are compare() of the hand-built table ...
    expected = [x.to_dict() for x in compare(FAKE_TABLE, "baseline", higher_is_better=False)]
    assert results.metric == "val_loss" and list(results.comparisons) == ["tiny"]
    assert (json.dumps([x.to_dict() for x in results.comparisons["tiny"]], default=str,
                       sort_keys=True) == json.dumps(expected, default=str, sort_keys=True))
    # ... and the runner's new seeds are the first look of the same table, by the same rule
    look = sequential_look(FAKE_TABLE, (), 3, higher_is_better=False, references=[],
                           correction="holm", floor_sigmas=1.0, stalled={}, n_resamples=1)
    assert dict(look.add) == {"post_ln": 1, "qknorm": 1}  # layerscale diverged: a result
    want = [run_spec(spec, "tiny", m, max(FAKE_TABLE[m]) + 1) for m in look.add]
    assert [(r.method, r.seed, r.key) for r in new] == [(r.method, r.seed, r.key) for r in want]


def test_load_results_flops_come_from_the_spec(tmp_path: Path) -> None:
    """FLOPs per (scale, method) are the analytic FLOPs of the run config the spec gives (its
    overrides included), with no run folder to read."""
    from modbench.config import resolve
    from modbench.measure.flops import flop_report
    from modbench.study.results import load_results

    folder = fake_study(tmp_path)
    assert not any((folder / "runs").iterdir())
    results = load_results(folder)
    for method in ("baseline", "qknorm", "post_ln", "layerscale"):
        cfg = resolve("tiny", method=method, seed=0, overrides=["model.n_layers=3"])
        direct = flop_report(cfg.model, cfg.train.seq_len)
        got = results.flops_of("tiny", method)
        assert got is not None
        assert got.train_flops_per_token == direct.train_flops_per_token
        assert got.flops_ratio == direct.flops_ratio
    preset = resolve("tiny", method="qknorm")  # without the spec's override: 2 layers
    flops = results.flops_of("tiny", "qknorm")
    assert flops is not None
    assert flops.train_flops_per_token != flop_report(preset.model,
                                                      preset.train.seq_len).train_flops_per_token


def test_a_folder_without_a_spec_uses_the_spec_defaults(tmp_path: Path) -> None:
    from modbench.study.results import load_results

    folder = fake_study(tmp_path)
    (folder / "spec.yaml").unlink()
    results = load_results(folder, metric="val_loss")
    assert (results.name, results.baseline, results.anchors) == (folder.name, "baseline", [])
    assert list(results.comparisons) == ["tiny"]
    with pytest.raises(ModbenchError, match="not a study folder"):
        load_results(tmp_path / "nothing")


def test_two_worker_processes_run_a_study_and_exit_cleanly(tmp_path: Path) -> None:
    """The spawn pool path: every run done once, the data prepared once by the parent, and the
    workers leave no leaked semaphores behind (no resource_tracker warnings at exit)."""
    import os
    import subprocess
    import sys

    spec = write_spec(tmp_path, methods=["qknorm"], evaluation={"probes": False})
    # a fresh cache: the corpus is prepared during this study (by the parent, before workers)
    env = {**os.environ, "PYTHONWARNINGS": "default", "MODBENCH_CACHE": str(tmp_path / "c")}
    res = subprocess.run([sys.executable, "-m", "modbench", "study", "run", str(spec), "--out",
                          str(tmp_path / "s"), "--workers", "2", "--no-progress", "--no-report"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "3 runs, 0 already done, 3 trained" in res.stdout
    assert "leaked" not in res.stderr and "resource_tracker" not in res.stderr
    from modbench.study.results import load_rows

    rows = load_rows(tmp_path / "s")
    assert sorted((r.method, r.seed, r.state) for r in rows) == [
        ("baseline", 0, "done"), ("baseline", 1, "done"), ("qknorm", 0, "done")]


def test_auto_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker per usable CPU (at most 8): the affinity mask (a SLURM allocation of 3
    CPUs on a 64-core node gives 3 workers of one thread), else the machine's count."""
    import os

    import torch

    from modbench.runtime.device import usable_cpus
    from modbench.study import runner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_cpus() == 2
    assert runner.auto_workers() == 2 and runner.LocalExecutor().workers == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 9, 17}, raising=False)
    assert runner.auto_workers() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert runner.auto_workers() == 8
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS: the machine's count
    assert usable_cpus() == 64 and runner.auto_workers() == 8
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cpus() == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runner.auto_workers() == 1
