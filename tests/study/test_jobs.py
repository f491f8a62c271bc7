"""A study job carries its runs' RunConfig objects: in process they reach the trainer as they
are; pickled for another process they cross as their serialised form and are read back by
from_dict."""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import pytest

import modbench.study.jobs as jobs
from modbench.config import RunConfig, resolve
from modbench.errors import ModbenchError
from modbench.study.jobs import Job, execute_job
from modbench.study.store import Store


def _job(root: Path, *cfgs: RunConfig) -> Job:
    keys = tuple(f"k{i}" for i in range(len(cfgs)))
    return Job(str(root), keys, keys, cfgs, {})


def _configs() -> tuple[RunConfig, RunConfig]:
    return (resolve("tiny", method="layerscale(init=1e-4)", seed=1,
                    overrides=["train.trackers=[tensorboard]", "recipe.betas=[0.8, 0.9]"]),
            resolve("cpu-deep", method="post_ln+comt", overrides=["train.seq_len=64"]))


def test_a_pickled_job_carries_the_serialised_configs(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfgs = _configs()
    job = _job(tmp_path, *cfgs)
    assert job.__getstate__()["configs"] == tuple(c.to_dict() for c in cfgs)
    read: list[Any] = []
    real = jobs.from_dict
    monkeypatch.setattr(jobs, "from_dict", lambda tree: read.append(tree) or real(tree))
    back = pickle.loads(pickle.dumps(job))
    assert back == job and back.configs == cfgs
    assert all(a is not b for a, b in zip(back.configs, cfgs, strict=True))
    assert read == [c.to_dict() for c in cfgs]  # each read back by from_dict, once


def _echo_configs(job: Job) -> list[dict[str, Any]]:
    return [c.to_dict() for c in job.configs]


def test_a_job_crosses_to_a_spawned_process(tmp_path: Path) -> None:
    cfgs = _configs()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_echo_configs, (_job(tmp_path, *cfgs),))
    assert got == [c.to_dict() for c in cfgs]


def test_a_corrupt_serialised_config_is_refused_when_read_back(tmp_path: Path) -> None:
    state = _job(tmp_path, *_configs()).__getstate__()
    state["configs"][1]["recipe"]["lr"] = -1.0
    blank = object.__new__(Job)
    with pytest.raises(ModbenchError, match=r"recipe\.lr must be positive") as e:
        blank.__setstate__(state)
    assert "\n" not in str(e.value)


def test_in_process_the_trainer_gets_the_jobs_own_config(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import modbench.train.trainer as trainer

    cfg = resolve("tiny")
    Store(tmp_path).register("k0", "tiny", "baseline", 0)
    given: list[RunConfig] = []

    def fake_train(c: RunConfig, out: Path, **kw: Any) -> dict[str, Any]:
        given.append(c)
        raise ModbenchError("stopped by the test")

    def no_read(tree: Any) -> RunConfig:
        raise AssertionError("a config was read back inside one process")

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.setattr(jobs, "from_dict", no_read)
    results = execute_job(_job(tmp_path, cfg))
    assert given == [cfg] and given[0] is cfg
    assert [(r.outcome, r.error) for r in results] == [("failed", "stopped by the test")]
