"""The source papers' corpora (:data:`CORPORA`), each a named recipe for ``modbench data
prepare --recipe NAME``, and training a tokenizer on a source. (Training recipes, the
optimizer and schedule of a run, are :data:`modbench.config.RECIPES`.)

A corpus recipe is a set of defaults for ``modbench data prepare`` (and ``train-tokenizer``);
anything given explicitly wins. The source-specific defaults (text field, split, data files,
source tokenizer) apply only while the recipe's own source is read: with ``--source`` of your
own, they fall back to the plain defaults.

* ``c4-llama`` (docs/sources.md#comt: LLaMA 60M-1B on C4 ``en`` as in the Mix-LN / LayerNorm-Scaling
  scripts): ``allenai/c4`` config ``en``, the LLaMA tokenizer (32,000 tokens), rows of 256
  tokens, enough rows for ``llama-1b``'s 90,000 steps of 512 rows.
* ``climbmix`` (arXiv 2605.20798 Appendix A): nvidia's ClimbMix (stored as GPT-2 token ids, decoded
  back to text), a 65,536-entry BPE of your own (``modbench data train-tokenizer --recipe
  climbmix``), rows of 1,024 tokens, the source's files read in a seeded shuffle, a token
  budget: 23.28B for the 1.2B study, 60.04B for the 3B study, the first a prefix of the second.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from modbench import __version__
from modbench.data._fs import make_tmp_dir_next_to, remove_tree
from modbench.data.corpus import is_validation_document
from modbench.data.prepare import (
    TOKENIZER_FILE,
    PrepareSettings,
    _check_out_dir,
    _resolve_tokenizer,
    _shuffled,
    parse_token_count,
    prepare_dataset,
)
from modbench.data.sources import open_source
from modbench.data.tokenizer import (
    tokenizer_json,
    tokenizer_sha256,
    tokenizer_vocab_size,
    train_bpe,
)
from modbench.errors import ModbenchError, suggest

TRAINING_FILE = "training.json"
"""Written next to a trained tokenizer: what it was trained on."""


@dataclass(frozen=True)
class CorpusRecipe:
    name: str
    summary: str
    source: str
    text_field: str = "text"
    split: str = "train"
    data_files: str | None = None
    source_tokenizer: str | None = None
    tokenizer: str | None = None
    tokenizer_hint: str = ""
    vocab_size: int | None = None
    model_vocab_size: int | None = None
    seq_len: int = 1024
    val_fraction: float = 0.001
    max_tokens: int | None = None
    shuffle_seed: int | None = None
    tokenizer_max_chars: int = 2_000_000_000


CORPORA: dict[str, CorpusRecipe] = {
    r.name: r
    for r in [
        CorpusRecipe(
            name="c4-llama",
            summary="CoMT preprint: C4 `en` (allenai/c4) with the LLaMA tokenizer (32,000 tokens), "
            "rows of 256 tokens, 11.8B training tokens (llama-1b's 90,000 steps of 512 x 256)",
            source="hf:allenai/c4:en",
            tokenizer="hf:meta-llama/Llama-2-7b-hf",
            tokenizer_hint=(
                "the LLaMA tokenizer: hf:meta-llama/Llama-2-7b-hf (gated: accept its license and "
                "`huggingface-cli login`) or --tokenizer PATH to a local LLaMA tokenizer.json "
                "or tokenizer folder"
            ),
            vocab_size=32000,
            seq_len=256,
            val_fraction=0.001,
            max_tokens=90_000 * 512 * 256,
        ),
        CorpusRecipe(
            name="climbmix",
            summary="arXiv 2605.20798 App. A: nvidia's ClimbMix (GPT-2 ids decoded to text), your "
            "65,536-token BPE (train-tokenizer), rows of 1,024 tokens, files in a seeded "
            "shuffle; --max-tokens 23.28B (1.2B study, the default) or 60.04B (3B study)",
            source="hf:nvidia/Nemotron-ClimbMix",
            text_field="tokens",
            source_tokenizer="hf:openai-community/gpt2",
            tokenizer_hint=(
                "a 65,536-token BPE: train one with `modbench data train-tokenizer --recipe "
                "climbmix --out data/climbmix-tokenizer`, then pass --tokenizer "
                "data/climbmix-tokenizer"
            ),
            vocab_size=65536,
            model_vocab_size=65664,  # arXiv 2605.20798 §3.2 and the climb-* presets
            seq_len=1024,
            val_fraction=0.0005,
            max_tokens=23_280_000_000,
            shuffle_seed=0,
        ),
    ]
}

_SOURCE_KEYS = ("text_field", "split", "data_files", "source_tokenizer")
_GENERIC = {"text_field": "text", "split": "train", "seq_len": 256, "val_fraction": 0.02,
            "tokenizer": "builtin"}


def get_recipe(name: str) -> CorpusRecipe:
    if name not in CORPORA:
        raise ModbenchError(
            f"unknown recipe {name!r}{suggest(name, CORPORA)}; known: {', '.join(CORPORA)} "
            "(see `modbench data recipes`)"
        )
    return CORPORA[name]


def recipe_options(recipe: str | None, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (None: not given) completed with ``recipe``'s defaults, then the plain ones;
    the keys of :func:`~modbench.data.prepare_dataset` plus ``tokenizer_max_chars``.
    ``max_tokens`` may be a string such as ``"23.28B"``, or ``"all"`` for no budget."""
    opts = {k: v for k, v in given.items() if v is not None}
    if "max_tokens" in opts:  # "all": no budget, whatever the recipe's
        all_ = str(opts["max_tokens"]).strip().lower() in ("all", "none")
        opts["max_tokens"] = _NO_BUDGET if all_ else parse_token_count(opts["max_tokens"])
    opts = _with_defaults(recipe, opts)
    if opts.get("max_tokens") is _NO_BUDGET:
        opts["max_tokens"] = None
    return opts


