"""modbench's data layer: built-in corpus, tokenizers, packed token shards, batch order.

Typical use::

    from modbench.data import builtin_dataset, open_dataset

    ds = open_dataset(builtin_dataset(vocab_size=4096, seq_len=256))
    ds.check_vocab(model_vocab_size)
    x = ds.train_batch(step, batch_size, data_seed)  # (B, seq_len) int64, pure function
"""

from modbench.data._fs import cache_dir
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
    builtin_dataset,
    builtin_dataset_path,
    parse_token_count,
    prepare_dataset,
)
from modbench.data.recipes import RECIPES, prepare_recipe, train_tokenizer
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

__all__ = [
    "DEFAULT_SHARD_SEQUENCES",
    "EOS_TOKEN",
    "FORMAT",
    "FORMAT_VERSION",
    "MIN_VOCAB_SIZE",
    "RECIPES",
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
