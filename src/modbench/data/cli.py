"""``modbench data ...``: prepare, inspect and verify token datasets.

The main CLI mounts :data:`data_app` as ``modbench data`` and turns a
:class:`~modbench.errors.ModbenchError` into a one-line error with exit code 2.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

# Only typer and the standard library at module level: `modbench --help` and argument errors
# answer without importing numpy, tokenizers or torch; each command imports what it runs.

# modbench.data.prepare.DEFAULT_SHARD_SEQUENCES, shown in --help without importing it (a test
# holds the two equal)
SHARD_SEQUENCES_DEFAULT = 32768

data_app = typer.Typer(
    help=(
        "Prepare, inspect and verify tokenized datasets; train tokenizers.\n\n"
        "Example: modbench data prepare --source ./texts --tokenizer builtin "
        "--vocab-size 4096 --out data/mytexts"
    ),
    no_args_is_help=True,
    add_completion=False,
)


# The options of `data prepare`.
_OutOpt = Annotated[Path, typer.Option("--out", help="New (or empty) output directory.")]
_SourceOpt = Annotated[
    str | None,
    typer.Option(
        "--source",
        help="A .txt, .jsonl, .json(.gz) or .parquet file, a directory of them, or "
        "hf:NAME[:CONFIG] (default: the recipe's).",
    ),
]
_RecipeOpt = Annotated[
    str | None,
    typer.Option("--recipe", help="Defaults of a source paper's corpus: c4-llama, climbmix "
                 "(see `modbench data recipes`); explicit options win."),
]
_TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer", help="'builtin', a tokenizer.json (or its directory), or hf:NAME "
        "(default: builtin, or the recipe's)."
    ),
]
_VocabSizeOpt = Annotated[
    int | None,
    typer.Option("--vocab-size", help="Vocabulary size (required for --tokenizer builtin; "
                 "otherwise a check)."),
]
_SeqLenOpt = Annotated[
    int | None, typer.Option("--seq-len", help="Tokens per packed row (default 256).")
]
_ValFractionOpt = Annotated[
    float | None,
    typer.Option("--val-fraction", help="Share of documents held out for validation "
                 "(default 0.02)."),
]
_TextFieldOpt = Annotated[
    str | None,
    typer.Option("--text-field", help="JSON field / parquet column holding the text "
                 "(default text)."),
]
_SplitOpt = Annotated[
    str | None, typer.Option("--split", help="Split to read from an hf: source (train).")
]
_DataFilesOpt = Annotated[
    str | None,
    typer.Option("--data-files", help="data_files glob for an hf: source (e.g. hf:json)."),
]
_RevisionOpt = Annotated[
    str | None, typer.Option("--revision", help="Branch, tag or commit of an hf: source.")
]
_SourceTokenizerOpt = Annotated[
    str | None,
    typer.Option("--source-tokenizer", help="Decodes a source that stores token ids "
                 "(nvidia's ClimbMix: GPT-2)."),
]
_MaxTokensOpt = Annotated[
    str | None,
    typer.Option("--max-tokens", help="Training-token budget, e.g. 23.28B: a smaller budget "
                 "gives exactly the first rows of a larger one."),
]
_SeedOpt = Annotated[
    int | None,
    typer.Option("--seed", help="Read the source's files in a shuffle drawn from this seed."),
]
_ModelVocabSizeOpt = Annotated[
    int | None,
    typer.Option("--model-vocab-size", help="Embedding size of the models this data is for, "
                 "when padded beyond the tokenizer (recorded; training accepts it)."),
]
_WorkersOpt = Annotated[
    int, typer.Option("--workers", help="Tokenizer processes (the output is the same).")
]
_ShardSequencesOpt = Annotated[
    int, typer.Option("--shard-sequences", help="Rows per shard file.")
]
_ProgressOpt = Annotated[
    bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")
]


def _echo_prepared(out: Path, meta: dict[str, Any]) -> None:
    """Say what `data prepare` wrote (stdout), and warn (stderr) of a budget the source did not
    fill and of a split too small to use."""
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    rows = meta["seq_len"]
    typer.echo(
        f"wrote {out}: {train['sequences']} train + {val['sequences']} val sequences of "
        f"{rows} tokens ({meta['documents']['train']} + {meta['documents']['val']} documents, "
        f"{meta['tokens_discarded']} tokens discarded)"
    )
    if meta.get("budget_reached") is False:
        typer.echo(
            f"warning: the source ended before --max-tokens {meta['max_tokens']}: the train split "
            f"holds {train['tokens']} tokens",
            err=True,
        )
    for name, info in (("train", train), ("val", val)):
        if info["sequences"] == 0:
            typer.echo(
                f"warning: the {name} split has no full row of {rows} tokens and cannot be "
                "used; add data, lower --seq-len"
                + (" or raise --val-fraction" if name == "val" else ""),
                err=True,
            )


@data_app.command("prepare")
def prepare_cmd(
    out: _OutOpt,
    source: _SourceOpt = None,
    recipe: _RecipeOpt = None,
    tokenizer: _TokenizerOpt = None,
    vocab_size: _VocabSizeOpt = None,
    seq_len: _SeqLenOpt = None,
    val_fraction: _ValFractionOpt = None,
    text_field: _TextFieldOpt = None,
    split: _SplitOpt = None,
    data_files: _DataFilesOpt = None,
    revision: _RevisionOpt = None,
    source_tokenizer: _SourceTokenizerOpt = None,
    max_tokens: _MaxTokensOpt = None,
    seed: _SeedOpt = None,
    model_vocab_size: _ModelVocabSizeOpt = None,
    workers: _WorkersOpt = 1,
    shard_sequences: _ShardSequencesOpt = SHARD_SEQUENCES_DEFAULT,
    progress: _ProgressOpt = True,
) -> None:
    """Tokenize a text source, pack it into rows of --seq-len tokens, write checksummed shards.

    Resumable: run a killed prepare again with the same options and it continues.

    Example: modbench data prepare --source ./texts --tokenizer builtin --vocab-size 4096 --out data/mytexts

    Example: modbench data prepare --recipe c4-llama --workers 8 --out data/c4-llama

    Example: modbench data prepare --recipe climbmix --tokenizer data/climbmix-tokenizer --max-tokens 23.28B --workers 8 --out data/climbmix-1.2b
    """  # noqa: E501
    from modbench.data.corpora import prepare_recipe

    meta = prepare_recipe(
        recipe, out, source=source, tokenizer=tokenizer, vocab_size=vocab_size,
        seq_len=seq_len, val_fraction=val_fraction, text_field=text_field, split=split,
        data_files=data_files, revision=revision, source_tokenizer=source_tokenizer,
        max_tokens=max_tokens, shuffle_seed=seed, model_vocab_size=model_vocab_size,
        workers=workers, shard_sequences=shard_sequences, progress=progress,
    )
    _echo_prepared(out, meta)


@data_app.command("train-tokenizer")
def train_tokenizer_cmd(
    out: Annotated[Path, typer.Option("--out", help="New (or empty) folder for tokenizer.json.")],
    source: Annotated[
        str | None, typer.Option("--source", help="As for prepare (default: the recipe's).")
    ] = None,
    recipe: Annotated[
        str | None, typer.Option("--recipe", help="Source and vocabulary of a recipe.")
    ] = None,
    vocab_size: Annotated[
        int | None, typer.Option("--vocab-size", help="Tokens, EOS included (climbmix: 65536).")
    ] = None,
    max_chars: Annotated[
        str | None,
        typer.Option("--max-chars", help="Characters of training text to read (default 2B).")
    ] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option("--val-fraction", help="Leave out the documents prepare holds out.")
    ] = None,
    text_field: Annotated[str | None, typer.Option("--text-field", help="As for prepare.")] = None,
    split: Annotated[str | None, typer.Option("--split", help="As for prepare.")] = None,
    data_files: Annotated[str | None, typer.Option("--data-files", help="As for prepare.")] = None,
    revision: Annotated[str | None, typer.Option("--revision", help="As for prepare.")] = None,
    source_tokenizer: Annotated[
        str | None, typer.Option("--source-tokenizer", help="As for prepare.")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="As for prepare.")] = None,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")
    ] = True,
) -> None:
    """Train a byte-level BPE of exactly --vocab-size tokens on a source's training text.

    Example: modbench data train-tokenizer --recipe climbmix --out data/climbmix-tokenizer

    Example: modbench data train-tokenizer --source ./texts --vocab-size 8192 --max-chars 50M --out data/tok8k
    """  # noqa: E501
    from modbench.data.corpora import train_recipe_tokenizer
    from modbench.data.prepare import TOKENIZER_FILE

    info = train_recipe_tokenizer(
        recipe, out, source=source, vocab_size=vocab_size, max_chars=max_chars,
        val_fraction=val_fraction, text_field=text_field, split=split, data_files=data_files,
        revision=revision, source_tokenizer=source_tokenizer, shuffle_seed=seed,
        progress=progress,
    )
    typer.echo(
        f"wrote {out / TOKENIZER_FILE}: {info['vocab_size']} tokens, sha256 "
        f"{info['sha256'][:12]}, trained on {info['chars']:,} characters "
        f"({info['documents']} documents)"
    )


@data_app.command("recipes")
def recipes_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print every default as JSON.")] = False,
) -> None:
    """List the recipes of `prepare --recipe` and their defaults.

    Example: modbench data recipes --json
    """
    from modbench.data.corpora import CORPORA

    if as_json:
        typer.echo(json.dumps({n: asdict(r) for n, r in CORPORA.items()}, indent=2))
        return
    width = max((len(n) for n in CORPORA), default=0)
    for r in CORPORA.values():
        typer.echo(f"{r.name:<{width}}  {r.summary}")


@data_app.command("info")
def info_cmd(
    path: Annotated[Path, typer.Argument(help="A prepared dataset directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print metadata.json as JSON.")] = False,
) -> None:
    """Show a prepared dataset's metadata (sizes, tokenizer, shards).

    Example: modbench data info data/mytexts --json
    """
    from modbench.data.dataset import open_dataset

    ds = open_dataset(path, verify=False)
    if as_json:
        typer.echo(json.dumps(ds.meta, indent=2))
    else:
        typer.echo(ds.summary())


@data_app.command("verify")
def verify_cmd(
    path: Annotated[Path, typer.Argument(help="A prepared dataset directory.")],
) -> None:
    """Check every shard's size and sha256 checksum, and the tokenizer's.

    Example: modbench data verify data/mytexts
    """
    from modbench.data.dataset import open_dataset

    ds = open_dataset(path, verify=False)
    checked = ds.verify()
    typer.echo(f"ok: {len(checked)} files in {path} match their sha256 checksums")
