"""Tokenize documents, pack them into fixed-length rows and write checksummed shards."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from modbench import __version__
from modbench.data._fs import cache_dir, make_tmp_dir_next_to, remove_tree
from modbench.data.corpus import (
    BUILTIN_VAL_FRACTION,
    builtin_corpus_fingerprint,
    builtin_documents,
    is_validation_document,
)
from modbench.data.sources import Source, describe_source, iter_documents
from modbench.data.tokenizer import (
    find_eos_id,
    load_tokenizer,
    tokenizer_json,
    tokenizer_sha256,
    tokenizer_vocab_size,
)
from modbench.errors import ModbenchError

FORMAT = "modbench-tokens"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_SEQUENCES = 32768
"""Rows per shard file (at seq_len 1024 and uint16, 64 MiB)."""

_ENCODE_BATCH_DOCS = 512
_ENCODE_BATCH_CHARS = 4_000_000
_FLUSH_TOKENS = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """Little-endian uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def dtype_name(dtype: np.dtype[Any]) -> str:
    return "uint16" if dtype.itemsize == 2 else "uint32"


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


class _SplitWriter:
    """Packs a stream of token ids into rows of ``seq_len`` and writes them into shards."""

    def __init__(
        self, out_dir: Path, split: str, seq_len: int, dtype: np.dtype[Any], shard_sequences: int
    ) -> None:
        self.out_dir = out_dir
        self.split = split
        self.seq_len = seq_len
        self.dtype = dtype
        self.shard_sequences = shard_sequences
        self.documents = 0
        self.tokens_in = 0
        self.sequences = 0
        self.shards: list[dict[str, Any]] = []
        self._pending: list[np.ndarray] = []
        self._pending_len = 0
        self._fh: BinaryIO | None = None
        self._hasher: Any = None
        self._shard_rows = 0

    def add_document(self, ids: np.ndarray) -> None:
        self.documents += 1
        self.tokens_in += int(ids.size)
        self._pending.append(ids)
        self._pending_len += int(ids.size)
        if self._pending_len >= max(_FLUSH_TOKENS, self.seq_len):
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        buf = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        n_rows = buf.size // self.seq_len
        if n_rows:
            self._write_rows(buf[: n_rows * self.seq_len].reshape(n_rows, self.seq_len))
        rest = buf[n_rows * self.seq_len :]
        self._pending = [rest] if rest.size else []
        self._pending_len = int(rest.size)

    def _write_rows(self, rows: np.ndarray) -> None:
        i = 0
        while i < rows.shape[0]:
            if self._fh is None:
                name = shard_name(self.split, len(self.shards))
                self._fh = (self.out_dir / name).open("wb")
                self._hasher = hashlib.sha256()
                self._shard_rows = 0
                self.shards.append({"file": name, "sequences": 0, "sha256": ""})
            take = min(rows.shape[0] - i, self.shard_sequences - self._shard_rows)
            data = np.ascontiguousarray(rows[i : i + take], dtype=self.dtype).tobytes()
            self._fh.write(data)
            self._hasher.update(data)
            self._shard_rows += take
            self.sequences += take
            i += take
            if self._shard_rows == self.shard_sequences:
                self._close_shard()

    def _close_shard(self) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        self.shards[-1]["sequences"] = self._shard_rows
        self.shards[-1]["sha256"] = self._hasher.hexdigest()

    def finish(self) -> dict[str, Any]:
        self._flush()
        self._close_shard()
        discarded = self._pending_len
        self._pending = []
        self._pending_len = 0
        return {
            "documents": self.documents,
            "sequences": self.sequences,
            "tokens": self.sequences * self.seq_len,
            "tokens_discarded": discarded,
            "shards": self.shards,
        }

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _chunks(docs: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= _ENCODE_BATCH_DOCS or chars >= _ENCODE_BATCH_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode_batch(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    return [enc.ids for enc in encode(texts, add_special_tokens=False)]


def _validate_options(seq_len: int, val_fraction: float, shard_sequences: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ModbenchError(f"seq_len must be an integer >= 2, got {seq_len!r}; e.g. --seq-len 256")
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ModbenchError(
            f"val_fraction must be in [0, 1), got {val_fraction!r}; e.g. --val-fraction 0.02"
        )
    if (
        isinstance(shard_sequences, bool)
        or not isinstance(shard_sequences, int)
        or (shard_sequences < 1)
    ):
        raise ModbenchError(f"shard_sequences must be a positive integer, got {shard_sequences!r}")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ModbenchError(f"output path {out_dir} is a file; choose a directory for --out")
        if any(out_dir.iterdir()):
            raise ModbenchError(
                f"output directory {out_dir} already exists and is not empty; "
                "choose another --out or delete it first"
            )


def _resolve_tokenizer(
    tokenizer: Tokenizer | str | Path, vocab_size: int | None
) -> tuple[Tokenizer, str]:
    if isinstance(tokenizer, Tokenizer):
        if vocab_size is not None and tokenizer_vocab_size(tokenizer) != vocab_size:
            raise ModbenchError(
                f"the tokenizer has {tokenizer_vocab_size(tokenizer)} tokens but vocab_size="
                f"{vocab_size} was requested; drop vocab_size or use a matching tokenizer"
            )
        return tokenizer, "custom"
    spec = str(tokenizer)
    return load_tokenizer(spec, vocab_size), spec


def _write_dataset(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    tokenizer_spec: str,
    out_dir: Path,
    *,
    seq_len: int,
    val_fraction: float,
    shard_sequences: int,
    progress: bool,
    source_meta: dict[str, Any],
) -> dict[str, Any]:
    """Write shards, tokenizer.json and metadata.json into the (fresh, empty) ``out_dir``."""
    vocab_size = tokenizer_vocab_size(tokenizer)
    eos_id = find_eos_id(tokenizer)
    dtype = token_dtype(vocab_size)
    writers = {
        split: _SplitWriter(out_dir, split, seq_len, dtype, shard_sequences) for split in SPLITS
    }
    eos = np.array([eos_id], dtype=dtype)
    skipped = 0
    total = len(docs) if isinstance(docs, Sized) else None
    bar = tqdm(total=total, desc="tokenizing", unit="doc", disable=not progress, dynamic_ncols=True)
    try:
        for chunk in _chunks(docs):
            bar.update(len(chunk))
            texts = [d for d in chunk if d.strip()]
            skipped += len(chunk) - len(texts)
            for text, ids in zip(texts, _encode_batch(tokenizer, texts), strict=True):
                split = "val" if is_validation_document(text, val_fraction) else "train"
                arr = np.empty(len(ids) + 1, dtype=dtype)
                arr[:-1] = ids
                arr[-1:] = eos
                writers[split].add_document(arr)
            bar.set_postfix(tokens=sum(w.tokens_in for w in writers.values()), refresh=False)
        split_meta = {split: w.finish() for split, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()

    n_docs = sum(m["documents"] for m in split_meta.values())
    if n_docs == 0:
        raise ModbenchError(
            f"source {source_meta.get('source')!r} yielded no documents"
            + (f" ({skipped} empty ones skipped)" if skipped else "")
            + "; check the path, --text-field and --split"
        )
    tok_bytes = tokenizer_json(tokenizer)
    (out_dir / TOKENIZER_FILE).write_bytes(tok_bytes)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"modbench {__version__}",
        **source_meta,
        "tokenizer": {
            "spec": tokenizer_spec,
            "vocab_size": vocab_size,
            "sha256": tokenizer_sha256(tokenizer),
            "eos_id": eos_id,
            "file": TOKENIZER_FILE,
        },
        "seq_len": seq_len,
        "dtype": dtype_name(dtype),
        "byte_order": "little",
        "val_fraction": float(val_fraction),
        "split_rule": "sha256('modbench-split-v1\\0' + text)[:8] / 2**64 < val_fraction",
        "documents": {split: split_meta[split]["documents"] for split in SPLITS},
        "documents_skipped_empty": skipped,
        "tokens": sum(m["tokens"] + m["tokens_discarded"] for m in split_meta.values()),
        "tokens_discarded": sum(m["tokens_discarded"] for m in split_meta.values()),
        "splits": split_meta,
    }
    data = (json.dumps(meta, indent=2, sort_keys=False) + "\n").encode("utf-8")
    with (out_dir / METADATA_FILE).open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return meta


def prepare_dataset(
    source: Source,
    tokenizer: Tokenizer | str | Path,
    out_dir: str | Path,
    *,
    seq_len: int,
    vocab_size: int | None = None,
    val_fraction: float = 0.02,
    shard_sequences: int = DEFAULT_SHARD_SEQUENCES,
    text_field: str = "text",
    split: str = "train",
    data_files: str | list[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``source``, pack it into rows of ``seq_len`` tokens and write a dataset.

    ``source``: a ``.txt`` file (one document), a ``.jsonl``/``.json`` file (one JSON object
    per line, text in ``text_field``), a ``.parquet`` file (column ``text_field``), a directory
    of such files (recursive, sorted by path), ``"hf:NAME"``/``"hf:NAME:CONFIG"`` (a Hugging
    Face dataset, streamed; ``split`` and ``data_files`` are passed to ``load_dataset``), or an
    iterable of document strings. ``tokenizer``: a ``Tokenizer`` or a spec for
    :func:`~modbench.data.load_tokenizer` (``vocab_size`` is needed for ``"builtin"``).

    Documents go to validation by a hash of their text (``val_fraction``), *before* packing.
    Each document is followed by EOS; each split is concatenated and cut into rows of exactly
    ``seq_len`` tokens; the last partial row is discarded (counted in ``tokens_discarded``).
    Everything is written into a temporary directory next to ``out_dir`` and moved into place
    at the end, so a failure leaves nothing behind. Returns the metadata dict.
    """
    _validate_options(seq_len, val_fraction, shard_sequences)
    out = Path(out_dir).expanduser()
    _check_out_dir(out)
    tok, spec = _resolve_tokenizer(tokenizer, vocab_size)
    find_eos_id(tok)  # fail before any work when there is no EOS token
    source_meta: dict[str, Any] = {"source": describe_source(source), "text_field": text_field}
    if isinstance(source, str) and source.startswith("hf:"):
        source_meta["hf_split"] = split
        source_meta["data_files"] = data_files
    docs: Iterable[str] = iter_documents(
        source, text_field=text_field, split=split, data_files=data_files
    )
    if isinstance(source, Sized) and not isinstance(source, str | Path):
        docs = _SizedIter(docs, len(source))
    tmp = make_tmp_dir_next_to(out)
    try:
        meta = _write_dataset(
            docs,
            tok,
            spec,
            tmp,
            seq_len=seq_len,
            val_fraction=val_fraction,
            shard_sequences=shard_sequences,
            progress=progress,
            source_meta=source_meta,
        )
        _check_out_dir(out)
        try:
            os.replace(tmp, out)
        except OSError as exc:
            raise ModbenchError(
                f"could not move the prepared dataset into {out} ({exc.strerror}); "
                "choose another --out"
            ) from exc
    except BaseException:
        remove_tree(tmp)
        raise
    return meta


class _SizedIter:
    """An iterator that also knows its length (for the progress bar)."""

    def __init__(self, it: Iterable[str], n: int) -> None:
        self._it = it
        self._n = n

    def __iter__(self) -> Iterator[str]:
        return iter(self._it)

    def __len__(self) -> int:
        return self._n


def builtin_dataset_path(vocab_size: int, seq_len: int) -> Path:
    """Where :func:`builtin_dataset` caches the built-in dataset."""
    fp = builtin_corpus_fingerprint()[:10]
    return cache_dir() / "data" / f"builtin-v{vocab_size}-s{seq_len}-{fp}"


def builtin_dataset(vocab_size: int, seq_len: int, progress: bool = True) -> Path:
    """Prepare (once, cached) the built-in corpus with the built-in tokenizer; return its dir.

    Train/validation documents are exactly :func:`~modbench.data.builtin_split`'s. Safe
    against concurrent callers: each builds in its own temporary directory and the first to
    ``os.replace`` it into place wins; the others use the winner's copy.
    """
    from modbench.data.tokenizer import builtin_tokenizer

    _validate_options(seq_len, BUILTIN_VAL_FRACTION, DEFAULT_SHARD_SEQUENCES)
    target = builtin_dataset_path(vocab_size, seq_len)
    if (target / METADATA_FILE).is_file():
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModbenchError(
            f"the cached built-in dataset {target} is incomplete; delete that directory and retry"
        )
    tok = builtin_tokenizer(vocab_size)
    tmp = make_tmp_dir_next_to(target)
    try:
        _write_dataset(
            builtin_documents(),
            tok,
            "builtin",
            tmp,
            seq_len=seq_len,
            val_fraction=BUILTIN_VAL_FRACTION,
            shard_sequences=DEFAULT_SHARD_SEQUENCES,
            progress=progress,
            source_meta={
                "source": "builtin",
                "corpus_fingerprint": builtin_corpus_fingerprint(),
                "text_field": None,
            },
        )
        try:
            os.replace(tmp, target)
        except OSError:
            if (target / METADATA_FILE).is_file():  # another process won the race
                remove_tree(tmp)
                return target
            raise
    except BaseException:
        remove_tree(tmp)
        raise
    return target
