"""transformers' remote code (docs/reliability.md, the trust boundary): a folder that asks
transformers to run its own Python (``auto_map``) is refused in one line, with no prompt, by
``modbench remove-norm`` and ``modbench data prepare --tokenizer DIR``; answering "y" on
stdin changes nothing. No network: every folder is local."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def _modbench(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "modbench", *args], cwd=cwd, input="y\ny\n",
                          capture_output=True, text=True, timeout=300, env=env)


def _one_line_refusal(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Do you wish to run" not in r.stdout + r.stderr


def test_remove_norm_refuses_a_folder_with_custom_code(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "custom.py").write_text(EVIL.format(marker=str(marker))
                                      + "from transformers import PretrainedConfig\n"
                                      "class C(PretrainedConfig):\n    model_type = 'gpt2'\n")
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "evil", "auto_map": {"AutoConfig": "custom.C"}}))
    r = _modbench(["remove-norm", str(folder), "--out", str(tmp_path / "out"), "--steps", "1"],
                  tmp_path)
    _one_line_refusal(r)
    assert "auto_map" in r.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_data_prepare_refuses_a_tokenizer_folder_with_custom_code(tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "tok.py").write_text(EVIL.format(marker=str(marker))
                                   + "from transformers import PreTrainedTokenizerFast\n"
                                   "class T(PreTrainedTokenizerFast):\n    pass\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T", "auto_map": {"AutoTokenizer": [None, "tok.T"]}}))
    (tmp_path / "texts.txt").write_text("hello world\n" * 50)
    r = _modbench(["data", "prepare", "--source", str(tmp_path / "texts.txt"), "--tokenizer",
                   str(folder), "--out", str(tmp_path / "data")], tmp_path)
    _one_line_refusal(r)
    assert not marker.exists() and not (tmp_path / "data").exists()
    # the cause named (issue 47: it said the folder had no tokenizer.json)
    assert "asks to run its own Python code to load (auto_map in its tokenizer_config.json)" \
        in r.stderr and "no tokenizer.json" not in r.stderr


@pytest.mark.parametrize(("files", "expected"), [
    ({"config.json": {"auto_map": {"AutoTokenizer": [None, "tok.T"]}},
      "tokenizer_config.json": {}},
     "asks to run its own Python code to load (auto_map in its config.json)"),
    ({"tokenizer_config.json": {"tokenizer_class": "NoSuchTokenizer"}},
     "has no tokenizer.json and transformers cannot convert the Hugging Face tokenizer in it"),
])
def test_a_tokenizer_folder_transformers_cannot_load_names_the_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, object],
        expected: str) -> None:
    from modbench.data.tokenizer import load_tokenizer
    from modbench.errors import ModbenchError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name, tree in files.items():
        (tmp_path / name).write_text(json.dumps(tree))
    with pytest.raises(ModbenchError) as e:
        load_tokenizer(str(tmp_path))
    assert expected in str(e.value) and "\n" not in str(e.value)
