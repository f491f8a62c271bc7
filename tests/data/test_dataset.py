from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from modbench.data import (
    PrepareSettings,
    TokenDataset,
    open_dataset,
    prepare_dataset,
    tokenizer_sha256,
)
from modbench.errors import ModbenchError

SEQ = 16


@pytest.fixture(scope="module")
def prepared(
    tmp_path_factory: pytest.TempPathFactory,
    small_tokenizer: Tokenizer,
    doc_factory: Callable[..., list[str]],
) -> Path:
    out = tmp_path_factory.mktemp("ds") / "d"
    prepare_dataset(
        doc_factory(120, seed=3), small_tokenizer, out,
        PrepareSettings(seq_len=SEQ, val_fraction=0.15, shard_sequences=64, progress=False),
    )
    return out


@pytest.fixture
def ds(prepared: Path) -> TokenDataset:
    return open_dataset(prepared)


def all_rows(path: Path, split: str) -> np.ndarray:
    meta = json.loads((path / "metadata.json").read_text())
    parts = [np.fromfile(path / s["file"], dtype="<u2") for s in meta["splits"][split]["shards"]]
    return np.concatenate(parts).reshape(-1, SEQ).astype(np.int64)


def test_attributes(ds: TokenDataset, prepared: Path, small_tokenizer: Tokenizer) -> None:
    assert ds.path == prepared
    assert ds.seq_len == SEQ
    assert ds.vocab_size == 400
    assert ds.eos_id == 0
    assert ds.meta["format"] == "modbench-tokens"
    n = ds.num_sequences("train")
    assert n == all_rows(prepared, "train").shape[0]
    assert n > 64  # several shards
    assert len(ds.meta["splits"]["train"]["shards"]) >= 2
    assert ds.num_sequences("val") > 0
    assert tokenizer_sha256(ds.tokenizer()) == tokenizer_sha256(small_tokenizer)
    ds.check_vocab(400)
    assert "train" in ds.summary()


def test_train_batch_matches_definition(ds: TokenDataset, prepared: Path) -> None:
    rows = all_rows(prepared, "train")
    n = rows.shape[0]
    b = next(k for k in (7, 6, 5) if n % k)  # so that some batch really spans two epochs
    seed = 11
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(4)])
    steps = (3 * n) // b
    for step in range(steps):  # crosses epoch boundaries 1 and 2
        batch = ds.train_batch(step, b, seed)
        assert batch.dtype == torch.int64
        assert batch.shape == (b, SEQ)
        want = stream[step * b : (step + 1) * b]
        assert np.array_equal(batch.numpy(), rows[want])


