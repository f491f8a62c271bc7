"""Tokenize documents, pack them into fixed-length rows and write checksummed shards.

``prepare_dataset`` reads a source file by file (:mod:`modbench.data.sources`), tokenizes in
worker processes (:mod:`modbench.data.parallel`) and packs the token stream of each split
into rows of ``seq_len`` tokens. It works in a hidden folder next to ``out_dir``
(``.NAME.partial``) and records a checkpoint there (``progress.json``: the source position,
the finished shards and their checksums, the rows of the shard being written and the
packing tail) whenever a shard is finished and every :data:`CHECKPOINT_SECONDS`. Killed,
it is continued by running the same call again: the finished shards are verified and kept,
and the result equals an uninterrupted preparation byte for byte. The folder becomes
``out_dir`` only when complete.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import decimal
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from modbench import __version__
from modbench.data._fs import cache_dir, make_tmp_dir_next_to, remove_tree, sha256_file
from modbench.data.corpus import (
    BUILTIN_VAL_FRACTION,
    builtin_corpus_fingerprint,
    builtin_documents,
)
from modbench.data.parallel import EncoderPool, EncoderSpec, check_workers
from modbench.data.sources import (
    Document,
    DocumentSource,
    InMemorySource,
    Source,
    TransientError,
    describe_source,
    open_source,
)
from modbench.data.tokenizer import (
    find_eos_id,
    load_tokenizer,
    tokenizer_json,
    tokenizer_sha256,
    tokenizer_vocab_size,
)
from modbench.errors import ModbenchError
from modbench.fsutil import atomic_write_text

FORMAT = "modbench-tokens"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
TOKENIZER_FILE = "tokenizer.json"
PROGRESS_FILE = "progress.json"
LOCK_FILE = ".lock"
SPLITS = ("train", "val")
DEFAULT_SHARD_SEQUENCES = 32768
"""Rows per shard file (at seq_len 1024 and uint16, 64 MiB)."""

CHECKPOINT_SECONDS = 60.0
"""A checkpoint is also written when this long has passed since the last one (besides every
finished shard)."""

_ENCODE_BATCH_DOCS = 512
_ENCODE_BATCH_CHARS = 4_000_000
_FLUSH_TOKENS = 1 << 20
_PROGRESS_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """Little-endian uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def dtype_name(dtype: np.dtype[Any]) -> str:
    return "uint16" if dtype.itemsize == 2 else "uint32"


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


def _damaged(path: Path, problem: str) -> ModbenchError:
    return ModbenchError(
        f"the unfinished preparation in {path.parent} is damaged ({path.name} {problem}); "
        f"delete {path.parent} and run the same command again"
    )


