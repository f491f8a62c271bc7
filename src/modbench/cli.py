"""The ``modbench`` command line: a thin typer layer over the Python API."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from modbench.errors import ModbenchError

app = typer.Typer(
    name="modbench",
    help="modbench: does a Transformer modification really help, once everything else is "
    "held fixed?\n\nExample: modbench train --preset cpu-small --method post_ln+qknorm",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _mount_subcommands() -> None:
    from modbench.data.cli import data_app
    from modbench.eval.cli import eval_command, export_command
    from modbench.study.cli import study_app
    from modbench.train.cli import train_command

    app.command(name="train")(train_command)
    app.add_typer(data_app, name="data")
    app.add_typer(study_app, name="study")
    app.command(name="eval")(eval_command)
    app.command(name="export")(export_command)


_mount_subcommands()


@app.command()
def methods(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the registered methods (name, category, citation, summary, options).

    Example: modbench methods --json
    """
    from modbench.methods import load_all

    rows = [cls.info() for _, cls in sorted(load_all().items())]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        typer.echo(f"{r['name']:<16} {r['category']:<12} {r['summary']}")
        if r["leaks_across_positions"]:
            typer.echo(f"{'':<29} note: batch statistics mix positions in training mode "
                       "(future tokens leak into earlier outputs)")
        if opts:
            typer.echo(f"{'':<29} options: {opts}")


