from __future__ import annotations

import hashlib
from pathlib import Path

from modbench.data import (
    builtin_corpus_fingerprint,
    builtin_documents,
    builtin_split,
    builtin_validation_documents,
    is_validation_document,
)
from modbench.data import corpus as corpus_mod


def test_builtin_corpus_is_deterministic_and_sizeable() -> None:
    docs = builtin_documents()
    rebuilt = list(corpus_mod._build_documents())  # bypass the in-process and disk caches
    assert docs == rebuilt
    assert len(docs) > 1000
    assert sum(len(d) for d in docs) > 1_000_000
    assert len(set(docs)) == len(docs)  # exact duplicates removed
    assert all(d.strip() for d in docs)
    # pydoc topics come first, sorted by key
    from pydoc_data.topics import topics

    assert docs[0] == topics[sorted(topics)[0]].strip()


def test_fingerprint_is_sha256_of_documents() -> None:
    h = hashlib.sha256()
    for d in builtin_documents():
        h.update(d.encode("utf-8") + b"\x00")
    assert builtin_corpus_fingerprint() == h.hexdigest()


def test_builtin_split_disjoint_and_complete() -> None:
    docs = builtin_documents()
    train, val = builtin_split()
    assert len(train) + len(val) == len(docs)
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(docs)
    assert 0.02 < len(val) / len(docs) < 0.1
    assert builtin_validation_documents() == val
    assert builtin_split() == (train, val)
    assert all(is_validation_document(d, corpus_mod.BUILTIN_VAL_FRACTION) for d in val)


def test_is_validation_document_is_pure() -> None:
    texts = [f"text number {i}" for i in range(2000)]
    first = [is_validation_document(t, 0.1) for t in texts]
    assert first == [is_validation_document(t, 0.1) for t in texts]
    assert 100 < sum(first) < 300
    assert not any(is_validation_document(t, 0.0) for t in texts)
    # a larger fraction only adds documents to validation
    assert all(is_validation_document(t, 0.5) for t, v in zip(texts, first, strict=True) if v)


def test_disk_cache(session_cache: Path) -> None:
    docs = builtin_documents()
    (path,) = (session_cache / "corpus").glob("builtin-corpus-*.json")
    assert corpus_mod._load_cached(path) == tuple(docs)
    assert list(corpus_mod._builtin_documents_cached.__wrapped__()) == docs  # reads the file
    path.write_text(path.read_text().replace("e", "E", 1))  # damaged: fingerprint mismatch
    assert corpus_mod._load_cached(path) is None
    assert list(corpus_mod._builtin_documents_cached.__wrapped__()) == docs  # rebuilt
    assert corpus_mod._load_cached(path) == tuple(docs)  # and rewritten
