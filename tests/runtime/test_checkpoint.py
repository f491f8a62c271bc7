"""Checkpoints load safely: a file carrying a pickled payload is refused without running it,
by the loader and by every command that reads a checkpoint (eval, export, --resume,
train.init_from)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.runtime.checkpoint import load_checkpoint, save_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.train.trainer import train
from tests.helpers import tiny


def _plant(path: str) -> str:
    Path(path).write_text("the payload ran")
    return "planted"


class Payload:
    """Unpickling this calls ``_plant(marker)``: code run by merely loading the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _plant, (str(self.marker),)


def poison(ckpt: Path, marker: Path) -> None:
    """Rewrite a real checkpoint with the payload tucked into it."""
    state = torch.load(ckpt, weights_only=True)
    state["note"] = Payload(marker)
    torch.save(state, ckpt)


def test_round_trip(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "step": 3, "config": {"a": [1, 2]},
             "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]},
             "initial_val_loss": None}
    save_checkpoint(tmp_path / "c.pt", state)
    back = load_checkpoint(tmp_path / "c.pt")
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["step"] == 3 and back["config"] == {"a": [1, 2]}
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_the_payload_is_real_and_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    torch.save({"step": 1, "x": Payload(marker)}, tmp_path / "evil.pt")
    # control: the unsafe loader runs it, so the test below would notice if ours did
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.read_text() == "the payload ran"
    marker.unlink()
    with pytest.raises(ModbenchError, match="holds objects other than tensors") as e:
        load_checkpoint(tmp_path / "evil.pt")
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_not_a_mapping_is_refused(tmp_path: Path) -> None:
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ModbenchError, match="not a modbench checkpoint"):
        load_checkpoint(tmp_path / "list.pt")


@pytest.mark.parametrize("command", ["eval", "export", "resume", "init_from"])
def test_commands_refuse_a_poisoned_run(command: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    cfg = tiny("baseline", 0, 4, "train.checkpoint_every=2")
    train(cfg, run, progress=False)
    marker = tmp_path / "ran.txt"
    poison(run / CHECKPOINT, marker)
    argv = {
        "eval": ["eval", str(run), "--no-probes"],
        "export": ["export", str(run), "--hf", str(tmp_path / "hf")],
        "resume": ["train", "--out", str(run), "--resume", "--no-progress"],
        "init_from": ["train", "--preset", "tiny", "--steps", "2", "--no-progress",
                      "--out", str(tmp_path / "b"), "--set", f"train.init_from={run}"],
    }[command]
    if command == "resume":
        (run / "summary.json").unlink()
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint") and "\n" not in err
    assert not marker.exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "b").exists()
