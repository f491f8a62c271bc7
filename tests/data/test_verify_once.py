"""Hash once per corpus (issue 46 item 6): ``verified.json`` lets a later open accept an
unchanged file unread; a changed one is hashed again and refused when damaged; a folder that
cannot be written still opens; the full check (``verify()``, ``modbench data verify``) hashes
everything whatever the record says."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

import modbench.data.dataset as dataset_mod
import modbench.data.verify_record as record_mod
from modbench.data import PrepareSettings, open_dataset, prepare_dataset
from modbench.data.cli import data_app
from modbench.data.verify_record import RECORD_FILE, cache_record_path
from modbench.errors import ModbenchError

HOUR_AGO_NS = time.time_ns() - 3600 * 10**9


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer,
             doc_factory: Callable[..., list[str]]) -> Path:
    out = tmp_path_factory.mktemp("ds") / "d"
    prepare_dataset(doc_factory(120, seed=5), small_tokenizer, out,
                    PrepareSettings(seq_len=16, val_fraction=0.15, shard_sequences=64,
                                    progress=False))
    return out


def age(folder: Path) -> None:
    """Date every file an hour back, as a corpus prepared before the run (files written in
    the last seconds are not recorded: their timestamps may not yet show a later write)."""
    for f in folder.iterdir():
        os.utime(f, ns=(HOUR_AGO_NS, HOUR_AGO_NS))


@pytest.fixture
def data(prepared: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "data"
    shutil.copytree(prepared, dst)
    age(dst)
    return dst


def files_of(folder: Path) -> list[str]:
    meta = json.loads((folder / "metadata.json").read_text())
    shards = [s["file"] for split in ("train", "val") for s in meta["splits"][split]["shards"]]
    return [*shards, "tokenizer.json"]


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """The files read and hashed (shards and tokenizer), by name, counted."""
    seen: Counter[str] = Counter()
    digest, sha = dataset_mod._digest_and_max, dataset_mod.sha256_file

    def spy_digest(path: Path, dtype: Any) -> tuple[str, int]:
        seen[path.name] += 1
        return digest(path, dtype)

    def spy_sha(path: Path) -> str:
        seen[path.name] += 1
        return sha(path)

    monkeypatch.setattr(dataset_mod, "_digest_and_max", spy_digest)
    monkeypatch.setattr(dataset_mod, "sha256_file", spy_sha)
    yield seen


def test_second_open_hashes_nothing(data: Path, hashed: Counter[str]) -> None:
    open_dataset(data)
    names = files_of(data)
    assert len(names) >= 3
    assert hashed == Counter(names)  # the first open reads every file once
    rec = json.loads((data / RECORD_FILE).read_text())
    assert rec["format"] == "modbench-verified" and rec["version"] == 1
    assert rec["fingerprint"] == open_dataset(data, verify=False).fingerprint()
    assert sorted(rec["files"]) == sorted(names)
    entry = rec["files"][names[0]]
    assert set(entry) == {"size", "mtime_ns", "ctime_ns", "ino", "sha256"}
    hashed.clear()
    for _ in range(3):
        ds = open_dataset(data)
        assert hashed == Counter()
    assert ds.train_batch(0, 4, 0).shape == (4, 16)


def test_recent_files_are_not_recorded(prepared: Path, tmp_path: Path,
                                       hashed: Counter[str]) -> None:
    dst = tmp_path / "fresh"
    shutil.copytree(prepared, dst, copy_function=shutil.copy)  # written now: mtime = now
    open_dataset(dst)
    open_dataset(dst)
    assert hashed == Counter({n: 2 for n in files_of(dst)})  # hashed each time
    assert not (dst / RECORD_FILE).exists()


@pytest.mark.parametrize("restore_mtime", [False, True])
def test_changed_shard_is_hashed_and_refused(data: Path, hashed: Counter[str],
                                             restore_mtime: bool) -> None:
    open_dataset(data)
    hashed.clear()
    time.sleep(0.05)  # past the file system's timestamp tick
    shard = data / "train_00001.bin"
    body = bytearray(shard.read_bytes())
    body[10] ^= 0xFF
    shard.write_bytes(bytes(body))  # same size, new mtime (and ctime)
    if restore_mtime:  # the ctime still moves
        os.utime(shard, ns=(HOUR_AGO_NS, HOUR_AGO_NS))
    with pytest.raises(ModbenchError, match=r"train_00001\.bin fails its sha256") as info:
        open_dataset(data)
    msg = str(info.value)
    assert "\n" not in msg and "modbench data prepare" in msg
    assert hashed["train_00001.bin"] == 1
    assert hashed["train_00000.bin"] == 0  # the unchanged shard before it was trusted
    with pytest.raises(ModbenchError, match=r"train_00001\.bin fails its sha256"):
        open_dataset(data)  # still refused: a failed file is never recorded


def test_changed_manifest_voids_the_record(data: Path, hashed: Counter[str]) -> None:
    open_dataset(data)
    meta_file = data / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["tokenizer"]["vocab_size"] = 300  # a smaller vocabulary: ids must be re-scanned
    meta["tokenizer"]["model_vocab_size"] = 300
    meta_file.write_text(json.dumps(meta))
    hashed.clear()
    with pytest.raises(ModbenchError, match="outside the vocabulary"):
        open_dataset(data)
    assert sum(hashed.values()) >= 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits")
def test_read_only_folder_opens(data: Path, hashed: Counter[str]) -> None:
    data.chmod(0o555)
    try:
        open_dataset(data)
        assert not (data / RECORD_FILE).exists()
        cached = cache_record_path(data)
        assert cached is not None and cached.is_file()
        hashed.clear()
        open_dataset(data)
        assert hashed == Counter()
    finally:
        data.chmod(0o755)


def test_unwritable_folder_uses_the_cache(data: Path, hashed: Counter[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The read-only case, simulated (so it runs as root too): writes into the dataset folder
    fail, the record goes to the user's cache; with no cache either, opening still works."""
    write = record_mod.atomic_write_text
    blocked: set[Path] = {data}

    def refuse(path: Path, text: str) -> None:
        if any(path.parent == b or b in path.parents for b in blocked):
            raise PermissionError(13, "Permission denied", str(path))
        write(path, text)

    monkeypatch.setattr(record_mod, "atomic_write_text", refuse)
    open_dataset(data)
    assert not (data / RECORD_FILE).exists()
    cached = cache_record_path(data)
    assert cached is not None and cached.is_file()
    hashed.clear()
    open_dataset(data)
    assert hashed == Counter()

    cached.unlink()
    blocked.add(cached.parent)  # nowhere to write: every open hashes, none fails
    open_dataset(data)
    open_dataset(data)
    assert hashed == Counter({n: 2 for n in files_of(data)})


