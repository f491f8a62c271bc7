"""Replication under a changed factor (``modbench study replicate``): which runs it trains,
where, what it judges (a verdict that replicates, one that does not, the claim again), the
factors' effect on the runs, the oneDNN switch, and one-line refusals. Runs are finished by a
recording executor with losses chosen per folder (no training), except the oneDNN test."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import modbench.study.runner as runner
from modbench.cli import run_cli
from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.report.replication import REPLICATE_DIR, REPLICATION_FILE
from modbench.study.spec import config_key, expand, load_spec
from modbench.study.stages.replication import parse_change
from modbench.study.store import Store
from tests.helpers import RecordingExecutor

Loss = Callable[[str, str, int], float | None]  # (folder name, method, seed) -> final loss


def losses(folder: str, method: str, seed: int) -> float | None:
    """The study: qknorm clearly better, post_ln clearly worse, softcap as the baseline. In
    ``replicate/threads-2`` the same; in ``replicate/seeds`` post_ln turns better."""
    noise = 0.002 * ((seed * 7) % 5)
    shift = {"baseline": 0.0, "qknorm": -0.2, "post_ln": 0.2, "softcap": 0.0}[method]
    if folder == "seeds" and method == "post_ln":
        shift = -0.2
    return 4.0 + shift + noise


@pytest.fixture
def study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, RecordingExecutor]:
    rec = RecordingExecutor(losses).install(monkeypatch)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "rep", "baseline": "baseline", "methods": ["qknorm", "post_ln", "softcap"],
        "seeds": {"default": [0, 1, 2], "noise_floor": [0, 1, 2], "anchors": []},
        "scales": ["tiny"], "overrides": ["train.steps=4"], "evaluation": {"probes": False},
        "claim": {"source": "test", "text": "qknorm helps, post_ln hurts",
                  "expect": {"qknorm": ["improver"], "post_ln": ["degrader"]}}}))
    out = tmp_path / "study"
    runner.run_study(load_spec(spec), out, progress=False)
    rec.ran.clear()
    return out, rec


def test_only_decided_verdicts_and_the_baseline_run_again_and_replicate(
        study: tuple[Path, RecordingExecutor], capsys: pytest.CaptureFixture[str]) -> None:
    out, rec = study
    assert run_cli(["study", "replicate", str(out), "--change", "threads=2",
                    "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "replication under threads=2: 2 of 2 decided verdicts replicate" in said
    # softcap was within noise: not run again; the baseline and the two decided ones are
    assert sorted({m for _, m, _ in rec.ran}) == ["baseline", "post_ln", "qknorm"]
    assert {f for f, _, _ in rec.ran} == {"threads-2"}
    folder = out / REPLICATE_DIR / "threads-2"
    rows = Store(folder).rows()
    assert all(yaml.safe_load((folder / "runs" / r["key"] / "config.yaml").read_text())
               ["train"]["threads"] == 2 for r in rows if (folder / "runs" / r["key"]).is_dir())
    assert all(r["key"] not in {x["key"] for x in Store(out).rows()} for r in rows)
    data = json.loads((folder / REPLICATION_FILE).read_text())
    assert (data["replicated"], data["verdicts"], data["agreement"]) == (2, 2, 1.0)
    assert [p["method"] for p in data["scales"]["tiny"]] == ["post_ln", "qknorm"]
    assert all(p["sign_agrees"] and p["replicates"] for p in data["scales"]["tiny"])
    assert data["claim"]["same"] and data["claim"]["replication"] == "agrees"
    md = (out / "report" / "report.md").read_text()
    assert "## Replication" in md and "**threads=2**" in md
    # asked again: nothing trains twice
    rec.ran.clear()
    assert run_cli(["study", "replicate", str(out), "--change", "threads=2",
                    "--no-progress"]) == 0
    assert rec.ran == []


def test_a_verdict_that_flips_does_not_replicate_and_the_claim_says_so(
        study: tuple[Path, RecordingExecutor]) -> None:
    out, _ = study
    runner.replicate_study(out, ["seeds"], progress=False)
    data = json.loads((out / REPLICATE_DIR / "seeds" / REPLICATION_FILE).read_text())
    pairs = {p["method"]: p for p in data["scales"]["tiny"]}
    assert pairs["post_ln"]["original"]["verdict"] == "degrader"
    assert pairs["post_ln"]["replication"]["verdict"] == "improver"
    assert not pairs["post_ln"]["sign_agrees"] and not pairs["post_ln"]["replicates"]
    assert pairs["qknorm"]["replicates"] and data["agreement"] == 0.5
    assert not data["claim"]["same"] and data["claim"]["replication"] == "contradicted"
    seeds = {int(r["seed"]) for r in Store(out / REPLICATE_DIR / "seeds").rows()}
    assert seeds == {1000, 1001, 1002}


def test_each_factor_changes_its_runs(tmp_path: Path) -> None:
    spec = load_spec("smoke-tiny")
    base = {(r.method, r.seed): r.config for r in expand(spec)}

    def changed(text: str) -> dict[tuple[str, int], Any]:
        return {(r.method, r.seed): r.config for r in expand(parse_change(text).apply(spec))}

    assert set(changed("seeds=10")) == {(m, s + 10) for m, s in base}
    assert changed("data-order")["baseline", 0].data.data_seed == spec.data.data_seed + 1
    assert changed("dtype")["baseline", 0].recipe.precision == "bf16"
    assert changed("compile=false")["baseline", 0].train.compile is False
    assert changed("threads=3")["baseline", 0].train.threads == 3
    assert changed("onednn")["baseline", 0].train.onednn is False
    # a run that leaves oneDNN on keeps its key; off is another run
    cfg = resolve("tiny")
    assert config_key(cfg) == config_key(resolve("tiny", overrides=["train.onednn=true"]))
    assert config_key(cfg) != config_key(resolve("tiny", overrides=["train.onednn=false"]))


@pytest.mark.parametrize(("text", "message"), [
    ("thread", r"unknown factor 'thread' \(did you mean 'threads'\?\)"),
    ("threads=0", "threads takes a whole number of at least 1"),
    ("dtype=fp16", "dtype takes bf16 or fp32"),
    ("onednn=maybe", "onednn takes off or on"),
    ("seeds=x", "seeds takes a whole number"),
])
def test_a_bad_change_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ModbenchError, match=message):
        parse_change(text)


def test_replicating_a_folder_that_is_no_study_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModbenchError, match="is not a study folder"):
        runner.replicate_study(tmp_path, ["threads"], progress=False)
    assert not (tmp_path / REPLICATE_DIR).exists()


def test_onednn_off_turns_the_kernels_off_for_the_run_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    import torch

    from modbench.train.trainer import train

    asked: list[bool] = []
    real = torch.backends.mkldnn.flags

    @contextlib.contextmanager
    def spy(enabled: bool = False, **kw: Any) -> Iterator[None]:
        asked.append(enabled)
        with real(enabled=enabled, **kw):
            assert torch.backends.mkldnn.enabled is enabled
            yield

    monkeypatch.setattr(torch.backends.mkldnn, "flags", spy)
    cfg = resolve("tiny", overrides=["train.steps=2", "train.onednn=false"])
    train(cfg, tmp_path / "run", progress=False)
    assert asked == [False] and torch.backends.mkldnn.enabled
