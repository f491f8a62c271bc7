"""Fixtures for the data-layer tests: an isolated cache, a small corpus, a small tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from modbench.data import train_bpe

_VOCAB_TEXT = (
    "the model reads a sequence of tokens and predicts the next one while every other "
    "choice stays fixed so that a single modification can be measured honestly with seeds "
    "data order learning rate schedule attention heads residual stream normalization layer "
    "Über café naïve résumé 東京 🙂"
)
_WORDS = _VOCAB_TEXT.split()


def make_docs(n: int, seed: int = 0, min_words: int = 5, max_words: int = 120) -> list[str]:
    """Deterministic pseudo-English documents of varying length (some with unicode)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        k = int(rng.integers(min_words, max_words))
        words = [_WORDS[j] for j in rng.integers(0, len(_WORDS), size=k)]
        docs.append(f"Document {i}. " + " ".join(words) + ".\n")
    return docs


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("modbench-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(session_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point MODBENCH_CACHE at a per-session temp dir so the real home cache is never used."""
    monkeypatch.setenv("MODBENCH_CACHE", str(session_cache))
    yield


@pytest.fixture(scope="session")
def doc_factory() -> Callable[..., list[str]]:
    """:func:`make_docs`, as a fixture (test modules cannot import conftest reliably)."""
    return make_docs


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return make_docs(200)


@pytest.fixture(scope="session")
def small_tokenizer(docs: list[str]) -> Tokenizer:
    return train_bpe(docs, 400)


@pytest.fixture(scope="session")
def tokenizer_file(small_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    small_tokenizer.save(str(path))
    return path