@app.command()
def presets(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the presets with their shapes and parameter counts (no weights are allocated).

    Example: modbench presets --json
    """
    import dataclasses

    from modbench.config import PRESETS
    from modbench.methods.build import count_params

    rows = []
    for p in PRESETS.values():
        rows.append({"name": p.name, "params": count_params(p.model), "recipe": p.recipe,
                     "model": dataclasses.asdict(p.model), "train": dict(p.train), "note": p.note})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        m = r["model"]
        typer.echo(f"{r['name']:<12} {r['params'] / 1e6:>9.2f}M  d={m['d_model']} "
                   f"L={m['n_layers']} H={m['n_heads']}/{m['n_kv_heads']} ff={m['d_ff']} "
                   f"V={m['vocab_size']} "
                   f"T={m['max_seq_len']}  recipe={r['recipe']}")


@app.command()
def recipes(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the training recipes (frozen across methods).

    Example: modbench recipes --json
    """
    import dataclasses

    from modbench.config import RECIPES

    rows = [dataclasses.asdict(r) for r in RECIPES.values()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        typer.echo(f"{r['name']:<10} {r['optimizer']} lr={r['lr']:g} betas={tuple(r['betas'])} "
                   f"wd={r['weight_decay']:g} clip={r['grad_clip']:g} {r['schedule']}")
        typer.echo(f"{'':<10} {r['note']}")


@app.command()
def flops(
    preset: Annotated[str | None, typer.Option(
        help="Model preset (`modbench presets`) [default: cpu-small].")] = None,
    method: Annotated[list[str] | None, typer.Option(
        help="Method string, repeatable [default: baseline and every registered method].")]
    = None,
    seq_len: Annotated[int | None, typer.Option(
        help="Tokens per sequence (default: the preset's training length).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Parameters and training FLOPs per token, counted analytically (seeds/002_* Appendix C:
    matrix multiplications, full T x T attention, training = 3 x forward).

    Example: modbench flops --preset climb-1.2b --method diff_attn --method relu2
    """
    from modbench.analysis import flop_report
    from modbench.config import resolve
    from modbench.methods import load_all

    names = list(method) if method else ["baseline", *sorted(load_all())]
    rows = []
    for name in names:
        cfg = resolve(preset, method=name)
        t = seq_len if seq_len is not None else cfg.train.seq_len
        rows.append(flop_report(cfg.model, t).as_dict())
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    typer.echo(f"{'method':<28} {'params':>14} {'fwd FLOPs/tok':>14} {'train FLOPs/tok':>16} "
               f"{'vs base':>8}")
    for r in rows:
        typer.echo(f"{r['method']:<28} {r['params']:>14,} {r['forward_flops_per_token']:>14.4g} "
                   f"{r['train_flops_per_token']:>16.4g} {r['flops_ratio']:>8.4f}")


@app.command()
def bench(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    methods: Annotated[str | None, typer.Option(
        help="Comma-separated method strings for the overhead table, or 'all' "
             "[default: one or two per category].")] = None,
    preset: Annotated[str, typer.Option(help="Preset of the method table.")] = "cpu-small",
    hf: Annotated[bool, typer.Option(
        help="Compare with Hugging Face LlamaForCausalLM (needs transformers).")] = True,
    hf_presets: Annotated[str, typer.Option(
        help="Comma-separated presets of the Hugging Face comparison.")] = "cpu-small,llama-60m",
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    dtype: Annotated[str, typer.Option(help="fp32 | bf16 (bf16 autocast)")] = "fp32",
    compile: Annotated[bool, typer.Option(help="torch.compile every model.")] = False,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 5,
    steps: Annotated[int, typer.Option(help="Timed steps per case per round.")] = 2,
    threads: Annotated[int, typer.Option(help="torch threads (0: torch's default).")] = 0,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Train-step speed, measured side by side in one process: the modbench baseline against
    Hugging Face's LlamaForCausalLM of the same shape (tokens/s and their ratio), and each
    method's step time over the baseline's. Medians of interleaved rounds; on CUDA also MFU
    and step memory.

    Example: modbench bench --json --methods baseline,qknorm,softpick --rounds 3
    """
    from modbench.analysis.bench import DEFAULT_METHODS, markdown, run_bench
    from modbench.methods import load_all
    from modbench.methods.base import split_top

    if methods == "all":
        names: list[str] | None = ["baseline", *sorted(load_all())]
    elif methods:
        names = [m.strip() for m in split_top(methods, ",") if m.strip()]
    else:
        names = list(DEFAULT_METHODS)
    presets = [p.strip() for p in hf_presets.split(",") if p.strip()] if hf else None
    report = run_bench(device=device, hf_presets=presets, methods=names, preset=preset,
                       rounds=rounds, steps=steps, dtype=dtype, compile=compile,
                       threads=threads, progress=progress)
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else markdown(report))


@app.command()
def diagnose(
    run_dir: Annotated[str, typer.Argument(help="A run folder written by `modbench train`.")],
    batches: Annotated[int, typer.Option(
        help="Validation batches (of the run's batch size) to analyse.")] = 8,
    out: Annotated[str | None, typer.Option(
        help="Output folder (default: RUN_DIR/diagnostics).")] = None,
    threads: Annotated[int, typer.Option(
        help="torch CPU threads (0: the run's train.threads, else torch's default; 1 is "
             "fastest on a busy machine).")] = 0,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Diagnose a trained run with hooks on its layers: residual-stream growth, angular
    distance and loss when each layer is skipped, attention/FFN share of the update, gradient
    norms, attention entropy and sink, outliers and kurtosis, weight spectra, and the loss
    under 4-bit weight and 8-bit activation quantization. Writes diagnostics.json and PNG
    figures (docs/diagnostics.md).

    Example: modbench diagnose runs/t --batches 8 --out runs/t/diagnostics
    """
    from modbench.report.diagnostics import diagnose as run_diagnose

    d = run_diagnose(run_dir, batches=batches, out=out, threads=threads, progress=progress)
    r = d.result
    typer.echo(f"run:        {run_dir} (step {r['step']}, {r['method']})")
    typer.echo(f"validation: loss {r['validation_loss']:.4f} on {r['sequences']} sequences")
    for layer in r["layers"]:
        skip, ang = layer["skip_delta_loss"], layer["angular_distance"]
        typer.echo(f"layer {layer['layer']:>3}:  angular distance "
                   + ("n/a" if ang is None else f"{ang:.3f}") + ", skip Δloss "
                   + ("n/a" if skip is None else f"{skip:+.4f}"))
    for key in ("w4_per_channel", "w4_group", "a8_per_token"):
        delta = r["quantization"][key]["delta"]
        typer.echo(f"{key + ':':<16} Δloss " + ("n/a" if delta is None else f"{delta:+.4f}"))
    typer.echo(f"wrote:      {d.json_path} and {len(d.figures)} figures "
               f"({len(r['null_reasons'])} figures null, reasons in the JSON)")


def run_cli(argv: list[str]) -> int:
    """Run the CLI on ``argv``; user errors become one line on stderr and exit code 2."""
    exit_types, usage_types, abort_types = _click_exceptions()
    try:
        app(args=argv, prog_name="modbench", standalone_mode=False)
    except ModbenchError as e:
        typer.echo(f"error: {_one_line(str(e))}", err=True)
        return 2
    except exit_types as e:
        return int(e.exit_code)  # type: ignore[attr-defined]
    except usage_types as e:  # unknown command or option, missing argument, bad value
        ctx = getattr(e, "ctx", None)
        hint = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
        msg = _one_line(str(e.format_message())).rstrip(".")  # type: ignore[attr-defined]
        typer.echo(f"error: {msg}{hint}", err=True)
        return int(getattr(e, "exit_code", 2))
    except abort_types:
        typer.echo("aborted", err=True)
        return 130
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return 130
    return 0


def _one_line(message: str) -> str:
    """An error message on one line, whatever the input it quotes holds (a newline in a
    --set value or a file name)."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _click_exceptions() -> tuple[tuple[type[BaseException], ...], ...]:
    """Exit, usage-error and abort exception types of the click that typer runs on: older typer
    uses the ``click`` package (not a dependency of ours), newer typer its own copy."""
    exits: list[type[BaseException]] = [typer.Exit]
    usage: list[type[BaseException]] = []
    aborts: list[type[BaseException]] = [typer.Abort]
    try:
        from typer._click import exceptions as vendored  # typer >= 0.2x
        usage.append(vendored.ClickException)
    except ImportError:
        pass
    try:
        import click
        exits.append(click.exceptions.Exit)
        usage.append(click.ClickException)
        aborts.append(click.exceptions.Abort)
    except ImportError:
        pass
    return tuple(exits), tuple(usage), tuple(aborts)


def main() -> None:
    sys.exit(run_cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
