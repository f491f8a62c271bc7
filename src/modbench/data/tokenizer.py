"""Byte-level BPE tokenizers: training, the cached built-in tokenizer, and loading by spec."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from modbench.data._fs import cache_dir, sha256_bytes
from modbench.data.corpus import builtin_corpus_fingerprint, builtin_split
from modbench.errors import ModbenchError, suggest
from modbench.fsutil import atomic_write_bytes

EOS_TOKEN = "<|endoftext|>"
"""The document separator / end-of-sequence token of modbench's own tokenizers (id 0)."""

MIN_VOCAB_SIZE = 300
"""Smallest vocabulary accepted: 256 byte symbols + the EOS token + some merges."""

_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


def _check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ModbenchError(f"vocab size must be an integer, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ModbenchError(
            f"vocab size {vocab_size} is too small; use at least {MIN_VOCAB_SIZE} "
            "(256 byte symbols + <|endoftext|> + merges), e.g. --vocab-size 4096"
        )


def train_bpe(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``docs``.

    ByteLevel pre-tokenizer (GPT-2 regex, no prefix space) and decoder, an initial alphabet
    of all 256 byte symbols (so any text round-trips), and the special token
    ``<|endoftext|>`` with id 0. The result has at most ``vocab_size`` tokens (fewer when the
    corpus runs out of pairs to merge).
    """
    _check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != 0:  # pragma: no cover - guaranteed by the trainer
        raise ModbenchError("internal error: <|endoftext|> did not get id 0 during BPE training")
    return tokenizer


def tokenizer_json(tokenizer: Tokenizer) -> bytes:
    """The canonical serialized form of ``tokenizer`` (what is written as tokenizer.json)."""
    return tokenizer.to_str(pretty=False).encode("utf-8")


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """Hex sha256 of :func:`tokenizer_json`."""
    return sha256_bytes(tokenizer_json(tokenizer))


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """Number of ids the tokenizer can emit (max id + 1, added tokens included)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    max_id = max(vocab.values()) if vocab else -1
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max_id + 1)


def find_eos_id(tokenizer: Tokenizer) -> int:
    """Return the id of the tokenizer's end-of-text token (``<|endoftext|>``, ``</s>``, ...)."""
    for token in _EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    raise ModbenchError(
        "the tokenizer has no end-of-text token (looked for "
        + ", ".join(_EOS_CANDIDATES)
        + "); use a tokenizer that has one, e.g. --tokenizer builtin"
    )


def builtin_tokenizer_path(vocab_size: int) -> Path:
    """Where :func:`builtin_tokenizer` caches the tokenizer for ``vocab_size``."""
    name = f"builtin-bpe-v{vocab_size}-{builtin_corpus_fingerprint()[:10]}.json"
    return cache_dir() / "tokenizers" / name


def builtin_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus' TRAIN split, cached in the cache dir."""
    _check_vocab_size(vocab_size)
    path = builtin_tokenizer_path(vocab_size)
    if path.is_file():
        with contextlib.suppress(Exception):  # unreadable cache entry: retrain and overwrite
            return Tokenizer.from_file(str(path))
    train_docs, _ = builtin_split()
    tokenizer = train_bpe(train_docs, vocab_size)
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ModbenchError(
            f"the built-in corpus only supports a vocabulary of {got} tokens, not {vocab_size}; "
            f"use --vocab-size {got} or smaller"
        )
    atomic_write_bytes(path, tokenizer_json(tokenizer))
    return tokenizer


def _first_line(exc: Exception) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _load_tokenizer_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModbenchError(
            f"{path} is not a valid Hugging Face tokenizer.json ({_first_line(exc)}); "
            "point --tokenizer at a tokenizer.json saved by `tokenizers`"
        ) from exc


