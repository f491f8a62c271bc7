"""Tokenizing documents in worker processes, with the results taken back in input order.

The main process reads the source and writes the shards; ``workers`` processes decode
token-id documents, drop empty ones, assign each document to train or validation (the hash
rule of :func:`~modbench.data.corpus.is_validation_document`) and tokenize it. Results are
consumed strictly in submission order and nothing a worker computes depends on how documents
were grouped, so the output is byte-identical for any number of workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from tokenizers import Tokenizer

from modbench.data.corpus import is_validation_document
from modbench.data.sources import Document, TransientError
from modbench.errors import ModbenchError

T = TypeVar("T")

_IN_FLIGHT_PER_WORKER = 2
"""Chunks submitted ahead per worker (bounds memory while keeping every worker busy)."""


@dataclass(frozen=True)
class EncoderSpec:
    """Everything a worker needs, as plain picklable data."""

    tokenizer_json: str
    eos_id: int
    dtype: str
    val_fraction: float
    source_tokenizer_json: str | None = None


@dataclass
class Encoded:
    """One chunk, tokenized: ``ids`` holds every non-empty document's tokens followed by EOS,
    in order; per document, ``lengths`` (0 for an empty document) and ``is_val``."""

    ids: np.ndarray
    lengths: np.ndarray
    is_val: np.ndarray


class Encoder:
    """Turns a list of documents into :class:`Encoded` (in this process)."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        self.source = (
            Tokenizer.from_str(spec.source_tokenizer_json)
            if spec.source_tokenizer_json is not None
            else None
        )
        self.dtype = np.dtype(spec.dtype)
        self._encode = (
            getattr(self.tokenizer, "encode_batch_fast", None) or self.tokenizer.encode_batch
        )

    def texts(self, docs: list[Document]) -> list[str]:
        """The documents as text (token-id documents decoded with the source tokenizer)."""
        coded = [i for i, d in enumerate(docs) if not isinstance(d, str)]
        if not coded:
            return docs  # type: ignore[return-value]
        if self.source is None:  # pragma: no cover - sources refuse ids without one
            raise ModbenchError("token-id documents need --source-tokenizer to decode them")
        try:
            decoded = self.source.decode_batch([docs[i] for i in coded], skip_special_tokens=True)
        except (TypeError, OverflowError, ValueError) as exc:
            raise ModbenchError(
                f"a document's token ids could not be decoded ({exc}); the field must hold "
                "lists of non-negative integers made by --source-tokenizer"
            ) from exc
        texts = list(docs)
        for i, text in zip(coded, decoded, strict=True):
            texts[i] = text
        return texts  # type: ignore[return-value]

    def __call__(self, docs: list[Document]) -> Encoded:
        texts = self.texts(docs)
        keep = [i for i, t in enumerate(texts) if t.strip()]
        encodings = self._encode([texts[i] for i in keep], add_special_tokens=False)
        lengths = np.zeros(len(texts), dtype=np.int64)
        is_val = np.zeros(len(texts), dtype=bool)
        id_lists = [enc.ids for enc in encodings]
        for i, ids in zip(keep, id_lists, strict=True):
            lengths[i] = len(ids) + 1
            is_val[i] = is_validation_document(texts[i], self.spec.val_fraction)
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        pos = 0
        for ids in id_lists:
            out[pos : pos + len(ids)] = ids
            pos += len(ids)
            out[pos] = self.spec.eos_id
            pos += 1
        return Encoded(out, lengths, is_val)


_WORKER: Encoder | None = None


def _exit_with_parent(parent: int) -> None:
    """A worker whose main process died (``kill -9``) exits instead of waiting forever on
    a queue no one writes to any more."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def _init_worker(spec: EncoderSpec) -> None:
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    _WORKER = Encoder(spec)


def _work(docs: list[Document]) -> Encoded:
    assert _WORKER is not None
    return _WORKER(docs)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ModbenchError(f"workers must be an integer >= 1, got {workers!r}; e.g. --workers 4")
    return workers


class EncoderPool:
    """``workers == 1``: encode in this process; otherwise in ``workers`` processes.

    Use as a context manager; :meth:`map` yields ``(tag, Encoded)`` in input order.
    """

    def __init__(self, spec: EncoderSpec, workers: int) -> None:
        self.workers = check_workers(workers)
        self._local = Encoder(spec) if workers == 1 else None
        self._pool: ProcessPoolExecutor | None = None
        if workers > 1:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            # set while the workers start, so tokenizers does not warn about forking after
            # its own thread pool was used in this process
            with _env("TOKENIZERS_PARALLELISM", "false"):
                self._pool = ProcessPoolExecutor(
                    workers, mp_context=mp.get_context(method), initializer=_init_worker,
                    initargs=(spec,),
                )

    def __enter__(self) -> EncoderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def map(self, items: Iterable[tuple[T, list[Document]]]) -> Iterator[tuple[T, Encoded]]:
        if self._local is not None:
            for tag, docs in items:
                yield tag, self._local(docs)
            return
        assert self._pool is not None
        pending: deque[tuple[T, Future[Encoded]]] = deque()
        source = iter(items)
        exhausted = False
        while True:
            while not exhausted and len(pending) < _IN_FLIGHT_PER_WORKER * self.workers:
                item: Any = next(source, None)
                if item is None:
                    exhausted = True
                    break
                tag, docs = item
                with _env("TOKENIZERS_PARALLELISM", "false"):  # a replacement worker may fork
                    pending.append((tag, self._pool.submit(_work, docs)))
            if not pending:
                return
            tag, future = pending.popleft()
            try:
                result = future.result()
            except BrokenProcessPool as exc:
                raise TransientError(
                    "a tokenizer worker process died (out of memory?); run the same command "
                    "again to resume, with fewer --workers if it recurs"
                ) from exc
            yield tag, result
