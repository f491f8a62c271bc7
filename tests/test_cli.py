"""The command line: happy paths and the one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from modbench.data import builtin_dataset
from tests.helpers import cli


def test_train_tiny_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "train", "--preset", "tiny", "--method", "post_ln+qknorm",
                       "--steps", "12", "--out", str(tmp_path / "r"), "--no-progress")
    assert code == 0, out
    assert "status:  completed" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["method"] == "post_ln+qknorm" and summary["steps"] == 12


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("argv,needles", [
    (["--method", "qk_norm"], ["unknown method 'qk_norm'", "did you mean 'qknorm'"]),
    (["--method", "post_ln+qknorm+post_ln"], ["listed twice"]),
    (["--set", "model.d_modle=64"], ["unknown config key", "did you mean 'model.d_model'"]),
    (["--set", "recipe.lr=fast"], ["recipe.lr", "number"]),
    (["--preset", "tiny-ish"], ["unknown preset", "did you mean 'tiny'"]),
    (["--recipe", "seed02"], ["unknown recipe", "did you mean 'seed002'"]),
    (["--set", "data.source=/nonexistent/shards"], ["does not exist", "data prepare"]),
])
def test_bad_input_one_line_and_no_folder(argv: list[str], needles: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--steps", "2", "--out", str(out),
                       "--no-progress", *argv)
    assert_one_line_error(code, err, *needles)
    assert not out.exists()


@pytest.mark.parametrize("argv,needles", [
    (["frobnicate"], ["No such command 'frobnicate'", "modbench --help"]),
    (["train", "--bogus"], ["No such option: --bogus", "modbench train --help"]),
    (["study", "show", "x"], ["No such command 'show'", "modbench study --help"]),
    (["train", "--steps", "many"], ["Invalid value for '--steps'", "modbench train --help"]),
])
def test_usage_errors_are_one_line(argv: list[str], needles: list[str],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, *argv)
    assert_one_line_error(code, err, *needles)


def test_conflicting_methods_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from modbench.methods import REGISTRY, register
    from tests.methods.test_registry import _placement_method

    register(_placement_method("zz_cli_placement"))
    try:
        code, _, err = cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "r"),
                           "--method", "zz_cli_placement+post_ln", "--no-progress")
    finally:
        REGISTRY.pop("zz_cli_placement")
    assert_one_line_error(code, err, "'zz_cli_placement' and 'post_ln'", "placement")
    assert not (tmp_path / "r").exists()


def test_vocab_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = builtin_dataset(512, 64, progress=False)
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "r"),
                       "--set", f"data.source={data}", "--set", "model.vocab_size=600",
                       "--no-progress")
    assert_one_line_error(code, err, "512", "600")
    assert not (tmp_path / "r").exists()


def test_corrupt_and_missing_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(builtin_dataset(512, 64, progress=False), data)
    shard = sorted(data.glob("train_*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "r"),
                       "--set", f"data.source={data}", "--no-progress")
    assert_one_line_error(code, err, shard.name)
    shard.unlink()
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "r"),
                       "--set", f"data.source={data}", "--no-progress")
    assert_one_line_error(code, err, shard.name)
    assert not (tmp_path / "r").exists()


def test_wrong_packing_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = builtin_dataset(512, 32, progress=False)
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "r"),
                       "--set", f"data.source={data}", "--no-progress")
    assert_one_line_error(code, err, "train.seq_len=32")


def test_resume_without_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "r"),
                       "--resume", "--no-progress")
    assert_one_line_error(code, err, "cannot resume")


def test_presets_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "presets", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["climb-1.2b"]["params"] == 1_216_710_656
    assert {"tiny", "cpu-small", "llama-60m", "llama-1b", "climb-3b"} <= set(rows)


def test_methods_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "methods", "--json")
    rows = json.loads(out)
    assert code == 0
    names = {r["name"] for r in rows}
    assert {"post_ln", "layerscale", "qknorm"} <= names
    for r in rows:
        assert set(r) >= {"name", "category", "citation", "summary"}


@pytest.mark.parametrize("cmd", [["train"], ["methods"], ["presets"], ["recipes"],
                                 ["data", "prepare"], ["data", "info"], ["data", "verify"]])
def test_every_command_has_help_with_example(cmd: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, *cmd, "--help")
    assert code == 0 and "Example" in out


def test_divergence_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A diverged single run exits 3 (a script can tell it from success), its folder and
    summary written all the same."""
    code, out, _ = cli(capsys, "train", "--preset", "tiny", "--steps", "30", "--out",
                       str(tmp_path / "r"), "--no-progress", "--set", "recipe.lr=1e30",
                       "--set", "recipe.grad_clip=0", "--set", "recipe.warmup_frac=0")
    assert code == 3 and "status:  diverged at step" in out
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "diverged"


def test_resume_from_the_run_folder_alone(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`modbench train --out DIR --resume` needs nothing else: the run's config.yaml is used."""
    from modbench.train.trainer import train
    from tests.helpers import read_metrics, tiny
    from tests.train.test_trainer import Kill

    def cfg():  # type: ignore[no-untyped-def]
        return tiny("layerscale+qknorm", 4, 12, "train.checkpoint_every=4")

    train(cfg(), tmp_path / "full", progress=False)
    with pytest.raises(RuntimeError):
        train(cfg(), tmp_path / "cut", callbacks=[Kill(10)], progress=False)
    code, _, err = cli(capsys, "train", "--out", str(tmp_path / "cut"), "--resume",
                       "--no-progress")
    assert code == 0, err
    losses = lambda p: [r["loss"] for r in read_metrics(p) if r["kind"] == "train"]  # noqa: E731
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    code, _, err = cli(capsys, "train", "--out", str(tmp_path / "cut"), "--resume", "--seed",
                       "5", "--no-progress")
    assert_one_line_error(code, err, "seed")


def test_methods_listing_shows_recipe_exceptions_and_recipe_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The methods that are recipe options (Muon, its noise-adaptive lr) are named under the
    listing, and a method's recipe exception (osp: optimizer=muon) is on its lines."""
    code, out, _ = cli(capsys, "methods")
    assert code == 0
    lines = out.splitlines()
    osp = lines.index(next(x for x in lines if x.startswith("osp ")))
    assert "recipe: optimizer=muon" in lines[osp + 1]
    assert "recipe.optimizer=muon" in lines[-1] and "muon_layerwise_lr=noise" in lines[-1]
