"""Where documents come from: local files, directories, Hugging Face datasets, iterables."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from modbench.errors import ModbenchError, suggest

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
"""File types understood as document sources."""

Source = str | Path | Iterable[str]


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


def _text_of(obj: Any, text_field: str, where: str) -> str | None:
    if not isinstance(obj, dict):
        raise ModbenchError(
            f"{where} is not a JSON object; expected one object per line like "
            f'{{"{text_field}": "..."}}'
        )
    if text_field not in obj:
        raise _missing_field(text_field, obj.keys(), where)
    value = obj[text_field]
    if value is None:
        return None
    if not isinstance(value, str):
        raise ModbenchError(
            f"{where}: field {text_field!r} is a {type(value).__name__}, not a string; "
            "pick a text field with --text-field"
        )
    return value


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with path.open("r", encoding="utf-8") as fh:
        try:
            first = fh.read(1)
            while first and first.isspace():
                first = fh.read(1)
            fh.seek(0)
            if first == "[":  # a whole-file JSON array of objects
                items = json.load(fh)
                for i, obj in enumerate(items):
                    text = _text_of(obj, text_field, f"{path} item {i}")
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
                text = _text_of(obj, text_field, f"{path}:{lineno}")
                if text is not None:
                    yield text
        except UnicodeDecodeError as exc:
            raise ModbenchError(
                f"{path} is not valid UTF-8; convert it to UTF-8 or remove it"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ModbenchError(
                f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                "expected a JSON array or one JSON object per line"
            ) from exc


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
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
            if value is None:
                continue
            if not isinstance(value, str):
                raise ModbenchError(
                    f"{path}: column {text_field!r} holds {type(value).__name__} values, not "
                    "strings; pick a text column with --text-field"
                )
            yield value


def _read_file(path: Path, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield from _read_txt(path)
    elif suffix in (".jsonl", ".json"):
        yield from _read_jsonl(path, text_field)
    elif suffix == ".parquet":
        yield from _read_parquet(path, text_field)
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
        and p.suffix.lower() in LOCAL_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    files.sort(key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise ModbenchError(
            f"directory {path} contains no {'/'.join(LOCAL_SUFFIXES)} files; "
            "point --source at a directory with text files"
        )
    return files


def iter_local_documents(path: Path, *, text_field: str = "text") -> Iterator[str]:
    """Documents from a local file or (recursively, sorted) a directory of files."""
    for file in local_source_files(path):
        yield from _read_file(file, text_field)


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


def iter_hf_documents(
    path: str,
    *,
    name: str | None = None,
    split: str = "train",
    data_files: str | list[str] | None = None,
    text_field: str = "text",
    streaming: bool = True,
) -> Iterator[str]:
    """Documents of a Hugging Face dataset, read with ``datasets.load_dataset``.

    ``path``/``name`` are ``load_dataset``'s dataset path and config name (``path`` may be a
    Hub id, a packaged builder such as ``"json"`` with ``data_files``, or a local directory).
    Rows whose ``text_field`` is ``None`` are skipped.
    """
    try:
        import datasets
    except ImportError as exc:
        raise ModbenchError(
            "hf: sources need the `datasets` package; install it with pip install 'modbench[hf]'"
        ) from exc
    try:
        ds = datasets.load_dataset(
            path, name, split=split, data_files=data_files, streaming=streaming
        )
    except ModbenchError:
        raise
    except Exception as exc:
        raise ModbenchError(
            f"could not load Hugging Face dataset {path!r}"
            + (f" (config {name!r})" if name else "")
            + f", split {split!r}: {_first_line(exc)}; check the name, --split, --data-files "
            "and network access"
        ) from exc
    where = f"Hugging Face dataset {path!r} split {split!r}"
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_field not in columns:
        raise _missing_field(text_field, columns, where)
    for row in ds:
        if text_field not in row:
            raise _missing_field(text_field, row.keys(), where)
        value = row[text_field]
        if value is None:
            continue
        if not isinstance(value, str):
            raise ModbenchError(
                f"{where}: field {text_field!r} is a {type(value).__name__}, not a string; "
                "pick a text field with --text-field"
            )
        yield value


def describe_source(source: Source) -> str:
    """A short string naming the source, for metadata."""
    if isinstance(source, Path):
        return str(source)
    if isinstance(source, str):
        return source
    return "<in-memory documents>"


def iter_documents(
    source: Source,
    *,
    text_field: str = "text",
    split: str = "train",
    data_files: str | list[str] | None = None,
) -> Iterator[str]:
    """Documents of any supported source (see :func:`modbench.data.prepare_dataset`)."""
    if isinstance(source, str) and source.startswith("hf:"):
        name, config = parse_hf_source(source)
        yield from iter_hf_documents(
            name, name=config, split=split, data_files=data_files, text_field=text_field
        )
        return
    if data_files is not None:
        raise ModbenchError(
            "--data-files only applies to hf: sources; use e.g. --source hf:json "
            "--data-files 'dir/*.jsonl', or pass the directory as --source"
        )
    if isinstance(source, str | Path):
        yield from iter_local_documents(Path(source).expanduser(), text_field=text_field)
        return
    for i, doc in enumerate(source):
        if not isinstance(doc, str):
            raise ModbenchError(
                f"document {i} of the given iterable is a {type(doc).__name__}, not a str; "
                "pass an iterable of strings"
            )
        yield doc
