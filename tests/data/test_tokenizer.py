from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from modbench.data import (
    EOS_TOKEN,
    builtin_corpus_fingerprint,
    builtin_tokenizer,
    cache_dir,
    find_eos_id,
    load_tokenizer,
    tokenizer_sha256,
    train_bpe,
)
from modbench.errors import ModbenchError

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "naïve café, Über, 東京, emoji 🙂🚀, ж never seen in training",
    "def f(x):\n    return x ** 2  # code\n",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(small_tokenizer: Tokenizer, text: str) -> None:
    ids = small_tokenizer.encode(text).ids
    assert small_tokenizer.decode(ids) == text


def test_bpe_layout(small_tokenizer: Tokenizer) -> None:
    assert small_tokenizer.token_to_id(EOS_TOKEN) == 0
    assert find_eos_id(small_tokenizer) == 0
    assert small_tokenizer.get_vocab_size() == 400
    # EOS is a special token: decoding skips it, and text never produces id 0 by accident
    assert 0 not in small_tokenizer.encode("the model <|end").ids
    assert small_tokenizer.decode([*small_tokenizer.encode("a b").ids, 0]) == "a b"


def test_training_is_deterministic(docs: list[str]) -> None:
    assert train_bpe(docs, 350).to_str() == train_bpe(docs, 350).to_str()


def test_vocab_too_small(docs: list[str]) -> None:
    with pytest.raises(ModbenchError, match="at least 300"):
        train_bpe(docs, 299)
    with pytest.raises(ModbenchError, match="at least 300"):
        load_tokenizer("builtin", 100)


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "c" / "d"
    monkeypatch.setenv("MODBENCH_CACHE", str(target))
    assert cache_dir() == target
    assert target.is_dir()


def test_builtin_tokenizer_cached(session_cache: Path) -> None:
    tok = builtin_tokenizer(512)
    path = (
        session_cache / "tokenizers" / f"builtin-bpe-v512-{builtin_corpus_fingerprint()[:10]}.json"
    )
    assert path.is_file()
    assert json.loads(path.read_text())["model"]["type"] == "BPE"
    assert tok.get_vocab_size() == 512
    assert tokenizer_sha256(builtin_tokenizer(512)) == tokenizer_sha256(tok)
    assert tokenizer_sha256(load_tokenizer("builtin", 512)) == tokenizer_sha256(tok)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp files


def test_load_tokenizer_from_file_and_dir(tokenizer_file: Path, small_tokenizer: Tokenizer) -> None:
    want = tokenizer_sha256(small_tokenizer)
    assert tokenizer_sha256(load_tokenizer(str(tokenizer_file))) == want
    assert tokenizer_sha256(load_tokenizer(str(tokenizer_file.parent))) == want
    assert tokenizer_sha256(load_tokenizer(str(tokenizer_file), 400)) == want


def test_load_tokenizer_errors(tmp_path: Path, tokenizer_file: Path) -> None:
    with pytest.raises(ModbenchError, match="--vocab-size"):
        load_tokenizer("builtin")
    with pytest.raises(ModbenchError, match=r"unknown tokenizer 'bultin'.*did you mean 'builtin'"):
        load_tokenizer("bultin", 512)
    with pytest.raises(ModbenchError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModbenchError, match="not a valid"):
        load_tokenizer(str(bad))
    with pytest.raises(ModbenchError, match="empty tokenizer name"):
        load_tokenizer("hf:")
    with pytest.raises(ModbenchError, match="has 400 tokens but a vocab size of 512"):
        load_tokenizer(str(tokenizer_file), 512)


def test_tokenizer_without_eos() -> None:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    with pytest.raises(ModbenchError, match="no end-of-text token"):
        find_eos_id(tok)