def test_full_check_hashes_everything(data: Path, hashed: Counter[str]) -> None:
    open_dataset(data)
    hashed.clear()
    assert open_dataset(data).verify() == files_of(data)
    assert hashed == Counter(files_of(data))
    hashed.clear()
    assert CliRunner().invoke(data_app, ["verify", str(data)]).exit_code == 0
    assert hashed == Counter(files_of(data))


def test_full_check_catches_what_the_record_cannot(data: Path) -> None:
    """A shard changed beneath the record (here: its entry forged to the new stat, as bit rot
    or restored timestamps would leave it) passes a plain open; the full check refuses it."""
    open_dataset(data)
    shard = data / "val_00000.bin"
    body = bytearray(shard.read_bytes())
    body[3] ^= 0x01
    shard.write_bytes(bytes(body))
    rec = json.loads((data / RECORD_FILE).read_text())
    st = shard.stat()
    rec["files"][shard.name].update(size=st.st_size, mtime_ns=st.st_mtime_ns,
                                    ctime_ns=st.st_ctime_ns, ino=st.st_ino)
    (data / RECORD_FILE).write_text(json.dumps(rec))
    ds = open_dataset(data)  # the documented limit
    with pytest.raises(ModbenchError, match=r"val_00000\.bin fails its sha256"):
        ds.verify()
    result = CliRunner().invoke(data_app, ["verify", str(data)])
    assert isinstance(result.exception, ModbenchError)
    assert "val_00000.bin" in str(result.exception)
