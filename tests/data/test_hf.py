"""hf: sources, exercised only on local files with the Hugging Face libraries offline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from modbench.data import PrepareSettings, iter_hf_documents, prepare_dataset
from modbench.errors import ModbenchError

pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def _hf_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    home = tmp_path / "hf-home"
    for var, value in (
        ("HF_DATASETS_OFFLINE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HOME", str(home)),
        ("HF_DATASETS_CACHE", str(home / "datasets")),
    ):
        monkeypatch.setenv(var, value)
    import datasets.config

    # the config module reads the environment once at import time
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_MODULES_CACHE", home / "modules")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    yield


@pytest.fixture
def jsonl_dir(tmp_path: Path, docs: list[str]) -> Path:
    d = tmp_path / "jsonl"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:30]))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[30:60]))
    return d


def test_json_builder_with_data_files(jsonl_dir: Path, docs: list[str]) -> None:
    got = list(iter_hf_documents("json", data_files=str(jsonl_dir / "*.jsonl")))
    assert got == docs[:60]


def test_local_directory(jsonl_dir: Path, docs: list[str]) -> None:
    assert list(iter_hf_documents(str(jsonl_dir))) == docs[:60]


def test_hf_errors(jsonl_dir: Path) -> None:
    files = str(jsonl_dir / "*.jsonl")
    with pytest.raises(ModbenchError, match=r"no field 'txt'.*did you mean 'text'"):
        list(iter_hf_documents("json", data_files=files, text_field="txt"))
    with pytest.raises(ModbenchError, match="split 'validation'"):
        list(iter_hf_documents("json", data_files=files, split="validation"))
    with pytest.raises(ModbenchError, match="could not load Hugging Face dataset"):
        list(iter_hf_documents("surely-not/a-dataset-modbench"))


def test_prepare_from_hf(
    tmp_path: Path, jsonl_dir: Path, docs: list[str], small_tokenizer: Tokenizer
) -> None:
    out = tmp_path / "out"
    meta = prepare_dataset(
        "hf:json", small_tokenizer, out,
        PrepareSettings(seq_len=16, val_fraction=0.0, data_files=str(jsonl_dir / "*.jsonl"),
                        progress=False),
    )
    local = prepare_dataset(
        jsonl_dir, small_tokenizer, tmp_path / "local",
        PrepareSettings(seq_len=16, val_fraction=0.0, progress=False),
    )
    assert meta["source"] == "hf:json"
    assert meta["hf_split"] == "train"
    assert meta["documents"]["train"] == 60
    assert meta["splits"] == local["splits"]  # same documents, same bytes
