"""Experiment trackers (train.trackers): what W&B (offline) and TensorBoard receive, read back
from the files they write, against the run's own metrics.jsonl and summary.json."""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from modbench.config import EXECUTION_KEYS, resolve
from modbench.errors import ModbenchError
from modbench.study.spec import config_key
from modbench.train import trackers
from modbench.train.trainer import Callback, Trainer, train
from tests.helpers import read_metrics, tiny


def _tiny_tracked(names: str, *extra: str, steps: int = 12) -> Any:
    return tiny("baseline", 0, steps, f"train.trackers=[{names}]", "train.log_every=2",
                "train.eval_every=6", *extra)


# --------------------------------------------------------------------------- config


def test_trackers_key_parses_from_set_and_yaml_and_is_checked(tmp_path: Path) -> None:
    assert resolve("tiny", overrides=["train.trackers=[wandb, tensorboard]"]).train.trackers \
        == ["wandb", "tensorboard"]
    assert resolve("tiny", overrides=["train.trackers=tensorboard"]).train.trackers == \
        ["tensorboard"]
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  trackers: [tensorboard]\n")
    assert resolve(yaml_file=f).train.trackers == ["tensorboard"]
    with pytest.raises(ModbenchError, match=r"unknown tracker 'wandbb'.*did you mean 'wandb'.*"
                                            r"known ones are wandb, tensorboard"):
        resolve("tiny", overrides=["train.trackers=[wandbb]"])
    with pytest.raises(ModbenchError, match="twice"):
        resolve("tiny", overrides=["train.trackers=[wandb, wandb]"])
    with pytest.raises(ModbenchError, match="list of names"):
        resolve("tiny", overrides=["train.trackers=[1]"])


def test_trackers_do_not_change_the_study_key() -> None:
    assert EXECUTION_KEYS["train.trackers"] is None
    plain = resolve("tiny")
    tracked = resolve("tiny", overrides=["train.trackers=[wandb, tensorboard]"])
    assert config_key(plain) == config_key(tracked)


def test_missing_package_is_refused_before_any_folder(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ModbenchError, match=r"tensorboard package is not installed.*"
                                            r"modbench\[tensorboard\]"):
        Trainer(_tiny_tracked("tensorboard"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_study_refuses_a_missing_tracker_before_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modbench.study.runner import run_study
    from modbench.study.spec import load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "t", "baseline": "baseline", "methods": [], "scales": ["tiny"],
        "seeds": {"default": [0], "noise_floor": [0], "anchors": []},
        "overrides": ["train.steps=2", "train.trackers=[wandb]"]}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ModbenchError, match=r"modbench\[wandb\]"):
        run_study(load_spec(spec), tmp_path / "study", progress=False)
    assert not (tmp_path / "study").exists()


@pytest.fixture
def no_wandb_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """W&B with no credentials anywhere it looks (environment, netrc, config dir), no mode in
    the environment and no settings read before (W&B keeps what it read in its process-wide
    setup: forgotten before and after); yields the wandb module."""
    wandb = pytest.importorskip("wandb")
    import inspect

    if "prompt" not in inspect.signature(wandb.login).parameters:
        pytest.skip("this wandb cannot look for credentials without prompting")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("HOME", str(tmp_path))
    wandb.teardown()
    yield wandb
    wandb.teardown()


