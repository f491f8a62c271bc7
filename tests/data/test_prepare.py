from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from modbench.data import (
    PrepareSettings,
    is_validation_document,
    prepare_dataset,
    tokenizer_sha256,
)
from modbench.data.prepare import token_dtype
from modbench.errors import ModbenchError


def expected_stream(tok: Tokenizer, docs: list[str]) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += [*tok.encode(d, add_special_tokens=False).ids, 0]
    return out


def check_metadata(out: Path, meta: dict[str, Any], seq_len: int) -> None:
    assert json.loads((out / "metadata.json").read_text()) == meta
    assert meta["format"] == "modbench-tokens"
    assert meta["format_version"] == 1
    assert meta["seq_len"] == seq_len
    assert meta["dtype"] == "uint16"
    total = 0
    discarded = 0
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert info["tokens"] == info["sequences"] * seq_len
        assert 0 <= info["tokens_discarded"] < seq_len
        assert info["documents"] == meta["documents"][split]
        assert sum(s["sequences"] for s in info["shards"]) == info["sequences"]
        for i, shard in enumerate(info["shards"]):
            assert shard["file"] == f"{split}_{i:05d}.bin"
            data = (out / shard["file"]).read_bytes()
            assert len(data) == shard["sequences"] * seq_len * 2
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        total += info["tokens"] + info["tokens_discarded"]
        discarded += info["tokens_discarded"]
    assert meta["tokens"] == total
    assert meta["tokens_discarded"] == discarded
    tok_bytes = (out / "tokenizer.json").read_bytes()
    assert hashlib.sha256(tok_bytes).hexdigest() == meta["tokenizer"]["sha256"]
    assert meta["tokenizer"]["eos_id"] == 0


def read_split(out: Path, meta: dict[str, Any], split: str) -> np.ndarray:
    parts = [np.fromfile(out / s["file"], dtype="<u2") for s in meta["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype="<u2")


def test_txt_directory(tmp_path: Path, docs: list[str], small_tokenizer: Tokenizer) -> None:
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    for i, d in enumerate(docs[:30]):
        # nested + flat files; sorted by relative path: "a_000.txt" ... then "sub/..."
        target = src / ("sub" if i >= 20 else "") / f"a_{i:03d}.txt"
        target.write_text(d, encoding="utf-8")
    (src / "notes.md").write_text("ignored: not a source suffix")
    (src / ".hidden.txt").write_text("ignored: hidden")
    out = tmp_path / "out"
    meta = prepare_dataset(
        src, small_tokenizer, out,
        PrepareSettings(seq_len=32, val_fraction=0.0, progress=False),
    )
    check_metadata(out, meta, 32)
    assert meta["documents"] == {"train": 30, "val": 0}
    assert meta["source"] == str(src)
    stream = expected_stream(small_tokenizer, docs[:30])
    assert meta["tokens"] == len(stream)
    train = read_split(out, meta, "train")
    assert train.tolist() == stream[: train.size]
    assert meta["tokens_discarded"] == len(stream) % 32
    # the shards decode back to the source text prefix
    text = small_tokenizer.decode(train[:200].tolist(), skip_special_tokens=False)
    joined = "<|endoftext|>".join(docs[:30])
    assert joined.startswith(text)
    assert len(text) > 100


def test_jsonl_with_val_split(tmp_path: Path, docs: list[str], tokenizer_file: Path) -> None:
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)]
    src.write_text("\n".join(lines[:50]) + "\n\n" + "\n".join(lines[50:]) + "\n")
    out = tmp_path / "out"
    meta = prepare_dataset(
        str(src), str(tokenizer_file), out,
        PrepareSettings(seq_len=16, val_fraction=0.2, shard_sequences=50, text_field="body",
                        progress=False),
    )
    check_metadata(out, meta, 16)
    tok = Tokenizer.from_file(str(tokenizer_file))
    assert meta["tokenizer"]["spec"] == str(tokenizer_file)
    assert meta["tokenizer"]["vocab_size"] == 400
    assert meta["tokenizer"]["sha256"] == tokenizer_sha256(tok)
    val_docs = [d for d in docs if is_validation_document(d, 0.2)]
    train_docs = [d for d in docs if not is_validation_document(d, 0.2)]
    assert 10 < len(val_docs) < 80
    assert meta["documents"] == {"train": len(train_docs), "val": len(val_docs)}
    # the split happens by document before packing: each split is exactly its docs' stream
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        stream = expected_stream(tok, split_docs)
        got = read_split(out, meta, split)
        assert got.tolist() == stream[: got.size]
        info = meta["splits"][split]
        assert info["tokens"] + info["tokens_discarded"] == len(stream)
    assert len(meta["splits"]["train"]["shards"]) > 1  # shard_sequences=50 forces several
    assert all(s["sequences"] == 50 for s in meta["splits"]["train"]["shards"][:-1])


