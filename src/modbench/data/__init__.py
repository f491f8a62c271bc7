"""modbench's data layer: built-in corpus, tokenizers, packed token shards, batch order.

Typical use::

    from modbench.data import builtin_dataset, open_dataset

    ds = open_dataset(builtin_dataset(vocab_size=4096, seq_len=256))
    ds.check_vocab(model_vocab_size)
    x = ds.train_batch(step, batch_size, data_seed)  # (B, seq_len) int64, pure function
"""


# The names below are imported on first use (PEP 562), so that importing a submodule such as
# modbench.data.cli (the command line's `modbench data`) does not import numpy, tokenizers and
# torch before its arguments are parsed.

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modbench.data._fs import cache_dir
    from modbench.data.corpora import CORPORA, prepare_recipe, train_tokenizer
    from modbench.data.corpus import (
        builtin_corpus_fingerprint,
        builtin_documents,
        builtin_split,
        builtin_validation_documents,
        is_validation_document,
    )
    from modbench.data.dataset import TokenDataset, open_dataset
    from modbench.data.prepare import (
        DEFAULT_SHARD_SEQUENCES,
        FORMAT,
        FORMAT_VERSION,
        PrepareSettings,
        builtin_dataset,
        builtin_dataset_path,
        parse_token_count,
        prepare_dataset,
    )
    from modbench.data.sources import iter_documents, iter_hf_documents, open_source
    from modbench.data.tokenizer import (
        EOS_TOKEN,
        MIN_VOCAB_SIZE,
        builtin_tokenizer,
        find_eos_id,
        load_tokenizer,
        tokenizer_sha256,
        tokenizer_vocab_size,
        train_bpe,
    )

_WHERE = {
    "DEFAULT_SHARD_SEQUENCES": "prepare",
    "EOS_TOKEN": "tokenizer",
    "FORMAT": "prepare",
    "FORMAT_VERSION": "prepare",
    "MIN_VOCAB_SIZE": "tokenizer",
    "CORPORA": "corpora",
    "TokenDataset": "dataset",
    "builtin_corpus_fingerprint": "corpus",
    "builtin_dataset": "prepare",
    "builtin_dataset_path": "prepare",
    "builtin_documents": "corpus",
    "builtin_split": "corpus",
    "builtin_tokenizer": "tokenizer",
    "builtin_validation_documents": "corpus",
    "cache_dir": "_fs",
    "find_eos_id": "tokenizer",
    "is_validation_document": "corpus",
    "iter_documents": "sources",
    "iter_hf_documents": "sources",
    "load_tokenizer": "tokenizer",
    "open_dataset": "dataset",
    "open_source": "sources",
    "parse_token_count": "prepare",
    "prepare_dataset": "prepare",
    "PrepareSettings": "prepare",
    "prepare_recipe": "corpora",
    "tokenizer_sha256": "tokenizer",
    "tokenizer_vocab_size": "tokenizer",
    "train_bpe": "tokenizer",
    "train_tokenizer": "corpora",
}


__all__ = [
    "CORPORA",
    "DEFAULT_SHARD_SEQUENCES",
    "EOS_TOKEN",
    "FORMAT",
    "FORMAT_VERSION",
    "MIN_VOCAB_SIZE",
    "PrepareSettings",
    "TokenDataset",
    "builtin_corpus_fingerprint",
    "builtin_dataset",
    "builtin_dataset_path",
    "builtin_documents",
    "builtin_split",
    "builtin_tokenizer",
    "builtin_validation_documents",
    "cache_dir",
    "find_eos_id",
    "is_validation_document",
    "iter_documents",
    "iter_hf_documents",
    "load_tokenizer",
    "open_dataset",
    "open_source",
    "parse_token_count",
    "prepare_dataset",
    "prepare_recipe",
    "tokenizer_sha256",
    "tokenizer_vocab_size",
    "train_bpe",
    "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
