from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from modbench.data.cli import data_app
from modbench.errors import ModbenchError

runner = CliRunner()


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def texts(tmp_path: Path, docs: list[str]) -> Path:
    src = tmp_path / "texts"
    src.mkdir()
    for i, d in enumerate(docs[:40]):
        (src / f"{i:03d}.txt").write_text(d)
    return src


@pytest.mark.parametrize("cmd", [[], ["prepare"], ["info"], ["verify"]])
def test_help_has_example(cmd: list[str]) -> None:
    result = runner.invoke(data_app, [*cmd, "--help"])
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    assert "Example: modbench data" in out
    if cmd in ([], ["prepare"]):
        assert (
            "modbench data prepare --source ./texts --tokenizer builtin --vocab-size 4096 "
            "--out data/mytexts" in out
        )


def test_prepare_info_verify(tmp_path: Path, texts: Path, tokenizer_file: Path) -> None:
    out = tmp_path / "data" / "mytexts"
    result = runner.invoke(
        data_app,
        [
            "prepare",
            "--source",
            str(texts),
            "--tokenizer",
            str(tokenizer_file),
            "--out",
            str(out),
            "--seq-len",
            "32",
            "--val-fraction",
            "0.1",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["seq_len"] == 32
    assert meta["documents"]["train"] + meta["documents"]["val"] == 40

    result = runner.invoke(data_app, ["info", str(out)])
    assert result.exit_code == 0, result.output
    assert "seq_len     32" in result.output
    result = runner.invoke(data_app, ["info", str(out), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output) == meta

    result = runner.invoke(data_app, ["verify", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok:")

    shard = out / "train_00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    result = runner.invoke(data_app, ["verify", str(out)])
    assert isinstance(result.exception, ModbenchError)
    assert "train_00000.bin" in str(result.exception)


def test_prepare_builtin_tokenizer(tmp_path: Path, texts: Path) -> None:
    out = tmp_path / "o"
    result = runner.invoke(
        data_app,
        [
            "prepare",
            "--source",
            str(texts),
            "--tokenizer",
            "builtin",
            "--vocab-size",
            "512",
            "--out",
            str(out),
            "--seq-len",
            "16",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "metadata.json").read_text())["tokenizer"]["vocab_size"] == 512


def test_prepare_errors_propagate(tmp_path: Path, texts: Path) -> None:
    result = runner.invoke(
        data_app, ["prepare", "--source", str(texts), "--out", str(tmp_path / "o")]
    )
    assert isinstance(result.exception, ModbenchError)
    assert "--vocab-size" in str(result.exception)
    result = runner.invoke(data_app, ["info", str(tmp_path / "missing")])
    assert isinstance(result.exception, ModbenchError)
