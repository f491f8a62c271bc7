"""Where documents come from: local files, directories, Hugging Face datasets, iterables.

A source is read as an ordered list of *files*, each an ordered stream of documents
(:class:`DocumentSource`). That is what lets ``prepare`` resume in the middle of a source
(a position is a file and a document count in it) and shuffle a source by whole files.
A document is text, or a list of token ids (a pre-tokenized corpus such as nvidia's
ClimbMix, decoded back to text with the tokenizer that made it).
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Sized
from itertools import islice
from pathlib import Path
from typing import IO, Any

from modbench.errors import ModbenchError, suggest

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")
"""File types understood as document sources (``.gz``: gzip-compressed JSON lines, e.g.
C4's ``c4-train.00000-of-01024.json.gz``)."""

Source = str | Path | Iterable[str]
Document = str | list[int]
"""A document: its text, or the token ids a pre-tokenized corpus stores for it."""

_IDS_HINT = (
    "pass --source-tokenizer with the tokenizer that made them (e.g. hf:openai-community/gpt2 "
    "for nvidia's ClimbMix) so they are decoded to text"
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _missing_field(text_field: str, available: Iterable[str], where: str) -> ModbenchError:
    names = sorted(str(a) for a in available)
    return ModbenchError(
        f"{where} has no field {text_field!r}{suggest(text_field, names)}; "
        f"available: {', '.join(names) or 'none'}; pick one with --text-field"
    )


def _read_txt(path: Path) -> Iterator[str]:
    data = path.read_bytes()
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModbenchError(
            f"{path} is not valid UTF-8 (byte {exc.start}); convert it to UTF-8 or remove it"
        ) from exc


def _document(value: Any, text_field: str, where: str, ids_ok: bool) -> Document | None:
    """``value`` as a document: a str, a list of token ids (``ids_ok``), or None (skip)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and (not value or isinstance(value[0], int)):
        if ids_ok:
            return value
        raise ModbenchError(
            f"{where}: field {text_field!r} holds token ids, not text; {_IDS_HINT}"
        )
    raise ModbenchError(
        f"{where}: field {text_field!r} is a {type(value).__name__}, not a string; "
        "pick a text field with --text-field"
    )


def _text_of(obj: Any, text_field: str, where: str, ids_ok: bool = False) -> Document | None:
    if not isinstance(obj, dict):
        raise ModbenchError(
            f"{where} is not a JSON object; expected one object per line like "
            f'{{"{text_field}": "..."}}'
        )
    if text_field not in obj:
        raise _missing_field(text_field, obj.keys(), where)
    return _document(obj[text_field], text_field, where, ids_ok)


def _open_text(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _read_jsonl(path: Path, text_field: str, ids_ok: bool = False) -> Iterator[Document]:
    with _open_text(path) as fh:
        try:
            first = fh.read(1)
            while first and first.isspace():
                first = fh.read(1)
            fh.seek(0)
            if first == "[":  # a whole-file JSON array of objects
                items = json.load(fh)
                for i, obj in enumerate(items):
                    text = _text_of(obj, text_field, f"{path} item {i}", ids_ok)
                    if text is not None:
                        yield text
                return
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ModbenchError(
                        f"{path}:{lineno} is not valid JSON ({exc.msg}); "
                        "expected one JSON object per line"
                    ) from exc
                text = _text_of(obj, text_field, f"{path}:{lineno}", ids_ok)
                if text is not None:
                    yield text
        except UnicodeDecodeError as exc:
            raise ModbenchError(
                f"{path} is not valid UTF-8; convert it to UTF-8 or remove it"
            ) from exc
        except (OSError, EOFError) as exc:  # gzip: not gzip data, truncated
            what = "a readable gzip file" if path.name.lower().endswith(".gz") else "readable"
            raise ModbenchError(
                f"{path} is not {what} ({_first_line(exc)}); replace it with a good copy"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ModbenchError(
                f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                "expected a JSON array or one JSON object per line"
            ) from exc


def _read_parquet(path: Path, text_field: str, ids_ok: bool = False) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        raise ModbenchError(
            f"{path} is not a readable parquet file ({_first_line(exc)}); re-export it"
        ) from exc
    names = pf.schema_arrow.names
    if text_field not in names:
        raise _missing_field(text_field, names, str(path))
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        column = batch.column(0)
        for value in column.to_pylist():
            doc = _document(value, text_field, str(path), ids_ok)
            if doc is not None:
                yield doc


def _suffix(path: Path) -> str:
    """The file type of ``path``: one of :data:`LOCAL_SUFFIXES`, or its plain suffix."""
    name = path.name.lower()
    for suffix in LOCAL_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower()


def _read_file(path: Path, text_field: str, ids_ok: bool = False) -> Iterator[Document]:
    suffix = _suffix(path)
    if suffix == ".txt":
        yield from _read_txt(path)
    elif suffix in (".jsonl", ".json", ".jsonl.gz", ".json.gz"):
        yield from _read_jsonl(path, text_field, ids_ok)
    elif suffix == ".parquet":
        yield from _read_parquet(path, text_field, ids_ok)
    else:
        raise ModbenchError(
            f"unsupported source file {path} (suffix {suffix or 'none'!r}); "
            f"use one of {', '.join(LOCAL_SUFFIXES)} or a directory of them"
        )


def local_source_files(path: Path) -> list[Path]:
    """The files a local source path stands for (a file itself, or a directory's files)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ModbenchError(
            f"source {str(path)!r} does not exist; give a .txt/.jsonl/.json/.parquet file, "
            "a directory of them, or hf:NAME"
        )
    files = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and _suffix(p) in LOCAL_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    files.sort(key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise ModbenchError(
            f"directory {path} contains no {'/'.join(LOCAL_SUFFIXES)} files; "
            "point --source at a directory with text files"
        )
    return files


def iter_local_documents(
    path: Path, *, text_field: str = "text", ids_ok: bool = False
) -> Iterator[Document]:
    """Documents from a local file or (recursively, sorted) a directory of files."""
    for file in local_source_files(path):
        yield from _read_file(file, text_field, ids_ok)


def parse_hf_source(source: str) -> tuple[str, str | None]:
    """Split ``"hf:NAME"`` / ``"hf:NAME:CONFIG"`` into (NAME, CONFIG or None)."""
    if not source.startswith("hf:"):
        raise ModbenchError(f"{source!r} is not an hf: source; use hf:NAME or hf:NAME:CONFIG")
    rest = source[3:]
    name, _, config = rest.partition(":")
    name = name.strip()
    if not name:
        raise ModbenchError(
            f"empty dataset name in {source!r}; use hf:NAME or hf:NAME:CONFIG, e.g. hf:json"
        )
    return name, (config.strip() or None)


class TransientError(ModbenchError):
    """A failure that may pass (network, a worker process killed): ``prepare`` keeps what it
    finished, and running the same command again resumes."""


class SourceUnavailable(TransientError):
    """Reading a source failed in a way that may pass (network, a file being replaced)."""


class DocumentSource:
    """A source as an ordered list of files, each an ordered stream of documents.

    ``position`` in :meth:`iter_positioned` is ``(k, n)``: ``k`` indexes the reading order
    (a permutation of the files), ``n`` counts the documents read from that file so far, so
    reading can restart right after any document.
    """

    description: str = ""
    revision: str | None = None
    length: int | None = None
    """Number of documents, when known without reading (in-memory lists)."""

    def file_names(self) -> list[str]:
        raise NotImplementedError

    def file_sizes(self) -> list[int | None]:
        return [None] * len(self.file_names())

    def iter_file(self, index: int) -> Iterator[Document]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """sha256 over the files' names and sizes (what identifies the data read)."""
        h = hashlib.sha256()
        for name, size in zip(self.file_names(), self.file_sizes(), strict=True):
            h.update(f"{name}\0{size}\n".encode())
        return h.hexdigest()

    def iter_positioned(
        self, order: list[int], start: tuple[int, int] = (0, 0)
    ) -> Iterator[tuple[Document, int, int]]:
        """``(document, k, n)`` for the documents after position ``start``, files read in
        ``order``; ``(k, n)`` is the position right after that document."""
        k0, n0 = start
        names = self.file_names()
        for k in range(k0, len(order)):
            docs = self.iter_file(order[k])
            n = n0 if k == k0 else 0
            if n and sum(1 for _ in islice(docs, n)) < n:
                raise ModbenchError(
                    f"{names[order[k]]} now has fewer than the {n} documents read from it "
                    "before, so the source changed; delete the unfinished preparation and "
                    "start again"
                )
            for doc in docs:
                n += 1
                yield doc, k, n


class LocalSource(DocumentSource):
    """A local file or directory (recursive, sorted by relative path)."""

    def __init__(self, path: Path, *, text_field: str = "text", ids_ok: bool = False) -> None:
        self.path = path
        self.description = str(path)
        self.text_field = text_field
        self.ids_ok = ids_ok
        self.files = local_source_files(path)
        root = path if path.is_dir() else path.parent
        self._names = [f.relative_to(root).as_posix() for f in self.files]

    def file_names(self) -> list[str]:
        return self._names

    def file_sizes(self) -> list[int | None]:
        return [f.stat().st_size for f in self.files]

    def iter_file(self, index: int) -> Iterator[Document]:
        return _read_file(self.files[index], self.text_field, self.ids_ok)


class InMemorySource(DocumentSource):
    """An iterable of strings, as one "file"."""

    def __init__(self, docs: Iterable[str]) -> None:
        self.docs = docs
        self.description = "<in-memory documents>"
        self.length = len(docs) if isinstance(docs, Sized) else None

    def file_names(self) -> list[str]:
        return [self.description]

    def file_sizes(self) -> list[int | None]:
        return [self.length]

    def iter_file(self, index: int) -> Iterator[Document]:
        for i, doc in enumerate(self.docs):
            if not isinstance(doc, str):
                raise ModbenchError(
                    f"document {i} of the given iterable is a {type(doc).__name__}, not a str; "
                    "pass an iterable of strings"
                )
            yield doc


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ModbenchError(
            "hf: sources need the `datasets` package; install it with pip install 'modbench[hf]'"
        ) from exc
    return datasets


def _no_remote_code(fn: Any) -> dict[str, Any]:
    """``trust_remote_code=False`` where this ``datasets`` release takes it (2.16 to 3.x: a
    dataset's loading script runs only when asked; 4 and later run no scripts at all)."""
    try:
        takes = "trust_remote_code" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes = False
    return {"trust_remote_code": False} if takes else {}


_COMMIT = re.compile(r"@([0-9a-f]{40})/")


class HFSource(DocumentSource):
    """A Hugging Face dataset split, read file by file with ``datasets`` (streamed).

    ``datasets.load_dataset_builder`` resolves the split's data files (for a Hub dataset:
    ``hf://`` addresses pinned to the commit of ``revision``, recorded as :attr:`revision`);
    each file is then read with ``load_dataset(<format>, data_files=[file],
    streaming=True)``. A dataset whose files cannot be listed is read as one stream.
    """

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        split: str = "train",
        data_files: str | list[str] | None = None,
        revision: str | None = None,
        text_field: str = "text",
        ids_ok: bool = False,
        streaming: bool = True,
    ) -> None:
        self.datasets = _import_datasets()
        self.path, self.name, self.split = path, name, split
        self.text_field, self.ids_ok, self.streaming = text_field, ids_ok, streaming
        self.data_files = data_files
        label = f"Hugging Face dataset {path!r}" + (f" (config {name!r})" if name else "")
        self.where = f"{label} split {split!r}"
        try:
            builder = self.datasets.load_dataset_builder(
                path, name, data_files=data_files, revision=revision,
                **_no_remote_code(self.datasets.load_dataset_builder),
            )
        except Exception as exc:
            raise ModbenchError(
                f"could not load {label}, split {split!r}: {_first_line(exc)}; check the name, "
                "--split, --data-files and network access"
            ) from exc
        self.format = str(builder.name)
        found = builder.config.data_files
        self._files: list[str] | None = None
        if found is not None:
            by_split = {str(k): [str(f) for f in v] for k, v in found.items()}
            if split not in by_split:
                raise ModbenchError(
                    f"{label} has no split {split!r} (it has {', '.join(sorted(by_split))}); "
                    "pick one with --split"
                )
            self._files = by_split[split]
            if not self._files:
                raise ModbenchError(f"{self.where} has no data files; check --data-files")
        commit = _COMMIT.search(self._files[0]) if self._files else None
        self.revision = commit.group(1) if commit else revision
        self.description = f"hf:{path}" + (f":{name}" if name else "")

    def file_names(self) -> list[str]:
        return self._files if self._files is not None else [self.where]

    def file_sizes(self) -> list[int | None]:
        return [os.path.getsize(f) if os.path.isfile(f) else None for f in self.file_names()]

    def _open(self, index: int) -> Any:
        if self._files is None:
            return self.datasets.load_dataset(
                self.path, self.name, split=self.split, data_files=self.data_files,
                revision=self.revision, streaming=self.streaming,
                **_no_remote_code(self.datasets.load_dataset),
            )
        return self.datasets.load_dataset(
            self.format, data_files=[self._files[index]], split="train", streaming=self.streaming,
            **_no_remote_code(self.datasets.load_dataset),
        )

    def iter_file(self, index: int) -> Iterator[Document]:
        where = self.where if self._files is None else f"{self._files[index]} ({self.where})"
        try:
            ds = self._open(index)
        except Exception as exc:
            raise SourceUnavailable(
                f"could not open {where}: {_first_line(exc)}; check network access and run the "
                "same command again (a prepare resumes where it stopped)"
            ) from exc
        columns = getattr(ds, "column_names", None)
        if columns is not None:
            if self.text_field not in columns:
                raise _missing_field(self.text_field, columns, self.where)
            if len(columns) > 1 and hasattr(ds, "select_columns"):
                ds = ds.select_columns([self.text_field])
        rows = iter(ds)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as exc:
                raise SourceUnavailable(
                    f"reading {where} failed: {_first_line(exc)}; check network access and run "
                    "the same command again (a prepare resumes where it stopped)"
                ) from exc
            if self.text_field not in row:
                raise _missing_field(self.text_field, row.keys(), self.where)
            doc = _document(row[self.text_field], self.text_field, self.where, self.ids_ok)
            if doc is not None:
                yield doc


def iter_hf_documents(
    path: str,
    *,
    name: str | None = None,
    split: str = "train",
    data_files: str | list[str] | None = None,
    text_field: str = "text",
    streaming: bool = True,
    revision: str | None = None,
    ids_ok: bool = False,
) -> Iterator[Document]:
    """Documents of a Hugging Face dataset, read with ``datasets`` (see :class:`HFSource`).

    ``path``/``name`` are ``load_dataset``'s dataset path and config name (``path`` may be a
    Hub id, a packaged builder such as ``"json"`` with ``data_files``, or a local directory).
    Rows whose ``text_field`` is ``None`` are skipped.
    """
    source = HFSource(path, name=name, split=split, data_files=data_files, revision=revision,
                      text_field=text_field, ids_ok=ids_ok, streaming=streaming)
    for i in range(len(source.file_names())):
        yield from source.iter_file(i)


def describe_source(source: Source) -> str:
    """A short string naming the source, for metadata."""
    if isinstance(source, Path):
        return str(source)
    if isinstance(source, str):
        return source
    return "<in-memory documents>"


def open_source(
    source: Source,
    *,
    text_field: str = "text",
    split: str = "train",
    data_files: str | list[str] | None = None,
    revision: str | None = None,
    ids_ok: bool = False,
) -> DocumentSource:
    """The :class:`DocumentSource` of any supported source (see
    :func:`modbench.data.prepare_dataset`); checks that it exists before anything is read."""
    if isinstance(source, str) and source.startswith("hf:"):
        name, config = parse_hf_source(source)
        return HFSource(name, name=config, split=split, data_files=data_files,
                        revision=revision, text_field=text_field, ids_ok=ids_ok)
    if data_files is not None:
        raise ModbenchError(
            "--data-files only applies to hf: sources; use e.g. --source hf:json "
            "--data-files 'dir/*.jsonl', or pass the directory as --source"
        )
    if revision is not None:
        raise ModbenchError("--revision only applies to hf: sources; drop it for local files")
    if isinstance(source, str | Path):
        return LocalSource(Path(source).expanduser(), text_field=text_field, ids_ok=ids_ok)
    return InMemorySource(source)


def iter_documents(
    source: Source,
    *,
    text_field: str = "text",
    split: str = "train",
    data_files: str | list[str] | None = None,
) -> Iterator[str]:
    """Documents of any supported source (see :func:`modbench.data.prepare_dataset`)."""
    src = open_source(source, text_field=text_field, split=split, data_files=data_files)
    for i in range(len(src.file_names())):
        for doc in src.iter_file(i):
            if isinstance(doc, str):  # always: without ids_ok, token-id documents raise
                yield doc
