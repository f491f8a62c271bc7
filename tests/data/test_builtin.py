from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from modbench.data import (
    builtin_corpus_fingerprint,
    builtin_dataset,
    builtin_split,
    builtin_tokenizer,
    builtin_validation_documents,
    open_dataset,
)
from modbench.errors import ModbenchError

VOCAB, SEQ = 512, 64


def stream_of(docs: list[str]) -> list[int]:
    tok = builtin_tokenizer(VOCAB)
    out: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        out += [*enc.ids, 0]
    return out


def test_builtin_dataset(session_cache: Path) -> None:
    path = builtin_dataset(VOCAB, SEQ, progress=False)
    fp = builtin_corpus_fingerprint()[:10]
    assert path == session_cache / "data" / f"builtin-v{VOCAB}-s{SEQ}-{fp}"
    ds = open_dataset(path)
    meta = ds.meta
    assert meta["source"] == "builtin"
    assert meta["corpus_fingerprint"] == builtin_corpus_fingerprint()
    assert meta["tokenizer"]["spec"] == "builtin"
    ds.check_vocab(VOCAB)
    train_docs, val_docs = builtin_split()
    assert meta["documents"] == {"train": len(train_docs), "val": len(val_docs)}
    assert builtin_validation_documents() == val_docs
    # the validation rows are exactly the held-out documents' tokens, and train has none of them
    val_rows = np.concatenate([t.numpy().ravel() for t in ds.val_batches(None, 16)])
    assert val_rows.tolist() == stream_of(val_docs)[: val_rows.size]
    train_stream = stream_of(train_docs)
    info = meta["splits"]["train"]
    assert info["tokens"] + info["tokens_discarded"] == len(train_stream)
    assert ds.num_sequences("train") * SEQ == info["tokens"]
    # cached: a second call returns the same directory without rebuilding
    mtime = (path / "metadata.json").stat().st_mtime_ns
    assert builtin_dataset(VOCAB, SEQ, progress=False) == path
    assert (path / "metadata.json").stat().st_mtime_ns == mtime
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_builtin_dataset_lost_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process publishes first: we use its copy and remove our temp dir."""
    real_replace = os.replace
    winner: list[Path] = []

    def racing_replace(src: str | Path, dst: str | Path) -> None:
        shutil.copytree(src, dst)  # "the other process" finishes first
        winner.append(Path(dst))
        real_replace(src, dst)  # fails: dst is a non-empty directory

    monkeypatch.setattr("modbench.data.prepare.os.replace", racing_replace)
    path = builtin_dataset(VOCAB, 48, progress=False)
    assert winner == [path]
    assert open_dataset(path).seq_len == 48
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_builtin_dataset_bad_args() -> None:
    with pytest.raises(ModbenchError, match="at least 300"):
        builtin_dataset(100, SEQ, progress=False)
    with pytest.raises(ModbenchError, match="seq_len"):
        builtin_dataset(VOCAB, 1, progress=False)
