"""K seeds stacked in one process (``train_seeds``, ``modbench train --seeds``): each member
equals its separate run, diverges alone, resumes, and leaves an ordinary run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.methods import load_all
from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.train.trainer import Callback, Member, Trainer, train, train_seeds
from tests.helpers import read_metrics, tiny

# loss and parameters of a member against its separate run: vmapped matmuls may sum in another
# order than a single model's, so equal to float32 rounding, not bit for bit. Parameters get
# an absolute 1e-5: Adam divides by the gradient's running RMS, so a weight whose gradient is
# float noise moves by up to ~lr either way (seen: 1.6e-6 on one Hyper-Connections weight).
RTOL, ATOL, PARAM_ATOL = 1e-5, 1e-6, 1e-5


def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def assert_same_run(a: Path, b: Path) -> None:
    ra, rb = strip(read_metrics(a)), strip(read_metrics(b))
    assert [(r["kind"], r["step"]) for r in ra] == [(r["kind"], r["step"]) for r in rb]
    for x, y in zip(ra, rb, strict=True):
        for k, v in x.items():
            if isinstance(v, float):
                assert y[k] == pytest.approx(v, rel=RTOL, abs=ATOL), (k, x["step"])
            else:
                assert y[k] == v
    wa, wb = load_checkpoint(a / CHECKPOINT)["model"], load_checkpoint(b / CHECKPOINT)["model"]
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=RTOL, atol=PARAM_ATOL)


STACKABLE = sorted(n for n, cls in load_all().items() if cls.stackable)


@pytest.mark.parametrize("method", ["baseline", *STACKABLE])
def test_each_member_equals_its_separate_run(method: str, tmp_path: Path) -> None:
    cfg = tiny(method, 0, 3, "train.eval_every=0")
    summaries = train_seeds(cfg, [0, 1], tmp_path / "stacked", progress=False)
    assert [s["seed"] for s in summaries] == [0, 1]
    assert all(s["stacked_seeds"] == [0, 1] for s in summaries)
    for seed in (0, 1):
        alone = train(tiny(method, seed, 3, "train.eval_every=0"), tmp_path / f"alone{seed}",
                      progress=False)
        assert_same_run(tmp_path / "stacked" / f"s{seed}", tmp_path / f"alone{seed}")
        mine = summaries[seed]
        assert mine["batches_sha256"] == alone["batches_sha256"]
        assert mine["final_val_loss"] == pytest.approx(alone["final_val_loss"], rel=RTOL)


def test_micro_batches_probe_rows_and_three_members(tmp_path: Path) -> None:
    over = ("train.micro_batch_size=4", "data.probe_mix=0.5", "data.probe_loss=answers",
            "train.eval_every=2", "train.eval_probes=4")
    train_seeds(tiny("qknorm", 0, 4, *over), [0, 1, 2], tmp_path / "k", progress=False)
    for seed in (0, 1, 2):
        train(tiny("qknorm", seed, 4, *over), tmp_path / f"a{seed}", progress=False)
        assert_same_run(tmp_path / "k" / f"s{seed}", tmp_path / f"a{seed}")
        probes = [r["probes"] for r in read_metrics(tmp_path / "k" / f"s{seed}")
                  if r["kind"] == "val"]
        assert len(probes) == 3 and set(probes[0]) == {"mqar", "induction", "cloze"}


@pytest.mark.parametrize("method", sorted(n for n, c in load_all().items() if not c.stackable))
def test_a_method_that_cannot_stack_is_refused_with_its_reason(method: str,
                                                              tmp_path: Path) -> None:
    with pytest.raises(ModbenchError, match=rf"method '{method}' cannot stack seeds") as e:
        Trainer(tiny(method, 0, 2), tmp_path / "x", seeds=[0, 1], progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


class PoisonMember(Callback):
    """A NaN into one weight of the member with this seed, after a given step."""

    def __init__(self, seed: int, at: int) -> None:
        self.seed, self.at = seed, at

    def after_optimizer_step(self, run: Member, step: int) -> None:
        if run.cfg.seed == self.seed and step + 1 == self.at:
            with torch.no_grad():
                run.model.blocks[0].ffn.core.up_proj.weight[0, 0] = float("nan")


def test_a_member_diverges_alone(tmp_path: Path) -> None:
    cfg = tiny("baseline", 0, 8, "train.eval_every=0")
    s0, s1 = train_seeds(cfg, [0, 1], tmp_path / "k", callbacks=[PoisonMember(1, 3)],
                         progress=False)
    assert s0["status"] == "completed" and s1["status"] == "diverged"
    assert s1["diverged_at_step"] == 4 and s1["steps"] == 3
    assert read_metrics(tmp_path / "k" / "s1")[-1]["nonfinite"] is True
    train(tiny("baseline", 0, 8, "train.eval_every=0"), tmp_path / "a", progress=False)
    assert_same_run(tmp_path / "k" / "s0", tmp_path / "a")


class Kill(Callback):
    def on_step_end(self, run: Member, step: int, record: dict[str, Any]) -> None:
        if step + 1 == 5:
            raise RuntimeError("killed")


def test_a_killed_ensemble_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    """Resumed together, or each member on its own (its folder is an ordinary run)."""
    cfg = lambda seed=0: tiny("post_ln+qknorm", seed, 8,  # noqa: E731
                              "train.checkpoint_every=2")
    full = train_seeds(cfg(), [3, 4], tmp_path / "full", progress=False)
    for cut in ("together", "apart"):
        with pytest.raises(RuntimeError, match="killed"):
            train_seeds(cfg(), [3, 4], tmp_path / cut, callbacks=[Kill()], progress=False)
        assert not any((tmp_path / cut / f"s{s}" / "summary.json").exists() for s in (3, 4))
    together = train_seeds(cfg(), [3, 4], tmp_path / "together", resume=True, progress=False)
    apart = [train(cfg(seed), tmp_path / "apart" / f"s{seed}", resume=True, progress=False)
             for seed in (3, 4)]
    for k, seed in enumerate((3, 4)):
        want = strip(read_metrics(tmp_path / "full" / f"s{seed}"))
        assert strip(read_metrics(tmp_path / "together" / f"s{seed}")) == want
        assert_same_run(tmp_path / "apart" / f"s{seed}", tmp_path / "full" / f"s{seed}")
        assert together[k]["final_val_loss"] == full[k]["final_val_loss"]
        assert apart[k]["batches_sha256"] == full[k]["batches_sha256"]


def test_member_folders_are_ordinary_runs(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny("layerscale", 0, 4, "train.checkpoint_every=2")
    train_seeds(cfg, [0, 1], tmp_path / "k", progress=False)
    assert run_cli(["eval", str(tmp_path / "k" / "s1"), "--no-probes"]) == 0
    ev = json.loads((tmp_path / "k" / "s1" / "eval.json").read_text())
    summary = json.loads((tmp_path / "k" / "s1" / "summary.json").read_text())
    assert ev["validation"]["loss"] == pytest.approx(summary["final_val_loss"], rel=1e-6)
    assert ev["seed"] == 1


def test_cli_seeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["train", "--preset", "tiny", "--steps", "3", "--seeds", "0,2",
                    "--out", str(tmp_path / "k"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "stacked 2 seeds in one process" in out
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["s0", "s2"]
    # a method that cannot stack: the seeds train one after another, and the command says so
    assert run_cli(["train", "--preset", "tiny", "--steps", "2", "--seeds", "0,1",
                    "--method", "denseformer", "--out", str(tmp_path / "d"),
                    "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "cannot stack seeds" in out and "one at a time" in out
    assert all((tmp_path / "d" / f"s{s}" / "summary.json").is_file() for s in (0, 1))
    assert run_cli(["train", "--preset", "tiny", "--seeds", "0,0", "--out",
                    str(tmp_path / "e")]) == 2
    assert run_cli(["train", "--preset", "tiny", "--seeds", "x", "--out",
                    str(tmp_path / "e")]) == 2
    assert run_cli(["train", "--preset", "tiny", "--seeds", "0,1", "--seed", "3", "--out",
                    str(tmp_path / "e")]) == 2
