"""``modbench data ...``: prepare, inspect and verify token datasets.

The main CLI mounts :data:`data_app` as ``modbench data`` and turns a
:class:`~modbench.errors.ModbenchError` into a one-line error with exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from modbench.data.dataset import open_dataset
from modbench.data.prepare import DEFAULT_SHARD_SEQUENCES, prepare_dataset

data_app = typer.Typer(
    help=(
        "Prepare, inspect and verify tokenized datasets.\n\n"
        "Example: modbench data prepare --source ./texts --tokenizer builtin "
        "--vocab-size 4096 --out data/mytexts"
    ),
    no_args_is_help=True,
    add_completion=False,
)


@data_app.command("prepare")
def prepare_cmd(
    source: Annotated[
        str,
        typer.Option(
            "--source",
            help="A .txt/.jsonl/.json/.parquet file, a directory of them, or hf:NAME[:CONFIG].",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="New (or empty) output directory.")],
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer", help="'builtin', a tokenizer.json (or its directory), or hf:NAME."
        ),
    ] = "builtin",
    vocab_size: Annotated[
        int | None,
        typer.Option("--vocab-size", help="Vocabulary size (required for --tokenizer builtin)."),
    ] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per packed row.")] = 256,
    val_fraction: Annotated[
        float, typer.Option("--val-fraction", help="Share of documents held out for validation.")
    ] = 0.02,
    text_field: Annotated[
        str, typer.Option("--text-field", help="JSON field / parquet column holding the text.")
    ] = "text",
    split: Annotated[
        str, typer.Option("--split", help="Split to read from an hf: source.")
    ] = "train",
    data_files: Annotated[
        str | None,
        typer.Option("--data-files", help="data_files glob for an hf: source (e.g. hf:json)."),
    ] = None,
    shard_sequences: Annotated[
        int, typer.Option("--shard-sequences", help="Rows per shard file.")
    ] = DEFAULT_SHARD_SEQUENCES,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")
    ] = True,
) -> None:
    """Tokenize a text source, pack it into rows of --seq-len tokens, write checksummed shards.

    Example: modbench data prepare --source ./texts --tokenizer builtin --vocab-size 4096 --out data/mytexts
    """  # noqa: E501
    meta = prepare_dataset(
        source,
        tokenizer,
        out,
        seq_len=seq_len,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        shard_sequences=shard_sequences,
        text_field=text_field,
        split=split,
        data_files=data_files,
        progress=progress,
    )
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    typer.echo(
        f"wrote {out}: {train['sequences']} train + {val['sequences']} val sequences of "
        f"{seq_len} tokens ({meta['documents']['train']} + {meta['documents']['val']} documents, "
        f"{meta['tokens_discarded']} tokens discarded by packing)"
    )
    for name, info in (("train", train), ("val", val)):
        if info["sequences"] == 0:
            typer.echo(
                f"warning: the {name} split has no full row of {seq_len} tokens and cannot be "
                "used; add data, lower --seq-len"
                + (" or raise --val-fraction" if name == "val" else ""),
                err=True,
            )


@data_app.command("info")
def info_cmd(
    path: Annotated[Path, typer.Argument(help="A prepared dataset directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print metadata.json as JSON.")] = False,
) -> None:
    """Show a prepared dataset's metadata (sizes, tokenizer, shards).

    Example: modbench data info data/mytexts --json
    """
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
    ds = open_dataset(path, verify=False)
    checked = ds.verify()
    typer.echo(f"ok: {len(checked)} files in {path} match their sha256 checksums")