def load_tokenizer(spec: str, vocab_size: int | None = None) -> Tokenizer:
    """Load a tokenizer from a spec.

    ``"builtin"`` (needs ``vocab_size``), a path to a ``tokenizer.json`` file or to a
    directory containing one (or a Hugging Face tokenizer folder without it, converted by
    transformers), or ``"hf:NAME"`` (``Tokenizer.from_pretrained(NAME)``, else transformers'
    ``AutoTokenizer``; needs network or a warm Hugging Face cache). For a file/hf tokenizer,
    ``vocab_size`` (if given) must match the tokenizer's size.
    """
    spec = str(spec).strip()
    if spec == "builtin":
        if vocab_size is None:
            raise ModbenchError(
                "the builtin tokenizer needs a vocabulary size; pass --vocab-size, e.g. 4096"
            )
        return builtin_tokenizer(vocab_size)
    if spec.startswith("hf:"):
        name = spec[3:].strip()
        if not name:
            raise ModbenchError("empty tokenizer name in 'hf:'; use e.g. --tokenizer hf:gpt2")
        try:
            tokenizer = Tokenizer.from_pretrained(name)
        except Exception as exc:
            tokenizer, why = _from_transformers(name)  # a repo with tokenizer.model only, say
            if tokenizer is None and why == CUSTOM_CODE:
                raise _custom_code(f"tokenizer repo hf:{name}", "its tokenizer_config.json") \
                    from exc
            if tokenizer is None:
                raise ModbenchError(
                    f"could not load tokenizer {name!r} from the Hugging Face Hub "
                    f"({_first_line(exc)}); "
                    "check the name, your network and access (gated models need "
                    "`huggingface-cli login`), or pass a local tokenizer.json"
                ) from exc
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                # a Hugging Face tokenizer folder without tokenizer.json (a sentencepiece
                # tokenizer.model, say): transformers converts it to a fast tokenizer
                code = _auto_map(path)  # asks transformers to run the folder's own code
                if code is not None:
                    raise _custom_code(f"tokenizer folder {spec}", code)
                converted, why = (_from_transformers(str(path)) if _is_hf_folder(path)
                                  else (None, None))
                if converted is None and why == CUSTOM_CODE:
                    raise _custom_code(f"tokenizer folder {spec}", "its tokenizer_config.json")
                if converted is None and why is not None:
                    raise ModbenchError(
                        f"directory {spec} has no tokenizer.json and transformers cannot "
                        f"convert the Hugging Face tokenizer in it ({why}); point --tokenizer "
                        "at a tokenizer.json, a directory containing one, 'builtin' or "
                        "'hf:NAME'")
                if converted is None:
                    raise ModbenchError(
                        f"directory {spec} has no tokenizer.json; point --tokenizer at a "
                        "tokenizer.json, a directory containing one (or a Hugging Face "
                        "tokenizer folder, with transformers installed), 'builtin' or 'hf:NAME'"
                    )
                return _checked_size(converted, spec, vocab_size)
            path = path / "tokenizer.json"
        elif not path.is_file():
            looks_like_path = "/" in spec or "\\" in spec or spec.endswith(".json")
            hint = "" if looks_like_path else suggest(spec, ["builtin", "hf:"])
            raise ModbenchError(
                f"unknown tokenizer {spec!r}{hint}: no such file or directory; use "
                "'builtin', a path to tokenizer.json (or its directory), or 'hf:NAME'"
            )
        tokenizer = _load_tokenizer_file(path)
    return _checked_size(tokenizer, spec, vocab_size)


def _checked_size(tokenizer: Tokenizer, spec: str, vocab_size: int | None) -> Tokenizer:
    if vocab_size is not None:
        actual = tokenizer_vocab_size(tokenizer)
        if actual != vocab_size:
            raise ModbenchError(
                f"tokenizer {spec!r} has {actual} tokens but a vocab size of {vocab_size} was "
                f"requested; drop --vocab-size or pass --vocab-size {actual}"
            )
    return tokenizer


def _is_hf_folder(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer_config.json", "tokenizer.model"))


#: :func:`_from_transformers`'s reason where the tokenizer needs its own code to load
CUSTOM_CODE = "custom code"


def _auto_map(path: Path) -> str | None:
    """Where a Hugging Face folder asks transformers to run its own Python (``auto_map`` in
    its ``tokenizer_config.json`` or ``config.json``), in words; None where it does not."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            tree = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(tree, dict) and tree.get("auto_map"):
            return f"auto_map in its {name}"
    return None


def _custom_code(what: str, where: str) -> ModbenchError:
    return ModbenchError(
        f"{what} asks to run its own Python code to load ({where}), which modbench never "
        "runs; give a tokenizer.json instead (where you trust that code, save one with "
        "the tokenizer's save_pretrained), 'builtin', or another tokenizer")


def _from_transformers(name_or_path: str) -> tuple[Tokenizer | None, str | None]:
    """The fast (``tokenizers``) form of a Hugging Face tokenizer, converted by transformers,
    or None and why not: None where transformers is missing, :data:`CUSTOM_CODE` where the
    tokenizer needs its own code, else the first line of transformers' error."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None, None
    try:
        # never the folder's or repo's own code: with auto_map, transformers would ask
        # interactively whether to run it; False refuses it (docs/reliability.md)
        backend = AutoTokenizer.from_pretrained(name_or_path, use_fast=True,
                                                trust_remote_code=False).backend_tokenizer
    except Exception as e:
        text = str(e)
        if "trust_remote_code" in text or "custom code" in text:
            return None, CUSTOM_CODE
        return None, _first_line(e)
    if isinstance(backend, Tokenizer):
        return backend, None
    return None, f"it converted to a {type(backend).__name__}, not a fast tokenizer"


def tokenizer_info(tokenizer: Tokenizer) -> dict[str, object]:
    """Small JSON-able summary: vocab size, sha256 and EOS id."""
    return {
        "vocab_size": tokenizer_vocab_size(tokenizer),
        "sha256": tokenizer_sha256(tokenizer),
        "eos_id": find_eos_id(tokenizer),
    }