def test_train_batch_determinism(prepared: Path) -> None:
    a, b = open_dataset(prepared, verify=False), open_dataset(prepared, verify=False)
    n = a.num_sequences("train")
    # iterate on one instance; jump straight to the same steps on a fresh one (resume)
    seq = [a.train_batch(s, 5, 0) for s in range(0, 3 * n // 5)]
    for k in (len(seq) - 1, 0, n // 5, n // 5 + 1, 17):
        assert torch.equal(b.train_batch(k, 5, 0), seq[k])
    assert not torch.equal(a.train_batch(0, 5, 1), seq[0])
    assert not torch.equal(a.train_batch(1, 5, 0), seq[0])
    # a batch larger than the dataset spans several epochs
    big = b.train_batch(1, 2 * n + 3, 4)
    assert big.shape == (2 * n + 3, SEQ)
    idx = b.train_indices(0, 3 * n, 9)
    for e in range(3):
        assert sorted(idx[e * n : (e + 1) * n].tolist()) == list(range(n))


def test_train_batch_argument_errors(ds: TokenDataset) -> None:
    with pytest.raises(ModbenchError, match="step"):
        ds.train_batch(-1, 4, 0)
    with pytest.raises(ModbenchError, match="batch_size"):
        ds.train_batch(0, 0, 0)
    with pytest.raises(ModbenchError, match="data_seed"):
        ds.train_batch(0, 4, -3)


def test_val_batches_fixed(ds: TokenDataset, prepared: Path) -> None:
    rows = all_rows(prepared, "val")
    n = rows.shape[0]
    got = list(ds.val_batches(None, 4))
    assert [t.shape[0] for t in got[:-1]] == [4] * (len(got) - 1)
    assert np.array_equal(torch.cat(got).numpy(), rows)
    again = torch.cat(list(open_dataset(prepared).val_batches(None, 3)))
    assert torch.equal(again, torch.cat(got))
    part = torch.cat(list(ds.val_batches(5, 2)))
    assert np.array_equal(part.numpy(), rows[: min(5, n)])
    big = torch.cat(list(ds.val_batches(10_000, 64)))
    assert big.shape[0] == n


def test_vocab_mismatch(ds: TokenDataset) -> None:
    with pytest.raises(ModbenchError) as info:
        ds.check_vocab(4096)
    msg = str(info.value)
    assert "400" in msg
    assert "4096" in msg
    assert "--set model.vocab_size=400" in msg
    assert "re-prepare" in msg
    assert "\n" not in msg


@pytest.fixture
def copy(prepared: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(prepared, dst)
    return dst


def test_corrupt_shard(copy: Path) -> None:
    shard = copy / "train_00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ModbenchError, match=r"train_00001\.bin fails its sha256") as info:
        open_dataset(copy)
    assert "modbench data prepare" in str(info.value)
    ds = open_dataset(copy, verify=False)  # sizes are still right
    with pytest.raises(ModbenchError, match=r"train_00001\.bin"):
        ds.verify()


def test_missing_and_truncated_shard(copy: Path) -> None:
    (copy / "val_00000.bin").unlink()
    with pytest.raises(ModbenchError, match=r"val_00000\.bin is missing"):
        open_dataset(copy, verify=False)
    shard = copy / "train_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ModbenchError, match=r"train_00000\.bin has \d+ bytes, expected"):
        open_dataset(copy, verify=False)


@pytest.mark.parametrize(
    "content",
    [
        '{"format": "modbench-tokens", "format_',
        "[]",
        '{"format": "other"}',
        '{"format": "modbench-tokens", "format_version": 1}',
    ],
)
def test_corrupt_metadata(copy: Path, content: str) -> None:
    (copy / "metadata.json").write_text(content)
    with pytest.raises(ModbenchError, match=r"metadata\.json.*modbench data prepare"):
        open_dataset(copy)


def test_missing_metadata_and_dir(copy: Path, tmp_path: Path) -> None:
    (copy / "metadata.json").unlink()
    with pytest.raises(ModbenchError, match=r"metadata\.json is missing"):
        open_dataset(copy)
    with pytest.raises(ModbenchError, match="does not exist"):
        open_dataset(tmp_path / "nope")


def test_newer_format_version(copy: Path) -> None:
    meta = json.loads((copy / "metadata.json").read_text())
    meta["format_version"] = 2
    (copy / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ModbenchError, match="format version 2"):
        open_dataset(copy)


def test_empty_split(
    tmp_path: Path, small_tokenizer: Tokenizer, doc_factory: Callable[..., list[str]]
) -> None:
    out = tmp_path / "tiny"
    prepare_dataset(
        doc_factory(20, seed=5), small_tokenizer, out,
        PrepareSettings(seq_len=8, val_fraction=0.0, progress=False),
    )
    ds = open_dataset(out)
    assert ds.num_sequences("val") == 0
    with pytest.raises(ModbenchError, match=r"val split .* has no sequences"):
        list(ds.val_batches(None, 4))
    assert ds.train_batch(0, 2, 0).shape == (2, 8)
    with pytest.raises(ModbenchError, match="unknown split"):
        ds.num_sequences("test")