def test_json_array_and_parquet(
    tmp_path: Path, docs: list[str], small_tokenizer: Tokenizer
) -> None:
    js = tmp_path / "docs.json"
    js.write_text(json.dumps([{"text": d} for d in docs[:40]], indent=1))
    pqf = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [*docs[:40], None], "n": list(range(41))}), pqf)
    metas = []
    for i, src in enumerate((js, pqf)):
        out = tmp_path / f"out{i}"
        meta = prepare_dataset(
            src, small_tokenizer, out,
            PrepareSettings(seq_len=64, val_fraction=0.0, progress=False),
        )
        check_metadata(out, meta, 64)
        assert meta["documents"]["train"] == 40
        metas.append(meta)
    assert metas[0]["splits"] == metas[1]["splits"]  # same docs -> byte-identical shards


def test_iterable_source(tmp_path: Path, docs: list[str], small_tokenizer: Tokenizer) -> None:
    meta = prepare_dataset(
        iter([*docs[:10], "", "   \n"]), small_tokenizer, tmp_path / "o",
        PrepareSettings(seq_len=8, val_fraction=0.0, progress=False),
    )
    assert meta["documents"]["train"] == 10
    assert meta["documents_skipped_empty"] == 2
    assert meta["source"] == "<in-memory documents>"


def test_existing_empty_out_dir_is_fine(
    tmp_path: Path, docs: list[str], small_tokenizer: Tokenizer
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    prepare_dataset(docs[:5], small_tokenizer, out, PrepareSettings(seq_len=8, progress=False))
    assert (out / "metadata.json").is_file()


def test_non_empty_out_dir_refused(
    tmp_path: Path, docs: list[str], small_tokenizer: Tokenizer
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModbenchError, match="not empty"):
        prepare_dataset(docs, small_tokenizer, out, PrepareSettings(seq_len=8, progress=False))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_leaves_nothing_behind(
    tmp_path: Path, docs: list[str], small_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("modbench.data.prepare._FLUSH_TOKENS", 16)  # shards get written early
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    (src / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    out = tmp_path / "sub" / "out"
    with pytest.raises(ModbenchError, match=r"b\.jsonl:2 is not valid JSON"):
        prepare_dataset(
            src, small_tokenizer, out,
            PrepareSettings(seq_len=8, shard_sequences=4, progress=False),
        )
    assert not out.exists()
    assert list((tmp_path / "sub").iterdir()) == []  # the temp dir was removed too


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda p: p / "missing.txt", "does not exist"),
        (lambda p: (p / "e").mkdir() or (p / "e"), "contains no"),
        (lambda p: (p / "x.csv").write_text("a,b") and p / "x.csv", "unsupported source file"),
        (lambda p: (p / "e.txt").write_text("  \n") and p / "e.txt", "yielded no documents"),
        (
            lambda p: (p / "t.jsonl").write_text('{"txt": "a"}\n') and p / "t.jsonl",
            "no field 'text' .*did you mean 'txt'",
        ),
        (lambda p: (p / "n.jsonl").write_text('{"text": 3}\n') and p / "n.jsonl", "not a string"),
        (lambda p: (p / "l.jsonl").write_text("[1]\n") and p / "l.jsonl", "not a JSON object"),
        (lambda p: (p / "b.txt").write_bytes(b"ok \xff\xfe") and p / "b.txt", "not valid UTF-8"),
    ],
)
def test_source_errors(tmp_path: Path, small_tokenizer: Tokenizer, make: Any, pattern: str) -> None:
    src = make(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ModbenchError, match=pattern):
        prepare_dataset(src, small_tokenizer, out, PrepareSettings(seq_len=8, progress=False))
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_option_errors(tmp_path: Path, docs: list[str], small_tokenizer: Tokenizer) -> None:
    out = tmp_path / "o"
    with pytest.raises(ModbenchError, match="seq_len"):
        prepare_dataset(docs, small_tokenizer, out, PrepareSettings(seq_len=1, progress=False))
    with pytest.raises(ModbenchError, match="val_fraction"):
        prepare_dataset(
            docs, small_tokenizer, out,
            PrepareSettings(seq_len=8, val_fraction=1.0, progress=False),
        )
    with pytest.raises(ModbenchError, match="only applies to hf"):
        prepare_dataset(
            tmp_path, small_tokenizer, out,
            PrepareSettings(seq_len=8, data_files="*.txt", progress=False),
        )
    with pytest.raises(ModbenchError, match="vocab_size=512"):
        prepare_dataset(
            docs, small_tokenizer, out,
            PrepareSettings(seq_len=8, vocab_size=512, progress=False),
        )
    with pytest.raises(ModbenchError, match="not a str"):
        prepare_dataset(
            [b"x"], small_tokenizer, out,
            PrepareSettings(seq_len=8, progress=False),
        )  # type: ignore
    assert not out.exists()


def test_token_dtype() -> None:
    assert token_dtype(4096) == np.dtype("<u2")
    assert token_dtype(65536) == np.dtype("<u2")
    assert token_dtype(65537) == np.dtype("<u4")