class _SplitWriter:
    """Packs a stream of token ids into rows of ``seq_len`` and writes them into shards;
    at most ``max_rows`` rows (the rest of the stream is counted as discarded)."""

    def __init__(
        self,
        out_dir: Path,
        split: str,
        seq_len: int,
        dtype: np.dtype[Any],
        shard_sequences: int,
        max_rows: int | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.split = split
        self.seq_len = seq_len
        self.dtype = dtype
        self.shard_sequences = shard_sequences
        self.max_rows = max_rows
        self.documents = 0
        self.tokens_in = 0
        self.sequences = 0
        self.closed = 0  # shards finished since the last checkpoint
        self.shards: list[dict[str, Any]] = []
        self._pending: list[np.ndarray] = []
        self._pending_len = 0
        self._fh: BinaryIO | None = None
        self._hasher: Any = None
        self._shard_rows = 0

    @property
    def full(self) -> bool:
        """True once the stream holds ``max_rows`` rows."""
        return self.max_rows is not None and self.tokens_in >= self.max_rows * self.seq_len

    def add(self, ids: np.ndarray, documents: int) -> None:
        """Append the tokens of ``documents`` documents (each already followed by EOS)."""
        self.documents += documents
        self.tokens_in += int(ids.size)
        if ids.size:
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
        if self.max_rows is not None:
            rows = rows[: max(0, self.max_rows - self.sequences)]
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
        self.closed += 1

    def finish(self) -> dict[str, Any]:
        self._flush()
        self._close_shard()
        self._pending = []
        self._pending_len = 0
        return {
            "documents": self.documents,
            "sequences": self.sequences,
            "tokens": self.sequences * self.seq_len,
            "tokens_discarded": self.tokens_in - self.sequences * self.seq_len,
            "shards": self.shards,
        }

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """Write every full row, make the open shard durable and return what resuming needs
        (the packing tail is then shorter than a row and travels inside the state)."""
        self._flush()
        open_shard = None
        closed = self.shards
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            closed = self.shards[:-1]
            open_shard = {"file": self.shards[-1]["file"], "sequences": self._shard_rows,
                          "sha256": self._hasher.copy().hexdigest()}
        pending = np.concatenate(self._pending) if self._pending else np.zeros(0, self.dtype)
        self.closed = 0
        return {
            "documents": self.documents,
            "tokens_in": self.tokens_in,
            "sequences": self.sequences,
            "shards": [dict(s) for s in closed],
            "open": open_shard,
            "pending": base64.b64encode(pending.astype(self.dtype).tobytes()).decode("ascii"),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`: verify the finished shards, cut the open shard back to
        its recorded rows (and check them), drop any later shard file."""
        row_bytes = self.seq_len * self.dtype.itemsize
        self.documents = int(state["documents"])
        self.tokens_in = int(state["tokens_in"])
        self.sequences = int(state["sequences"])
        self.shards = [dict(s) for s in state["shards"]]
        for shard in self.shards:
            path = self.out_dir / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["sequences"] * row_bytes:
                raise _damaged(path, "is missing or has the wrong size")
            if sha256_file(path) != shard["sha256"]:
                raise _damaged(path, "fails its sha256 checksum")
        open_shard = state["open"]
        if open_shard is not None:
            path = self.out_dir / open_shard["file"]
            size = int(open_shard["sequences"]) * row_bytes
            if not path.is_file() or path.stat().st_size < size:
                raise _damaged(path, "is missing or shorter than recorded")
            with path.open("r+b") as fh:
                fh.truncate(size)
            with path.open("rb") as fh:
                hasher = hashlib.file_digest(fh, "sha256")
            if hasher.hexdigest() != open_shard["sha256"]:
                raise _damaged(path, "fails its sha256 checksum")
            self._fh = path.open("ab")
            self._hasher = hasher
            self._shard_rows = int(open_shard["sequences"])
            self.shards.append({"file": open_shard["file"], "sequences": 0, "sha256": ""})
        pending = np.frombuffer(base64.b64decode(state["pending"]), dtype=self.dtype).copy()
        self._pending = [pending] if pending.size else []
        self._pending_len = int(pending.size)
        known = {s["file"] for s in self.shards}
        for stray in self.out_dir.glob(f"{self.split}_*.bin"):
            if stray.name not in known:  # written after the checkpoint
                stray.unlink()


def _validate_options(
    seq_len: int, val_fraction: float, shard_sequences: int, max_tokens: int | None = None
) -> None:
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
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < seq_len
    ):
        raise ModbenchError(
            f"max_tokens must be an integer of at least seq_len={seq_len} tokens, got "
            f"{max_tokens!r}; e.g. --max-tokens 23.28B"
        )


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


def _check_model_vocab(model_vocab_size: int | None, vocab_size: int) -> None:
    if model_vocab_size is None:
        return
    if (isinstance(model_vocab_size, bool) or not isinstance(model_vocab_size, int)
            or model_vocab_size < vocab_size):
        raise ModbenchError(
            f"model_vocab_size must be an integer >= the tokenizer's {vocab_size} tokens, got "
            f"{model_vocab_size!r}; drop --model-vocab-size or raise it"
        )


# ---------------------------------------------------------------------------- the engine


@dataclass
class _Chunk:
    """Documents read together; ``files[i]``/``counts[i]``: the position after document i."""

    files: list[int]
    counts: list[int]


def _read_chunks(
    source: DocumentSource, order: list[int], start: tuple[int, int]
) -> Iterator[tuple[_Chunk, list[Document]]]:
    docs: list[Document] = []
    tag = _Chunk([], [])
    chars = 0
    for doc, k, n in source.iter_positioned(order, start):
        docs.append(doc)
        tag.files.append(k)
        tag.counts.append(n)
        chars += len(doc) if isinstance(doc, str) else 4 * len(doc)
        if len(docs) >= _ENCODE_BATCH_DOCS or chars >= _ENCODE_BATCH_CHARS:
            yield tag, docs
            docs, tag, chars = [], _Chunk([], []), 0
    if docs:
        yield tag, docs


class _Run:
    """One preparation: the writers, the counters and the source position."""

    def __init__(self, out_dir: Path, seq_len: int, dtype: np.dtype[Any], shard_sequences: int,
                 max_tokens: int | None) -> None:
        self.out_dir = out_dir
        self.seq_len = seq_len
        self.max_rows = None if max_tokens is None else max_tokens // seq_len
        self.writers = {
            "train": _SplitWriter(out_dir, "train", seq_len, dtype, shard_sequences,
                                  self.max_rows),
            "val": _SplitWriter(out_dir, "val", seq_len, dtype, shard_sequences),
        }
        self.position = (0, 0)
        self.skipped = 0
        self.reached = False  # the token budget was reached

    @property
    def tokens(self) -> int:
        return sum(w.tokens_in for w in self.writers.values())

    def consume(self, tag: _Chunk, enc: Any) -> None:
        """Add one encoded chunk, stopping right after the document that fills the budget."""
        lengths, is_val = enc.lengths, enc.is_val
        cut = len(lengths)
        train = self.writers["train"]
        if self.max_rows is not None:
            need = self.max_rows * self.seq_len - train.tokens_in
            cum = np.cumsum(np.where(is_val, 0, lengths))
            if cum.size and cum[-1] >= need:
                cut = int(np.searchsorted(cum, need)) + 1
                self.reached = True
        lengths, is_val = lengths[:cut], is_val[:cut]
        ids = enc.ids[: int(lengths.sum())]
        val_tokens = np.repeat(is_val, lengths)
        nonempty = lengths > 0
        train.add(ids[~val_tokens], int(np.sum(nonempty & ~is_val)))
        self.writers["val"].add(ids[val_tokens], int(np.sum(nonempty & is_val)))
        self.skipped += int(np.sum(~nonempty))
        self.position = (tag.files[cut - 1], tag.counts[cut - 1])

    def state(self) -> dict[str, Any]:
        return {"position": list(self.position), "skipped": self.skipped,
                "splits": {s: w.state() for s, w in self.writers.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.position = (int(state["position"][0]), int(state["position"][1]))
        self.skipped = int(state["skipped"])
        for split, writer in self.writers.items():
            writer.restore(state["splits"][split])

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()


def _run(
    run: _Run,
    source: DocumentSource,
    order: list[int],
    spec: EncoderSpec,
    workers: int,
    progress: bool,
    checkpoint: Any = None,
) -> None:
    """Read, tokenize and write until the source ends or the budget is reached."""
    budget = None if run.max_rows is None else run.max_rows * run.seq_len
    train = run.writers["train"]
    done = (lambda: min(train.tokens_in, budget)) if budget is not None else (lambda: run.tokens)
    bar = tqdm(total=budget, initial=done(), desc="tokenizing", unit="tok", unit_scale=True,
               disable=not progress, dynamic_ncols=True)
    last = time.monotonic()
    try:
        if run.reached:
            return
        with EncoderPool(spec, workers) as pool:
            for tag, enc in pool.map(_read_chunks(source, order, run.position)):
                before = done()
                run.consume(tag, enc)
                bar.update(done() - before)
                bar.set_postfix(file=f"{run.position[0] + 1}/{len(order)}", refresh=False)
                if run.reached:
                    return
                closed = any(w.closed for w in run.writers.values())
                if checkpoint is not None and (
                    closed or time.monotonic() - last >= CHECKPOINT_SECONDS
                ):
                    checkpoint(run.state())
                    last = time.monotonic()
    finally:
        bar.close()


def _shuffled(n: int, seed: int | None) -> list[int]:
    """The reading order of ``n`` files: as listed, or a permutation drawn from ``seed``."""
    if seed is None:
        return list(range(n))
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


def _source_record(source: DocumentSource, order: list[int], run: _Run,
                   shuffle_seed: int | None) -> dict[str, Any]:
    names = source.file_names()
    k, n = run.position
    read = [names[i] for i in order[: k + 1]] if run.tokens else []
    return {
        "count": len(names),
        "fingerprint": source.fingerprint(),
        "shuffle_seed": shuffle_seed,
        "read": read,
        "stopped_at": {"file": names[order[k]], "documents": n} if run.reached else None,
    }


def _metadata(run: _Run, split_meta: dict[str, Any], tokenizer: Tokenizer, tokenizer_spec: str,
              model_vocab_size: int | None, val_fraction: float, max_tokens: int | None,
              source_meta: dict[str, Any]) -> dict[str, Any]:
    vocab_size = tokenizer_vocab_size(tokenizer)
    tok: dict[str, Any] = {
        "spec": tokenizer_spec,
        "vocab_size": vocab_size,
        "sha256": tokenizer_sha256(tokenizer),
        "eos_id": find_eos_id(tokenizer),
        "file": TOKENIZER_FILE,
    }
    if model_vocab_size is not None:
        tok["model_vocab_size"] = model_vocab_size
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"modbench {__version__}",
        "prepared_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **source_meta,
        "tokenizer": tok,
        "seq_len": run.seq_len,
        "dtype": dtype_name(token_dtype(vocab_size)),
        "byte_order": "little",
        "val_fraction": float(val_fraction),
        "split_rule": "sha256('modbench-split-v1\\0' + text)[:8] / 2**64 < val_fraction",
        "max_tokens": max_tokens,
        "budget_reached": run.reached if max_tokens is not None else None,
        "documents": {split: split_meta[split]["documents"] for split in SPLITS},
        "documents_skipped_empty": run.skipped,
        "tokens": sum(m["tokens"] + m["tokens_discarded"] for m in split_meta.values()),
        "tokens_discarded": sum(m["tokens_discarded"] for m in split_meta.values()),
        "splits": split_meta,
    }


def _write_json_durably(path: Path, obj: Any) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8")
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _finish(run: _Run, out_dir: Path, tokenizer: Tokenizer, meta_args: dict[str, Any],
            source_label: str) -> dict[str, Any]:
    split_meta = {split: w.finish() for split, w in run.writers.items()}
    if sum(m["documents"] for m in split_meta.values()) == 0:
        raise ModbenchError(
            f"source {source_label!r} yielded no documents"
            + (f" ({run.skipped} empty ones skipped)" if run.skipped else "")
            + "; check the path, --text-field and --split"
        )
    (out_dir / TOKENIZER_FILE).write_bytes(tokenizer_json(tokenizer))
    meta = _metadata(run, split_meta, tokenizer, **meta_args)
    _write_json_durably(out_dir / METADATA_FILE, meta)
    return meta


# ---------------------------------------------------------------------------- the work folder


def partial_dir(out_dir: Path) -> Path:
    """Where ``prepare_dataset`` works on (and resumes) ``out_dir``."""
    return out_dir.parent / f".{out_dir.name}.partial"


@contextlib.contextmanager
def _locked(work: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``work`` (two prepares of one ``out_dir`` would collide)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    fh = (work / LOCK_FILE).open("a")
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise ModbenchError(
                f"another `modbench data prepare` is writing {work} (it is locked); wait for it "
                "to finish or stop it"
            ) from exc
        yield
    finally:
        fh.close()


def _settings_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in keys[:3])


def _load_progress(work: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint in ``work`` (None when there is none); refuses other settings."""
    path = work / PROGRESS_FILE
    if not path.is_file():
        return None
    try:
        progress = json.loads(path.read_text(encoding="utf-8"))
        ok = isinstance(progress, dict) and progress.get("version") == _PROGRESS_VERSION
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise _damaged(path, "is unreadable")
    if progress["settings"] != settings:
        raise ModbenchError(
            f"{work} holds an unfinished preparation of the same --out with other settings "
            f"({_settings_diff(progress['settings'], settings)}); run it with its settings to "
            f"finish it, or delete {work} to start afresh"
        )
    return progress


# ---------------------------------------------------------------------------- one preparation


@dataclass
class _Job:
    """One preparation, resolved and checked before any work: the tokenizer, the token dtype, the
    opened source and its reading order, what the metadata records about the source, the
    settings a checkpoint must match, and the encoder workers' spec."""

    tok: Tokenizer
    dtype: np.dtype[Any]
    src: DocumentSource
    order: list[int]
    source_meta: dict[str, Any]
    settings: dict[str, Any]
    encoder: EncoderSpec
    meta_args: dict[str, Any]


def _source_meta(source: Source, options: PrepareSettings, src: DocumentSource,
                 src_tok: tuple[Tokenizer, str] | None) -> dict[str, Any]:
    """What the metadata records about where the documents came from."""
    source_meta: dict[str, Any] = {"recipe": options.recipe, "source": describe_source(source),
                                   "text_field": options.text_field}
    if isinstance(source, str) and source.startswith("hf:"):
        source_meta["hf_split"] = options.split
        source_meta["data_files"] = options.data_files
    source_meta["revision"] = src.revision
    source_meta["source_tokenizer"] = None if src_tok is None else {
        "spec": src_tok[1], "sha256": tokenizer_sha256(src_tok[0])}
    return source_meta


def _checkpoint_settings(source_meta: dict[str, Any], src: DocumentSource, tok: Tokenizer,
                         options: PrepareSettings) -> dict[str, Any]:
    """Everything the output depends on: a checkpoint is continued only under equal settings."""
    return {
        "source": source_meta["source"], "source_fingerprint": src.fingerprint(),
        "revision": src.revision, "text_field": options.text_field, "split": options.split,
        "data_files": options.data_files, "shuffle_seed": options.shuffle_seed,
        "source_tokenizer": source_meta["source_tokenizer"],
        "tokenizer_sha256": tokenizer_sha256(tok), "seq_len": options.seq_len,
        "val_fraction": float(options.val_fraction), "shard_sequences": options.shard_sequences,
        "max_tokens": options.max_tokens, "model_vocab_size": options.model_vocab_size,
    }


def _resolve_job(source: Source, tokenizer: Tokenizer | str | Path,
                 options: PrepareSettings) -> _Job:
    """Load the tokenizers and open the source, failing before any work on bad input."""
    tok, spec = _resolve_tokenizer(tokenizer, options.vocab_size)
    eos_id = find_eos_id(tok)  # fail before any work when there is no EOS token
    vocab = tokenizer_vocab_size(tok)
    _check_model_vocab(options.model_vocab_size, vocab)
    src_tok: tuple[Tokenizer, str] | None = None
    if options.source_tokenizer is not None:
        src_tok = _resolve_tokenizer(options.source_tokenizer, None)
    src = open_source(source, text_field=options.text_field, split=options.split,
                      data_files=options.data_files, revision=options.revision,
                      ids_ok=src_tok is not None)
    order = _shuffled(len(src.file_names()), options.shuffle_seed)
    source_meta = _source_meta(source, options, src, src_tok)
    settings = _checkpoint_settings(source_meta, src, tok, options)
    encoder = EncoderSpec(tokenizer_json(tok).decode("utf-8"), eos_id, token_dtype(vocab).str,
                          float(options.val_fraction),
                          None if src_tok is None else tokenizer_json(src_tok[0]).decode())
    meta_args = {"tokenizer_spec": spec, "model_vocab_size": options.model_vocab_size,
                 "val_fraction": options.val_fraction, "max_tokens": options.max_tokens}
    return _Job(tok, token_dtype(vocab), src, order, source_meta, settings, encoder, meta_args)


def _start_or_resume(work: Path, job: _Job, options: PrepareSettings) -> _Run:
    """A run continuing the checkpoint in ``work``, or a fresh one (stale shards removed)."""
    previous = _load_progress(work, job.settings)
    run = _Run(work, options.seq_len, job.dtype, options.shard_sequences, options.max_tokens)
    if previous is not None:
        run.restore(previous["state"])
    else:
        for stale in work.glob("*.bin"):  # killed before its first checkpoint
            stale.unlink()
    return run


def _prepare_in(work: Path, job: _Job, options: PrepareSettings) -> dict[str, Any]:
    """Prepare (or finish preparing) the dataset inside ``work``, checkpointing as it goes;
    returns the metadata. On failure the work folder is kept when it can be continued (there
    is a checkpoint and the failure is an interruption, a crash or a transient source error,
    not a :class:`~modbench.errors.ModbenchError` about the input), else removed."""
    run = _start_or_resume(work, job, options)

    def checkpoint(state: dict[str, Any]) -> None:
        atomic_write_text(work / PROGRESS_FILE, json.dumps(
            {"version": _PROGRESS_VERSION, "settings": job.settings, "state": state}))

    try:
        _run(run, job.src, job.order, job.encoder, options.workers, options.progress, checkpoint)
        meta_args = {
            **job.meta_args,
            "source_meta": {
                **job.source_meta,
                "source_files": _source_record(job.src, job.order, run, options.shuffle_seed),
            },
        }
        return _finish(run, work, job.tok, meta_args, job.source_meta["source"])
    except BaseException as exc:
        run.abort()
        resumable = (work / PROGRESS_FILE).is_file() and (
            isinstance(exc, TransientError) or not isinstance(exc, ModbenchError)
        )
        if not resumable:
            remove_tree(work)
        elif options.progress:
            print(f"\nstopped: the finished part is kept in {work}; run the same "
                  "command again to continue", file=sys.stderr)
        raise


def _move_into_place(work: Path, out: Path) -> None:
    """Rename the finished work folder to ``out`` (still free or empty)."""
    _check_out_dir(out)
    try:
        os.replace(work, out)
    except OSError as exc:
        raise ModbenchError(
            f"could not move the prepared dataset into {out} ({exc.strerror}); "
            "choose another --out"
        ) from exc


# ---------------------------------------------------------------------------- public API


@dataclass(frozen=True)
class PrepareSettings:
    """How :func:`prepare_dataset` reads, tokenizes and packs a source (its docstring says what
    each does); everything but ``seq_len`` has a default."""

    seq_len: int
    vocab_size: int | None = None
    val_fraction: float = 0.02
    shard_sequences: int = DEFAULT_SHARD_SEQUENCES
    text_field: str = "text"
    split: str = "train"
    data_files: str | list[str] | None = None
    progress: bool = True
    workers: int = 1
    max_tokens: int | None = None
    shuffle_seed: int | None = None
    revision: str | None = None
    source_tokenizer: Tokenizer | str | Path | None = None
    model_vocab_size: int | None = None
    recipe: str | None = None


def prepare_dataset(source: Source, tokenizer: Tokenizer | str | Path, out_dir: str | Path,
                    options: PrepareSettings) -> dict[str, Any]:
    """Tokenize ``source``, pack it into rows of ``options.seq_len`` tokens and write a dataset
    (``options``: :class:`PrepareSettings`, whose fields the text below names).

    ``source``: a ``.txt`` file (one document), a ``.jsonl``/``.json`` file (one JSON object
    per line, text in ``text_field``; also gzip-compressed, ``.jsonl.gz``/``.json.gz``), a
    ``.parquet`` file (column ``text_field``), a directory of such files (recursive, sorted
    by path), ``"hf:NAME"``/``"hf:NAME:CONFIG"`` (a Hugging Face dataset, streamed file by
    file; ``split``, ``data_files`` and ``revision`` select what is read), or an iterable of
    document strings. ``tokenizer``: a ``Tokenizer`` or a spec for
    :func:`~modbench.data.load_tokenizer` (``vocab_size`` is needed for ``"builtin"``).

    Documents go to validation by a hash of their text (``val_fraction``), *before* packing.
    Each document is followed by EOS; each split is concatenated and cut into rows of exactly
    ``seq_len`` tokens; the last partial row is discarded (counted in ``tokens_discarded``).

    ``workers``: tokenizer processes (the output does not depend on it). ``max_tokens``: stop
    once the training split holds ``max_tokens // seq_len`` rows, so a smaller budget gives
    exactly the first rows of a larger one. ``shuffle_seed``: read the source's files in a
    permutation drawn from this seed instead of in order. ``source_tokenizer``: decodes
    documents stored as token ids (nvidia's ClimbMix: GPT-2). ``model_vocab_size``: the
    embedding size of the models the data is for, when larger than the tokenizer's (recorded;
    training accepts either). ``recipe``: a name recorded in the metadata.

    The work happens in ``.NAME.partial`` next to ``out_dir`` with checkpoints; an
    interrupted call is continued by calling it again with the same arguments. A
    :class:`~modbench.errors.ModbenchError` about the input removes the work folder, so a
    failed call leaves nothing behind. Returns the metadata dict.
    """
    _validate_options(options.seq_len, options.val_fraction, options.shard_sequences,
                      options.max_tokens)
    check_workers(options.workers)
    out = Path(out_dir).expanduser()
    _check_out_dir(out)
    job = _resolve_job(source, tokenizer, options)
    work = partial_dir(out)
    created = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    try:
        with _locked(work):
            meta = _prepare_in(work, job, options)
            (work / PROGRESS_FILE).unlink(missing_ok=True)
            (work / LOCK_FILE).unlink(missing_ok=True)
        _move_into_place(work, out)
    except BaseException:
        if created and work.exists() and not (work / PROGRESS_FILE).is_file():
            remove_tree(work)
        raise
    return meta


def parse_token_count(text: str | int) -> int:
    """``"23.28B"``, ``"500M"``, ``"1e9"``, ``"65536"`` -> an int (K, M, B, T: 10**3 ...)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().replace("_", "").replace(",", "")
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(s[-1:].upper())
    try:
        value = decimal.Decimal(s[:-1] if scale else s) * (scale or 1)
    except decimal.InvalidOperation:
        value = decimal.Decimal(-1)
    if not value.is_finite() or value < 1 or value != value.to_integral_value():
        raise ModbenchError(
            f"{text!r} is not a token count; write it like 23280000000, 23.28B, 500M or 1e9"
        )
    return int(value)


def builtin_dataset_path(vocab_size: int, seq_len: int) -> Path:
    """Where :func:`builtin_dataset` caches the built-in dataset."""
    fp = builtin_corpus_fingerprint()[:10]
    return cache_dir() / "data" / f"builtin-v{vocab_size}-s{seq_len}-{fp}"


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
    """Write a whole dataset from in-memory documents into the (fresh, empty) ``out_dir``,
    in this process and without checkpoints."""
    vocab = tokenizer_vocab_size(tokenizer)
    run = _Run(out_dir, seq_len, token_dtype(vocab), shard_sequences, None)
    src = InMemorySource(docs)
    spec = EncoderSpec(tokenizer_json(tokenizer).decode("utf-8"), find_eos_id(tokenizer),
                       token_dtype(vocab).str, float(val_fraction))
    try:
        _run(run, src, [0], spec, 1, progress)
        meta_args = {"tokenizer_spec": tokenizer_spec, "model_vocab_size": None,
                     "val_fraction": val_fraction, "max_tokens": None,
                     "source_meta": source_meta}
        return _finish(run, out_dir, tokenizer, meta_args, source_meta["source"])
    except BaseException:
        run.abort()
        raise


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