_NO_BUDGET: Any = object()


def _with_defaults(recipe: str | None, opts: dict[str, Any]) -> dict[str, Any]:
    if recipe is None:
        if "source" not in opts:
            raise ModbenchError("--source is required (or a --recipe that names one); e.g. "
                                "--source ./texts, or --recipe c4-llama")
        for key, value in _GENERIC.items():
            opts.setdefault(key, value)
        return opts
    r = get_recipe(recipe)
    own_source = opts.setdefault("source", r.source) == r.source
    defaults = asdict(r)
    for key in ("seq_len", "val_fraction", "max_tokens", "shuffle_seed", "tokenizer",
                "tokenizer_max_chars", *(_SOURCE_KEYS if own_source else ())):
        if defaults[key] is not None:
            opts.setdefault(key, defaults[key])
    for key, value in _GENERIC.items():
        if key != "tokenizer":
            opts.setdefault(key, value)
    if r.vocab_size is not None:
        opts.setdefault("vocab_size", r.vocab_size)  # a check on --tokenizer, or its size
    if opts.get("vocab_size") == r.vocab_size and r.model_vocab_size is not None:
        opts.setdefault("model_vocab_size", r.model_vocab_size)
    opts["recipe"] = r.name
    opts["_hint"] = r.tokenizer_hint
    return opts


def prepare_recipe(recipe: str | None, out_dir: str | Path, **given: Any) -> dict[str, Any]:
    """``prepare_dataset`` with ``recipe``'s defaults for whatever is not given (None)."""
    opts = recipe_options(recipe, given)
    hint = opts.pop("_hint", "")
    opts.pop("tokenizer_max_chars", None)
    if opts.get("tokenizer") is None:
        raise ModbenchError(f"the {recipe} recipe needs --tokenizer: {hint}")
    source, tokenizer = opts.pop("source"), opts.pop("tokenizer")
    return prepare_dataset(source, tokenizer, out_dir, PrepareSettings(**opts))


# ---------------------------------------------------------------------------- tokenizer training


def _training_documents(src: Any, order: list[int], decoder: Any, val_fraction: float,
                        max_chars: int, record: dict[str, Any], progress: bool) -> Iterator[str]:
    names = src.file_names()
    bar = tqdm(total=max_chars, desc="reading", unit="char", unit_scale=True,
               disable=not progress, dynamic_ncols=True)
    try:
        for doc, k, _ in src.iter_positioned(order):
            text = doc if isinstance(doc, str) else decoder.decode(doc, skip_special_tokens=True)
            if not text.strip() or is_validation_document(text, val_fraction):
                continue
            if names[order[k]] not in record["files"]:
                record["files"].append(names[order[k]])
            record["documents"] += 1
            record["chars"] += len(text)
            bar.update(len(text))
            yield text
            if record["chars"] >= max_chars:
                return
    finally:
        bar.close()