def test_wandb_online_without_credentials_is_refused(tmp_path: Path,
                                                     no_wandb_credentials: Any) -> None:
    with pytest.raises(ModbenchError, match=r"no credentials.*WANDB_MODE=offline"):
        Trainer(_tiny_tracked("wandb"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_wandb_offline_from_its_settings_file_needs_no_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_wandb_credentials: Any) -> None:
    """`wandb offline` writes ``mode = offline`` into ./wandb/settings rather than the
    environment: the credential check reads W&B's settings as wandb.init will."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    trackers.check_trackers(["wandb"])  # offline: no credentials needed, nothing refused
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = online\n")
    no_wandb_credentials.teardown()  # forget the settings read above
    with pytest.raises(ModbenchError, match="no credentials"):
        trackers.check_trackers(["wandb"])


# ----------------------------------------------------------------------- grouping


def test_study_runs_are_grouped_by_study_and_named_by_method_and_seed(tmp_path: Path) -> None:
    study = tmp_path / "studies" / "folder"
    run = study / "runs" / "0123abcd"
    run.mkdir(parents=True)
    (study / "spec.yaml").write_text("name: my-study\n")
    cfg = tiny("post_ln+qknorm", 2, 5)
    assert trackers.study_of(run) == ("my-study", study.resolve())
    assert trackers.group_of(run) == "my-study"
    assert trackers.tensorboard_dir(cfg, run) == study.resolve() / "tensorboard" / "tiny" / \
        "post_ln+qknorm" / "s2"
    assert trackers.run_name(cfg) == "post_ln+qknorm-s2"
    single = tmp_path / "runs" / "t"
    assert trackers.study_of(single) is None
    assert trackers.group_of(single) == "runs"
    assert trackers.tensorboard_dir(cfg, single) == single / "tensorboard"


def test_flatten_keeps_finite_numbers_under_joined_keys() -> None:
    import torch

    got = trackers.flatten({"loss": torch.tensor(2.5), "probes": {"mqar": 0.5, "x": None},
                            "layers": {"rms": [1.0, None, 2.0]}, "bad": float("nan"),
                            "name": "a", "mixed": [1.0, "x"]})
    assert got == {"loss": 2.5, "probes/mqar": 0.5, "layers/rms/0": 1.0, "layers/rms/2": 2.0}
    assert trackers.val_values({"kind": "val", "step": 3, "val_loss": 1.5, "val_ppl": 4.5,
                                "probes": {"cloze": 0.25}}) == {
        "val/loss": 1.5, "val/ppl": 4.5, "val/probes/cloze": 0.25}


# --------------------------------------------------------------------- TensorBoard


def _scalars(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_events_equal_the_metrics_log(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = tmp_path / "run"
    summary = train(_tiny_tracked("tensorboard", "train.eval_probes=4"), run, progress=False)
    acc = _scalars(run / "tensorboard")
    rows = read_metrics(run)
    train_rows = [r for r in rows if r["kind"] == "train"]
    val_rows = [r for r in rows if r["kind"] == "val"]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8, 10, 12]  # log_every, as logged
    for tag, key, source in (("train/loss", "loss", train_rows),
                             ("train/grad_norm", "grad_norm", train_rows),
                             ("val/loss", "val_loss", val_rows)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in source]
        assert [e.value for e in events] == pytest.approx([r[key] for r in source], rel=1e-6)
    probes = acc.Scalars("val/probes/mqar")
    assert [e.value for e in probes] == pytest.approx(
        [r["probes"]["mqar"] for r in val_rows], rel=1e-6)
    final = acc.Scalars("summary/final_val_loss")
    assert final[-1].value == pytest.approx(summary["final_val_loss"], rel=1e-6)
    # the resolved config as text, and the hyperparameters with their outcome
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "method: baseline" in text and "trackers:" in text
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["model.method"].string_value == "baseline"
    assert start.hparams["recipe.lr"].number_value == pytest.approx(3e-3)
    assert start.hparams["status"].string_value == "completed"
    record = json.loads((run / "trackers.json").read_text())
    assert Path(record["tensorboard"]["log_dir"]) == (run / "tensorboard").resolve()


class Crash(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, run: Any, step: int, record: dict[str, Any]) -> None:
        if step + 1 == self.at:
            raise RuntimeError("crashed")


def test_a_resumed_run_shows_each_step_once(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = tmp_path / "run"
    cfg = lambda: _tiny_tracked("wandb, tensorboard", "train.checkpoint_every=4")  # noqa: E731
    with pytest.raises(RuntimeError, match="crashed"):
        train(cfg(), run, callbacks=[Crash(11)], progress=False)
    first = json.loads((run / "trackers.json").read_text())["wandb"]["id"]
    train(cfg(), run, resume=True, progress=False)
    acc = _scalars(run / "tensorboard")
    logged = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert [e.step for e in acc.Scalars("train/loss")] == logged == [2, 4, 6, 8, 10, 12]
    # the same W&B run continued: two offline attempts under one id, to sync together
    assert json.loads((run / "trackers.json").read_text())["wandb"]["id"] == first
    attempts = sorted((run / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(a.name.endswith(first) for a in attempts)
    assert not trackers._OPEN  # the crashed attempt's W&B run was finished, not left open


# -------------------------------------------------------------------- W&B offline


def _wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header (":W&B",
    magic, version), then LevelDB-log framed protobuf ``Record`` messages in 32 KiB blocks,
    each chunk with a (crc32, length, type) header; types 1 full, 2 first, 3 middle, 4 last."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts, out = 32768, 7, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts.append(data[pos + 7:pos + 7 + n])
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            out.append(rec)
            parts = []
        elif kind == 0:
            break
    return out


def _items(update: Any) -> dict[str, Any]:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in update}


def test_wandb_offline_run_holds_config_history_and_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_PROJECT", "modbench-test")
    (tmp_path / "wandb-dir").mkdir()
    study = tmp_path / "study"
    (study / "runs").mkdir(parents=True)
    (study / "spec.yaml").write_text("name: tracked-study\n")
    run = study / "runs" / "key1"
    summary = train(_tiny_tracked("wandb", "train.eval_probes=4", steps=10), run,
                    progress=False)
    files = list((tmp_path / "wandb-dir").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1 and not (run / "wandb").exists()  # WANDB_DIR is respected
    records = _wandb_records(files[0])
    info = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (info.project, info.run_group, info.job_type, info.display_name) == (
        "modbench-test", "tracked-study", "baseline", "baseline-s0")
    assert "baseline" in info.tags and "tiny" in info.tags
    config = _items(info.config.update)
    assert config["model"]["method"] == "baseline" and config["train"]["steps"] == 10
    assert config["meta"]["params"] == summary["params"]  # config.yaml, meta included
    assert config["study"] == "tracked-study"
    history = [_items(r.history.item) for r in records
               if r.WhichOneof("record_type") == "history"]
    rows = read_metrics(run)
    train_hist = [(h["step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert train_hist == [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
    val_hist = [(h["step"], h["val/loss"], h["val/probes/mqar"]) for h in history
                if "val/loss" in h]
    assert val_hist == [(r["step"], r["val_loss"], r["probes"]["mqar"]) for r in rows
                        if r["kind"] == "val"]
    final: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            final.update(_items(r.summary.update))
    assert final["final_val_loss"] == summary["final_val_loss"]
    assert final["status"] == "completed"
    assert final["final_probes/mqar"] == summary["final_probes"]["mqar"]
    assert json.loads((run / "trackers.json").read_text())["wandb"]["group"] == "tracked-study"


def test_stacked_seeds_get_one_tracker_run_each(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from modbench.train.trainer import train_seeds

    train_seeds(_tiny_tracked("tensorboard", steps=4), [0, 1], tmp_path / "k", progress=False)
    for s in (0, 1):
        acc = _scalars(tmp_path / "k" / f"s{s}" / "tensorboard")
        rows = [r for r in read_metrics(tmp_path / "k" / f"s{s}") if r["kind"] == "train"]
        assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(
            [r["loss"] for r in rows], rel=1e-6)


def test_config_yaml_records_the_trackers(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    train(_tiny_tracked("tensorboard", steps=2), tmp_path / "r", progress=False)
    stored = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert stored["train"]["trackers"] == ["tensorboard"]


def test_a_diverged_run_reports_its_status(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = tmp_path / "run"
    summary = train(_tiny_tracked("tensorboard", "recipe.lr=1e6", "recipe.warmup_frac=0"), run,
                    progress=False)
    assert summary["status"] == "diverged"
    acc = _scalars(run / "tensorboard")
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["status"].string_value == "diverged"
    scalars = acc.Tags()["scalars"]
    assert "summary/diverged_at_step" in scalars and "summary/final_val_loss" not in scalars
    assert acc.Scalars("summary/diverged_at_step")[0].value == summary["diverged_at_step"]
