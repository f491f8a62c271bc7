"""The built-in corpus: English text that ships with Python itself, so nothing is downloaded.

Documents, in this order:

1. every topic of :data:`pydoc_data.topics.topics` (the help texts of ``help("if")`` etc.),
   sorted by topic name;
2. the docstrings (module, class, function and method; in source order) of the standard
   library's ``.py`` files, files sorted by their path relative to the stdlib root, skipping
   test suites, ``idlelib`` and ``site-packages``, cleaned with :func:`inspect.cleandoc`, and
   keeping only those of at least :data:`MIN_DOCSTRING_CHARS` characters.

Exact duplicates (e.g. ``_pyio`` vs ``io``) are kept only once, at their first position.
The corpus depends on the Python version (it is the text of *this* interpreter's stdlib);
:func:`builtin_corpus_fingerprint` identifies it and is used as the cache key. Building it
parses ~700 files (a few seconds), so the result is also cached on disk under
``cache_dir()/corpus``, keyed by the interpreter version and the stdlib files' sizes and
modification times, and checked against its own sha256 when loaded.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

MIN_DOCSTRING_CHARS = 200
"""Docstrings shorter than this are dropped (they are mostly one-line summaries)."""

BUILTIN_VAL_FRACTION = 0.05
"""Share of built-in documents held out for validation (chosen by a hash of the text)."""

_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)
_SPLIT_SALT = b"modbench-split-v1\x00"
_CORPUS_RULES = "modbench-builtin-corpus-v1"  # bump when the extraction rules change

_DocNode = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def is_validation_document(text: str, val_fraction: float) -> bool:
    """Return True when the document ``text`` belongs to the validation split.

    The decision is a pure function of the text: the first 8 bytes of
    ``sha256(b"modbench-split-v1\\0" + utf8(text))`` read as a big-endian integer ``h``,
    and the document is held out iff ``h / 2**64 < val_fraction``. Identical texts therefore
    always land in the same split, whatever the order or the source they come from.
    """
    if val_fraction <= 0.0:
        return False
    digest = hashlib.sha256(_SPLIT_SALT + text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda item: item[0])
    return [path for _, path in files]


def _docstrings_in_source_order(tree: ast.Module) -> Iterator[str]:
    def visit(node: ast.AST) -> Iterator[str]:
        if isinstance(node, _DocNode):
            raw = ast.get_docstring(node, clean=False)
            if raw:
                yield inspect.cleandoc(raw)
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(tree)


def _file_docstrings(path: Path) -> list[str]:
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return []
    return [d for d in _docstrings_in_source_order(tree) if len(d) >= MIN_DOCSTRING_CHARS]


def _dedupe(docs: Iterable[str]) -> tuple[str, ...]:
    seen: set[str] = set()
    out: list[str] = []
    for doc in docs:
        if doc and doc not in seen:
            seen.add(doc)
            out.append(doc)
    return tuple(out)


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


def _build_documents() -> tuple[str, ...]:
    topics = _topics()

    def generate() -> Iterator[str]:
        for key in sorted(topics):
            yield topics[key].strip()
        for path in _stdlib_files(_stdlib_root()):
            yield from _file_docstrings(path)

    return _dedupe(generate())


def _fingerprint(docs: Iterable[str]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def _source_signature() -> str:
    """Cheap identity of the corpus' inputs: interpreter, stdlib files' sizes and mtimes."""
    root = _stdlib_root()
    h = hashlib.sha256()
    h.update(f"{_CORPUS_RULES}|{sys.version}|{root}|{MIN_DOCSTRING_CHARS}\n".encode())
    topics_hash = hashlib.sha256()
    for key, text in sorted(_topics().items()):
        topics_hash.update(f"{key}\x00{text}\x00".encode())
    h.update(topics_hash.digest())
    for path in _stdlib_files(root):
        st = path.stat()
        h.update(f"{path.relative_to(root).as_posix()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _load_cached(path: Path) -> tuple[str, ...] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        docs = tuple(data["documents"])
        if all(isinstance(d, str) for d in docs) and _fingerprint(docs) == data["fingerprint"]:
            return docs
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _per_cache_dir(fn: Callable[[], tuple[str, ...]]) -> Callable[[], tuple[str, ...]]:
    """Memoize ``fn`` in-process per cache directory (``$MODBENCH_CACHE`` at the call), so a
    process that switches cache directories still finds (or writes) the corpus file in the
    one in use."""
    memo: dict[str, tuple[str, ...]] = {}

    @functools.wraps(fn)
    def wrapper() -> tuple[str, ...]:
        key = os.environ.get("MODBENCH_CACHE", "")
        if key not in memo:
            memo[key] = fn()
        return memo[key]

    return wrapper


@_per_cache_dir
def _builtin_documents_cached() -> tuple[str, ...]:
    """The corpus, memoized in-process and on disk (parsing the stdlib takes a few seconds)."""
    from modbench.data._fs import cache_dir
    from modbench.fsutil import atomic_write_bytes

    try:
        path = cache_dir() / "corpus" / f"builtin-corpus-{_source_signature()[:20]}.json"
    except OSError:  # pragma: no cover - unreadable stdlib file: just build
        return _build_documents()
    if path.is_file():
        cached = _load_cached(path)
        if cached is not None:
            return cached
    docs = _build_documents()
    payload = {"fingerprint": _fingerprint(docs), "documents": list(docs)}
    with contextlib.suppress(OSError):  # a read-only cache only costs speed
        atomic_write_bytes(path, json.dumps(payload, ensure_ascii=False).encode("utf-8"))
    return docs


def builtin_documents() -> list[str]:
    """Return the built-in corpus as a deterministic list of documents (see module docs)."""
    return list(_builtin_documents_cached())


@functools.lru_cache(maxsize=1)
def builtin_corpus_fingerprint() -> str:
    """Hex sha256 of the built-in documents, each UTF-8 encoded and followed by a NUL byte."""
    return _fingerprint(_builtin_documents_cached())


def split_documents(docs: Iterable[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split documents into (train, validation) with :func:`is_validation_document`."""
    train: list[str] = []
    val: list[str] = []
    for doc in docs:
        (val if is_validation_document(doc, val_fraction) else train).append(doc)
    return train, val


def builtin_split() -> tuple[list[str], list[str]]:
    """Return the built-in corpus split by document into (train, validation), ~5% held out."""
    return split_documents(_builtin_documents_cached(), BUILTIN_VAL_FRACTION)


def builtin_validation_documents() -> list[str]:
    """Return the held-out built-in documents (never used to train tokenizer or model)."""
    return builtin_split()[1]