def train_tokenizer(
    source: str | Path,
    out_dir: str | Path,
    *,
    vocab_size: int,
    text_field: str = "text",
    split: str = "train",
    data_files: str | list[str] | None = None,
    revision: str | None = None,
    source_tokenizer: str | Path | None = None,
    shuffle_seed: int | None = None,
    val_fraction: float = 0.0,
    max_chars: int = 2_000_000_000,
    progress: bool = True,
    recipe: str | None = None,
) -> dict[str, Any]:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens (:func:`train_bpe`) on the
    first ``max_chars`` characters of ``source``'s training documents (files in the order
    ``prepare`` reads them, validation documents by the same hash rule left out), and write
    ``out_dir/tokenizer.json`` and ``out_dir/training.json`` (what it was trained on).
    Returns the training record."""
    out = Path(out_dir).expanduser()
    _check_out_dir(out)
    max_chars = parse_token_count(max_chars)
    decoder = None if source_tokenizer is None else _resolve_tokenizer(source_tokenizer, None)[0]
    src = open_source(source, text_field=text_field, split=split, data_files=data_files,
                      revision=revision, ids_ok=decoder is not None)
    order = _shuffled(len(src.file_names()), shuffle_seed)
    record: dict[str, Any] = {"files": [], "documents": 0, "chars": 0}
    docs = _training_documents(src, order, decoder, val_fraction, max_chars, record, progress)
    tokenizer = train_bpe(docs, vocab_size)
    if record["documents"] == 0:
        raise ModbenchError(f"source {str(source)!r} yielded no training documents; check the "
                            "path, --text-field and --split")
    got = tokenizer_vocab_size(tokenizer)
    if got != vocab_size:
        raise ModbenchError(
            f"the {record['chars']:,} characters read only support {got} tokens, not "
            f"{vocab_size}; read more text (--max-chars) or ask for --vocab-size {got}"
        )
    info = {
        "created_by": f"modbench {__version__}",
        "trained_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "recipe": recipe,
        "source": str(source),
        "revision": src.revision,
        "text_field": text_field,
        "source_tokenizer": None if source_tokenizer is None else str(source_tokenizer),
        "shuffle_seed": shuffle_seed,
        "val_fraction": float(val_fraction),
        "max_chars": max_chars,
        "documents": record["documents"],
        "chars": record["chars"],
        "files": record["files"],
        "vocab_size": got,
        "sha256": tokenizer_sha256(tokenizer),
        "file": TOKENIZER_FILE,
    }
    tmp = make_tmp_dir_next_to(out)
    try:
        (tmp / TOKENIZER_FILE).write_bytes(tokenizer_json(tokenizer))
        (tmp / TRAINING_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _check_out_dir(out)
        os.replace(tmp, out)
    except BaseException:
        remove_tree(tmp)
        raise
    return info


def train_recipe_tokenizer(recipe: str | None, out_dir: str | Path,
                           **given: Any) -> dict[str, Any]:
    """:func:`train_tokenizer` with ``recipe``'s source and vocabulary defaults."""
    opts = recipe_options(recipe, given)
    if opts.get("vocab_size") is None:
        raise ModbenchError("--vocab-size is required (or a --recipe that names one); e.g. "
                            "--vocab-size 65536")
    return train_tokenizer(
        opts["source"], out_dir, vocab_size=opts["vocab_size"], text_field=opts["text_field"],
        split=opts["split"], data_files=opts.get("data_files"), revision=opts.get("revision"),
        source_tokenizer=opts.get("source_tokenizer"), shuffle_seed=opts.get("shuffle_seed"),
        val_fraction=opts["val_fraction"],
        max_chars=opts.get("max_chars", opts.get("tokenizer_max_chars", 2_000_000_000)),
        progress=opts.get("progress", True), recipe=opts.get("recipe"),
    )
