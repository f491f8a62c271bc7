"""The ``modbench`` command line: a thin typer layer over the Python API.

Start-up is kept fast: this module and the sub-apps it mounts (``*/cli.py``) import only typer,
the standard library and modbench's light modules (config, errors) at module level, so
``modbench --help``, ``modbench methods``, ``modbench presets`` and argument errors answer
without importing torch or transformers; each command imports what it runs in its body
(tests/test_cli_startup.py holds this).

Exit codes (docs/cli.md): 0 completed, 1 a study finished with failed runs, 2 usage or input
error (one line on stderr, nothing written), 3 a single run (``modbench train``) diverged or
stalled, 130 interrupted.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from modbench.errors import ModbenchError
from modbench.helptext import tidy_help
from modbench.interrupts import note_interrupts, parsed
from modbench.methods.options import MethodsFrom, use_plugins

if TYPE_CHECKING:
    from modbench.config import RunConfig
    from modbench.measure.plan import MemoryPlan

EXIT_OK = 0
EXIT_USAGE = 2  # usage or input error: one line on stderr
EXIT_INTERRUPTED = 130
# (1: `modbench study run` with failed runs, study/cli.py; 3: a diverged or stalled
# `modbench train` run, train/cli.py EXIT_DIVERGED)

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


methods_app = typer.Typer(
    help="List, check and scaffold methods.\n\nExample: modbench methods --methods-from "
    "./mylab/methods.py",
    invoke_without_command=True)
app.add_typer(methods_app, name="methods")


def _mount_methods_commands() -> None:
    from modbench.conformance.cli import check_command, new_command

    methods_app.command(name="check")(check_command)
    methods_app.command(name="new")(new_command)


_mount_methods_commands()


@methods_app.callback()
def methods(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print JSON: every field, the citation and recipe exceptions too.")
    ] = False,
    methods_from: MethodsFrom = None,
) -> None:
    """List the registered methods: name, category, summary, options with their defaults;
    `modbench methods check NAME` runs the conformance kit on one, `modbench methods new NAME`
    writes a template.

    On a terminal a table fitted to its width; piped, a header and one line per method (name,
    category, summary), its options and notes on indented lines below. The built-in methods
    are read from the method catalog, without importing torch; methods from outside the
    package (--methods-from, MODBENCH_METHODS_FROM, installed entry points) are listed after
    them with where they came from.

    Example: modbench methods --json

    Example: modbench methods --methods-from ./mylab/methods.py
    """
    if ctx.invoked_subcommand is not None:
        return
    from modbench.methods.catalog import REWRITE, method_rows
    from modbench.methods.plugins import plugins_requested

    rows, current = method_rows()
    if not current:
        typer.echo(f"note: the method catalog is out of date, so the registry was loaded "
                   f"(slower); `{REWRITE}` rewrites it", err=True)
    if plugins_requested(methods_from or []):
        rows = rows + outside_rows(methods_from or [])
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    _echo_table(METHOD_COLUMNS, method_table(rows), wrap=(2,))
    typer.echo(RECIPE_OPTIONS_NOTE)


def outside_rows(methods_from: list[str]) -> list[dict[str, Any]]:
    """The info rows of the methods from outside the package (plugins named here, in
    MODBENCH_METHODS_FROM or installed as entry points), each with its ``origin``."""
    from modbench.methods.base import load_all
    from modbench.methods.plugins import is_builtin, origin

    use_plugins(methods_from)
    rows = []
    for name, cls in sorted(load_all().items()):
        if not is_builtin(cls):
            info = json.loads(json.dumps(cls.info(), default=str))
            rec = origin(name)
            info["origin"] = {k: v for k, v in rec.items() if k != "files"}
            rows.append(info)
    return rows


# training methods that are recipe options, not architectures (docs/config.md)
RECIPE_OPTIONS_NOTE = ("recipe options usable with any method: recipe.optimizer=muon (Muon for "
                       "the hidden matrices, AdamW for the rest; OSP's optimizer), "
                       "recipe.muon_layerwise_lr=noise (noise-adaptive layer-wise learning "
                       "rates on Muon): docs/config.md")

METHOD_COLUMNS = ["method", "category", "summary"]


def method_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The rows of `modbench methods` from the methods' info rows: name, category, and the
    summary with the options and any note on lines of their own."""
    table = []
    for r in rows:
        text = r["summary"]
        if r["options"]:
            text += "\noptions: " + ", ".join(f"{k}={v}" for k, v in r["options"].items())
        if r["recipe_exceptions"]:
            text += "\nrecipe: " + ", ".join(f"{k}={v}"
                                              for k, v in r["recipe_exceptions"].items())
        if r["leaks_across_positions"]:
            text += ("\nnote: batch statistics mix positions in training mode (future tokens "
                     "leak into earlier outputs)")
        if r.get("compile_graph_breaks"):
            text += f"\nnote: torch.compile breaks its graph: {r['compile_graph_breaks']}"
        if r.get("origin"):
            o = r["origin"]
            text += (f"\nfrom: {o.get('plugin') or o.get('module')} (sha256 "
                     f"{str(o.get('sha256', '?'))[:12]})")
        table.append([r["name"], r["category"], text])
    return table


@app.command()
def presets(
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print JSON: the whole model config, training keys and note.")] = False,
) -> None:
    """List the presets with their shapes and parameter counts (counted, nothing allocated).

    Columns: parameters in millions, d_model, layers, query/KV heads, d_ff, vocabulary,
    context length, recipe. On a terminal a table fitted to its width; piped, one line per
    preset.

    Example: modbench presets --json
    """
    import dataclasses

    from modbench.config import PRESETS
    from modbench.measure.flops import baseline_params

    rows = []
    for p in PRESETS.values():
        if p.model.method == "baseline":  # the analytic count, without importing torch
            params = baseline_params(p.model)
        else:
            from modbench.methods.build import count_params

            params = count_params(p.model)
        rows.append({"name": p.name, "params": params, "recipe": p.recipe,
                     "model": dataclasses.asdict(p.model), "train": dict(p.train), "note": p.note})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = []
    for r in rows:
        m = r["model"]
        table.append([r["name"], f"{r['params'] / 1e6:.2f}M", str(m["d_model"]),
                      str(m["n_layers"]), f"{m['n_heads']}/{m['n_kv_heads']}", str(m["d_ff"]),
                      str(m["vocab_size"]), str(m["max_seq_len"]), r["recipe"]])
    _echo_table(["preset", "params", "d", "L", "H/KV", "ff", "V", "T", "recipe"], table,
                right=(1, 2, 3, 4, 5, 6, 7))


@app.command()
def recipes(
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print JSON: every recipe key.")] = False,
) -> None:
    """List the training recipes (frozen across methods).

    On a terminal a table fitted to its width; piped, one line per recipe (name, optimizer,
    lr, betas, weight decay, clip, schedule, note).

    Example: modbench recipes --json
    """
    import dataclasses

    from modbench.config import RECIPES

    rows = [dataclasses.asdict(r) for r in RECIPES.values()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    settings = [(r["optimizer"], f"{r['lr']:g}", ",".join(f"{b:g}" for b in r["betas"]),
                 f"{r['weight_decay']:g}", f"{r['grad_clip']:g}", r["schedule"]) for r in rows]
    if _is_terminal():  # the settings in one wrapping column, so the note keeps some width
        _echo_table(["recipe", "settings", "note"],
                    [[r["name"], f"{o} lr={lr} betas={b} wd={wd} clip={c} {sched}", r["note"]]
                     for r, (o, lr, b, wd, c, sched) in zip(rows, settings, strict=True)],
                    fancy=True, wrap=(1, 2), ratios={1: 1, 2: 2})
        return
    _echo_table(["recipe", "optimizer", "lr", "betas", "wd", "clip", "schedule", "note"],
                [[r["name"], *one, r["note"]] for r, one in zip(rows, settings, strict=True)],
                fancy=False, right=(2, 4, 5))


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
    methods_from: MethodsFrom = None,
) -> None:
    """Parameters and training FLOPs per token, counted analytically (arXiv 2605.20798 Appendix C:
    matrix multiplications, full T x T attention, training = 3 x forward).

    Example: modbench flops --preset climb-1.2b --method diff_attn --method relu2
    """
    from modbench.config import resolve
    from modbench.measure import flop_report
    from modbench.methods import load_all
    from modbench.methods.build import plan_run

    use_plugins(methods_from)
    names = list(method) if method else ["baseline", *sorted(load_all())]
    rows = []
    for name in names:
        cfg = resolve(preset, method=name)
        plan_run(cfg)  # the method string checked as `train` checks it (slots, options)
        t = seq_len if seq_len is not None else cfg.train.seq_len
        rows.append(flop_report(cfg.model, t).as_dict())
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = [[r["method"], f"{r['params']:,}", f"{r['forward_flops_per_token']:.4g}",
              f"{r['train_flops_per_token']:.4g}", f"{r['flops_ratio']:.4f}"] for r in rows]
    _echo_table(["method", "params", "fwd FLOPs/tok", "train FLOPs/tok", "vs base"], table,
                right=(1, 2, 3, 4), wrap=(0,))


# The options of `modbench plan`.
_PlanPresetOpt = Annotated[list[str] | None, typer.Option(
    help="Preset (`modbench presets`), repeatable [default: cpu-small].")]
_PlanMethodOpt = Annotated[list[str] | None, typer.Option(
    help="Method string, repeatable [default: baseline].")]
_PlanSpecOpt = Annotated[str | None, typer.Option(
    help="Plan every scale and method of a study spec (a built-in name or a YAML file) "
         "instead.")]
_PlanGpuOpt = Annotated[str, typer.Option(
    help="Device to plan for: h100-80gb, h100-pcie, h100-nvl, h200, a100-40gb, a100-80gb, "
         "l40s, b200 or cpu.")]
_PlanNprocOpt = Annotated[int, typer.Option(help="Processes (GPUs) of the run.")]
_PlanParallelOpt = Annotated[str | None, typer.Option(
    help="ddp | fsdp | auto across the processes (auto: DDP where it fits, else FSDP) "
         "[default: the config's train.parallel].",
    show_default=False)]
_PlanMicroBatchOpt = Annotated[int | None, typer.Option(
    help="Plan at this micro-batch [default: the largest that fits].",
    show_default=False)]
_PlanEnsemblesOpt = Annotated[int, typer.Option(help="Seeds stacked in one process.")]
_PlanSetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a config key (key=value), repeatable.")]
_PlanJsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print JSON: one object per (preset, method), every plan field.")]


@app.command(name="plan")
def plan_command(
    preset: _PlanPresetOpt = None,
    method: _PlanMethodOpt = None,
    spec: _PlanSpecOpt = None,
    gpu: _PlanGpuOpt = "h100-80gb",
    nproc: _PlanNprocOpt = 1,
    parallel: _PlanParallelOpt = None,
    micro_batch: _PlanMicroBatchOpt = None,
    ensembles: _PlanEnsemblesOpt = 1,
    set_: _PlanSetOpt = None,
    as_json: _PlanJsonOpt = False,
    methods_from: MethodsFrom = None,
) -> None:
    """GPU memory of a training process, term by term (fp32 weights, gradients, optimizer
    state; activations and loss traced from the real model without memory; validation), and
    the largest micro-batch that fits the device with a 10 % + 2 GiB margin: what
    train.micro_batch_size=auto chooses. Also the host memory the run's processes need on a
    node (rank 0 gathers the fp32 state to save a checkpoint).

    Example: modbench plan --preset climb-1.2b --method diff_attn --gpu h100-80gb

    Example: modbench plan --spec seed002-3b --nproc 8 --parallel fsdp --json
    """
    from modbench.measure.plan import plan_or_needs
    from modbench.runtime.gpus import lookup
    from modbench.train.recompute import apply_activation_checkpointing

    try:
        _check_plan_options(nproc, micro_batch, ensembles, parallel)
        use_plugins(methods_from)
        device = lookup(gpu)
        cases = (_spec_cases(spec, set_ or []) if spec is not None
                 else _preset_cases(preset or ["cpu-small"], method or ["baseline"], set_ or []))
        plans = [plan_or_needs(cfg, device, micro_batch=micro_batch, nproc=nproc,
                               parallel=_plan_parallel(cfg, device, nproc, parallel,
                                                       micro_batch, ensembles),
                               ensembles=ensembles,
                               checkpointing=apply_activation_checkpointing)
                 for cfg in cases]
    except ModbenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    if as_json:
        typer.echo(json.dumps([{**mp.to_json(), "note": note} for mp, note in plans],
                              indent=2))
        return
    _echo_plans(plans, nproc)


def _check_plan_options(nproc: int, micro_batch: int | None, ensembles: int,
                        parallel: str | None) -> None:
    """`modbench plan`'s options by themselves, before a plugin, a spec or a model is
    loaded."""
    if nproc < 1:
        raise ModbenchError(f"--nproc must be at least 1 (one process a GPU), got {nproc}")
    if micro_batch is not None and micro_batch < 1:
        raise ModbenchError(f"--micro-batch must be at least 1 sequence, got {micro_batch}; "
                            "leave it out to plan the largest that fits")
    if ensembles < 1:
        raise ModbenchError(f"--ensembles must be at least 1 (seeds stacked in one "
                            f"process), got {ensembles}")
    if parallel is not None and parallel not in ("ddp", "fsdp", "auto"):
        raise ModbenchError(f"--parallel must be ddp or fsdp, got {parallel!r} (or auto: DDP "
                            "where its plan fits the device, else FSDP)")


def _plan_parallel(cfg: RunConfig, device: Any, nproc: int, parallel: str | None,
                   micro_batch: int | None, ensembles: int) -> str:
    """`modbench plan`'s mode: ``--parallel``, else the config's ``train.parallel``; ``auto``
    resolved as the trainer resolves it (:func:`modbench.measure.plan.layout`: DDP where it
    fits, else FSDP); where neither fits, the one that comes closer (the plan then says what
    would fit)."""
    import copy

    from modbench.measure.plan import DoesNotFit, auto_parallel, layout
    from modbench.train.recompute import apply_activation_checkpointing

    mode = parallel or cfg.train.parallel
    fixed = auto_parallel(mode, nproc, "cpu" if device.key == "cpu" else "cuda")
    if fixed is not None:
        return fixed
    run = copy.deepcopy(cfg)
    run.train.micro_batch_size = micro_batch if micro_batch is not None else "auto"
    run.train.parallel = "auto"
    try:
        return layout(run, device, nproc=nproc, ensembles=ensembles,
                      checkpointing=apply_activation_checkpointing).parallel
    except DoesNotFit as e:
        return e.plan.parallel


def _spec_cases(spec: str, overrides: list[str]) -> list[RunConfig]:
    """The config of each (scale, method) of a study spec, with the ``--set`` overrides,
    checked plannable by arithmetic."""
    from modbench.config import apply_override
    from modbench.measure.plan import check_plannable
    from modbench.study.spec import expand, load_spec

    cases: list[RunConfig] = []
    seen: set[tuple[str, str]] = set()
    for r in expand(load_spec(spec)):
        if (r.scale, r.method) not in seen:
            seen.add((r.scale, r.method))
            for item in overrides:
                apply_override(r.config, item)
            check_plannable(r.config)  # absurd shapes, by arithmetic, before a trace
            cases.append(r.config)
    return cases


def _preset_cases(presets: list[str], methods: list[str],
                  overrides: list[str]) -> list[RunConfig]:
    """The config of each preset and method, with the ``--set`` overrides, checked plannable
    by arithmetic and its method string as `train` checks it."""
    from modbench.config import resolve
    from modbench.measure.plan import check_plannable
    from modbench.methods.build import plan_run

    cases: list[RunConfig] = []
    for p in presets:
        for m in methods:
            cfg = resolve(p, method=m, overrides=list(overrides))
            check_plannable(cfg)  # absurd shapes, by arithmetic, before a model
            plan_run(cfg)  # the method string checked as `train` checks it
            cases.append(cfg)
    return cases


def _echo_plans(plans: list[tuple[MemoryPlan, str]], nproc: int) -> None:
    """`modbench plan`'s table: the device, a row a plan (the terms any plan has), then each
    plan's note and which plans are estimated."""
    from modbench.measure.plan import gb

    terms = ["weights", "gradients", "optimizer", "activations", "loss", "eval", "ensembles",
             "parallel"]
    shown = [t for t in terms if any(mp.terms.get(t) for mp, _ in plans)]
    rows = [[mp.preset, mp.method, str(mp.micro_batch),
             *(f"{mp.terms[t] / 1e9:.2f}" for t in shown), f"{mp.peak_bytes / 1e9:.2f}",
             "yes" if mp.fits else "no", f"{mp.host_bytes / 1e9:.0f}"] for mp, _ in plans]
    first = plans[0][0]
    where = f"{nproc} x {first.device} ({first.parallel})" if nproc > 1 else first.device
    typer.echo(f"memory plan on {where}: {gb(first.device_bytes)} a device, "
               f"{gb(first.usable_bytes)} usable; GB (10^9 bytes) a process, "
               f"{first.precision} forward")
    _echo_table(["preset", "method", "micro", *shown, "peak", "fits", "host"], rows,
                right=(*range(2, len(shown) + 4), len(shown) + 5), wrap=(1,))
    for mp, note in plans:
        if note:
            typer.echo(f"{mp.preset} {mp.method}: {note}")
        if mp.estimated:
            typer.echo(f"{mp.preset} {mp.method}: activations, loss and eval estimated (the "
                       f"baseline's times the method's ratio at tiny): its forward reads "
                       f"tensor values ({mp.estimated})")


# The options of `modbench bench`.
_BenchJsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
_BenchMethodsOpt = Annotated[str | None, typer.Option(
    help="Comma-separated method strings for the overhead table, or 'all' "
         "[default: one or two per category].")]
_BenchPresetOpt = Annotated[str | None, typer.Option(
    help="Preset of the method table [default: cpu-small; tiny with --compile-check].")]
_BenchHfOpt = Annotated[bool, typer.Option(
    help="Compare with Hugging Face LlamaForCausalLM (needs transformers).")]
_BenchHfPresetsOpt = Annotated[str, typer.Option(
    help="Comma-separated presets of the Hugging Face comparison.")]
_BenchDeviceOpt = Annotated[str, typer.Option(help="cpu | cuda | cuda:N")]
_BenchDtypeOpt = Annotated[str, typer.Option(
    help="auto | fp32 | bf16 (bf16 autocast); auto: bf16 on CUDA, fp32 on the CPU.")]
_BenchCompileOpt = Annotated[bool | None, typer.Option(
    help="torch.compile every model [default: on CUDA, not on the CPU].",
    show_default=False)]
_BenchMicroBatchOpt = Annotated[int, typer.Option(
    help="Rows a step of the method table and the trainer (0: the preset's batch on the "
         "CPU, the memory plan's micro-batch on CUDA).")]
_BenchTrainerOpt = Annotated[bool | None, typer.Option(
    help="Also time the trainer's own step (modbench train at the table's shape, with its "
         "copies, read-backs and validation) [default: on CUDA, not on the CPU].",
    show_default=False)]
_BenchTrainerStepsOpt = Annotated[int, typer.Option(
    help="Timed trainer steps (0: 32 on CUDA, 4 on the CPU).")]
_BenchRoundsOpt = Annotated[int, typer.Option(help="Interleaved rounds.")]
_BenchStepsOpt = Annotated[int, typer.Option(help="Timed steps per case per round.")]
_BenchThreadsOpt = Annotated[int, typer.Option(help="torch threads (0: torch's default).")]
_BenchProgressOpt = Annotated[bool, typer.Option(help="Show progress bars.")]
_BenchCompileCheckOpt = Annotated[bool, typer.Option(
    "--compile-check",
    help="Instead of timing: count the graphs, graph breaks (with reasons) and recompiles "
         "torch.compile makes of each method's training forward, with and without "
         "activation checkpointing (--methods, default all; --preset, default tiny; "
         "--dtype, --device; one torch thread unless --threads; a backend that generates "
         "no code). Table, or --json rows.")]
_BenchCheckpointingOpt = Annotated[bool | None, typer.Option(
    help="--compile-check: only with (--checkpointing) or only without "
         "(--no-checkpointing) activation checkpointing [default: both].",
    show_default=False)]


@app.command()
def bench(
    as_json: _BenchJsonOpt = False,
    methods: _BenchMethodsOpt = None,
    preset: _BenchPresetOpt = None,
    hf: _BenchHfOpt = True,
    hf_presets: _BenchHfPresetsOpt = "cpu-small,llama-60m",
    device: _BenchDeviceOpt = "cpu",
    dtype: _BenchDtypeOpt = "auto",
    compile: _BenchCompileOpt = None,
    micro_batch: _BenchMicroBatchOpt = 0,
    trainer: _BenchTrainerOpt = None,
    trainer_steps: _BenchTrainerStepsOpt = 0,
    rounds: _BenchRoundsOpt = 5,
    steps: _BenchStepsOpt = 2,
    threads: _BenchThreadsOpt = 0,
    progress: _BenchProgressOpt = True,
    compile_check: _BenchCompileCheckOpt = False,
    checkpointing: _BenchCheckpointingOpt = None,
    methods_from: MethodsFrom = None,
) -> None:
    """Train-step speed, measured side by side in one process: the modbench baseline against
    Hugging Face's LlamaForCausalLM of the same shape (tokens/s and their ratio), and each
    method's step time over the baseline's. Medians of interleaved rounds. On CUDA: bf16
    autocast and torch.compile by default, one micro-batch of the memory plan, MFU against the
    exact GPU model's peak, step memory, and the trainer's own step beside the bare one.

    With --compile-check, no timing: per method and checkpointing mode, the graphs
    torch.compile makes of the training forward, its graph breaks with their reasons (first
    line and user file:line) and its recompiles over two later steps on same-shape batches;
    a method that declares it cannot be one graph (`modbench methods`) is marked expected.

    Example: modbench bench --json --methods baseline,qknorm,softpick --rounds 3

    Example: modbench bench --compile-check --methods baseline,moe --json
    """
    from modbench.measure.bench import markdown, run_bench

    use_plugins(methods_from)
    names = _bench_methods(methods, compile_check)
    if compile_check:
        _compile_check(names or [], preset=preset or "tiny", checkpointing=checkpointing,
                       dtype=dtype, device=device, as_json=as_json, progress=progress,
                       threads=threads)
        return
    preset = preset or "cpu-small"
    presets = [p.strip() for p in hf_presets.split(",") if p.strip()] if hf else None
    report = run_bench(device=device, hf_presets=presets, methods=names, preset=preset,
                       rounds=rounds, steps=steps, dtype=dtype, compile=compile,
                       threads=threads, progress=progress, micro_batch=micro_batch,
                       trainer=trainer, trainer_steps=trainer_steps)
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else markdown(report))


def _bench_methods(methods: str | None, compile_check: bool) -> list[str]:
    """The methods `modbench bench` measures: every registered one for 'all' (and by default
    with --compile-check), the --methods list, else one or two per category."""
    from modbench.measure.bench import DEFAULT_METHODS
    from modbench.methods import load_all
    from modbench.methods.base import split_top

    if methods == "all" or (compile_check and not methods):
        return ["baseline", *sorted(load_all())]
    if methods:
        return [m.strip() for m in split_top(methods, ",") if m.strip()]
    return list(DEFAULT_METHODS)


def _compile_check(names: list[str], *, preset: str, checkpointing: bool | None, dtype: str,
                   device: str, as_json: bool, progress: bool, threads: int) -> None:
    """`modbench bench --compile-check` (modbench.measure.compile_check); one torch thread
    unless --threads says otherwise (tracing is Python-bound; tiny graphs run fastest on one
    thread of a shared machine)."""
    import torch

    from modbench.measure.compile_check import (
        TABLE_HEADERS,
        run_compile_check,
        summary,
        table_rows,
    )
    from modbench.train.recompute import apply_activation_checkpointing

    modes = (False, True) if checkpointing is None else (checkpointing,)
    try:
        if dtype not in ("auto", "fp32", "bf16"):
            raise ModbenchError(f"--dtype must be auto, fp32 or bf16, got {dtype!r}")
        bf16 = dtype == "bf16" or (dtype == "auto" and device.startswith("cuda"))
        torch.set_num_threads(threads or 1)
        rows = run_compile_check(names, preset=preset, modes=modes,
                                 apply_checkpointing=apply_activation_checkpointing,
                                 bf16=bf16, device=device, progress=progress)
    except ModbenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    typer.echo(f"torch.compile of the training forward, preset {preset}, "
               f"{'bf16 autocast' if bf16 else 'fp32'}, {device}; recompiles over "
               f"two later steps on batches of the same shape")
    _echo_table(TABLE_HEADERS, table_rows(rows), right=(2, 3, 4), wrap=(5,))
    typer.echo(summary(rows))


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
    methods_from: MethodsFrom = None,
) -> None:
    """Diagnose a trained run with hooks on its layers: residual-stream growth, angular
    distance and loss when each layer is skipped, attention/FFN share of the update, gradient
    norms, attention entropy and sink, outliers and kurtosis, weight spectra, and the loss
    under 4-bit weight and 8-bit activation quantization. Writes diagnostics.json and PNG
    figures (docs/diagnostics.md).

    Example: modbench diagnose runs/t --batches 8 --out runs/t/diagnostics
    """
    from pathlib import Path

    from modbench.eval.run import check_run_folder
    from modbench.report.diagnostics import DIAGNOSTICS_DIR
    from modbench.report.diagnostics import diagnose as run_diagnose
    from modbench.runtime.lock import FolderLock

    use_plugins(methods_from)
    check_run_folder(Path(run_dir))
    with FolderLock(out or Path(run_dir) / DIAGNOSTICS_DIR, "modbench diagnose"):
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


@app.command(name="remove-norm")
def remove_norm(
    source: Annotated[str, typer.Argument(
        help="A modbench run folder (LayerNorm or RMSNorm) or a Hugging Face GPT-2 folder.")],
    out: Annotated[str, typer.Option(help="New output folder.")],
    steps: Annotated[int, typer.Option(
        help="Fine-tuning steps; the published 300-step schedule is scaled to them.")] = 300,
    batch_size: Annotated[int | None, typer.Option(
        help="Sequences per step [default: the run's batch size; 8 for GPT-2].")] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate (cosine to half of it).")]
    = 6e-4,
    aux_weight: Annotated[float, typer.Option(
        help="Weight of the auxiliary loss evening out the final norm's statistic "
             "(the paper's 0.1).")] = 0.0,
    control: Annotated[bool, typer.Option(
        help="Also fine-tune a copy with its norms for the same steps, to separate the "
             "cost of removal from the effect of fine-tuning.")] = False,
    diagnostics_batches: Annotated[int, typer.Option(
        help="Validation batches for the diagnostics before and after (0: none).")] = 4,
    data: Annotated[str | None, typer.Option(
        help="GPT-2 only: a dataset from `modbench data prepare --tokenizer SOURCE` "
             "[default: the built-in corpus with the folder's tokenizer].")] = None,
    seq_len: Annotated[int | None, typer.Option(
        help="GPT-2 only: row length of the re-tokenised built-in corpus [default: 128].")]
    = None,
    val_sequences: Annotated[int | None, typer.Option(
        help="GPT-2 only: validation sequences [default: 64].")] = None,
    device: Annotated[str, typer.Option(help="GPT-2 only: auto | cpu | cuda | cuda:N.")]
    = "auto",
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    methods_from: MethodsFrom = None,
) -> None:
    """Remove every normalization by fine-tuning (Heimersheim 2024; Baroni et al. 2025): each
    norm's statistic is frozen to its moving average, layer by layer on the published
    schedule, leaving fixed linear maps (folded into the weights). Writes the norm-free model,
    remove_norm.json (validation loss before, after each stage, after) and the diagnostics of
    both models (docs/remove_norm.md).

    Example: modbench remove-norm runs/t --out runs/t-nonorm --steps 100
    """
    from pathlib import Path

    from modbench.remove_norm import remove_norm as run_remove_norm
    from modbench.runtime.lock import FolderLock

    use_plugins(methods_from)
    with FolderLock(out, "modbench remove-norm", beside=True):  # one writer of --out
        o = run_remove_norm(source, out, steps=steps, batch_size=batch_size, lr=lr,
                            aux_weight=aux_weight, diagnostics_batches=diagnostics_batches,
                            control=control, data=data, seq_len=seq_len,
                            val_sequences=val_sequences, device=device, progress=progress)
    if o.kind == "modbench" and diagnostics_batches > 0:
        import json

        from modbench.report.diagnostics import diagnostics_figures

        for when in ("before", "after"):
            folder = Path(out) / "diagnostics" / when
            diagnostics_figures(json.loads((folder / "diagnostics.json").read_text()), folder)
    v, c = o.report["validation"], o.report["check"]
    typer.echo(f"source:     {source} ({o.kind}), {steps} fine-tuning steps")
    typer.echo(f"validation: loss {v['before']:.4f} before, {v['after']:.4f} after "
               f"({v['change']:+.4f}); exported {v['exported']:.4f}")
    for st in v["stages"]:
        typer.echo(f"  after {st['stage']:<8} (step {st['step']:>4}): {st['val_loss']:.4f}")
    if "control_after" in v:
        typer.echo(f"control:    {v['control_after']:.4f} with norms; removal costs "
                   f"{v['removal_cost']:+.4f}")
    typer.echo(f"norm-free:  {'yes' if c['normalization_free'] else 'NO'} "
               f"({c['paths_checked']} norm paths, max linearity error "
               f"{c['max_linearity_error']:.1e})")
    typer.echo(f"wrote:      {out}")


def run_cli(argv: list[str]) -> int:
    """Run the CLI on ``argv`` and return its exit code: 0 completed, 1 a study with failed
    runs, 2 a usage or input error (one line on stderr), 3 a diverged or stalled single run,
    130 interrupted."""
    exit_types, usage_types, abort_types = _click_exceptions()
    interrupts: list[int] = []  # Ctrl-C seen: typer turns it into exit 130 and says nothing
    restore = note_interrupts(interrupts)
    runfolder = sys.modules.get("modbench.runtime.runfolder")  # (not imported here: torch)
    mark = runfolder.runs_mark() if runfolder is not None else 0  # this command's runs follow
    try:
        command = typer.main.get_command(app)
        tidy_help(command, escape_markup=app.rich_markup_mode == "rich")
        # without standalone mode, click returns the code of a typer.Exit (or of an interrupt,
        # 130) instead of raising it; the commands themselves return None
        code = command.main(args=argv, prog_name="modbench", standalone_mode=False)
    except ModbenchError as e:
        typer.echo(f"error: {_one_line(str(e))}", err=True)
        return EXIT_USAGE
    except OSError as e:  # a write the storage refused, where no command said it in words
        from pathlib import Path

        from modbench.runtime.runfolder import is_storage_error, write_problem

        if not is_storage_error(e):
            raise
        where = e.filename or "a file"
        typer.echo(f"error: cannot write {where}: {write_problem(e, Path(str(where)))}; files "
                   "written before it are kept whole (each is replaced at once or not at all)",
                   err=True)
        return EXIT_USAGE
    except exit_types as e:
        return int(e.exit_code)  # type: ignore[attr-defined]
    except usage_types as e:  # unknown command or option, missing argument, bad value
        if type(e).__name__ == "NoArgsIsHelpError":  # `modbench data`: its help was printed
            return EXIT_USAGE
        ctx = getattr(e, "ctx", None)
        hint = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
        msg = _one_line(str(e.format_message())).rstrip(".")  # type: ignore[attr-defined]
        typer.echo(f"error: {msg}{hint}", err=True)
        return int(getattr(e, "exit_code", EXIT_USAGE))
    except abort_types:
        typer.echo("aborted", err=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        interrupts.append(0)
        code = EXIT_INTERRUPTED
    finally:
        restore()
    if interrupts and code == EXIT_INTERRUPTED:
        typer.echo(interrupted_line(argv, mark), err=True)
        return EXIT_INTERRUPTED
    return code if isinstance(code, int) and not isinstance(code, bool) else EXIT_OK


def interrupted_line(argv: list[str], mark: int = 0) -> str:
    """The one line an interrupted command prints: for `modbench train` the step of the last
    checkpoint (or that nothing was saved) and the command that resumes (its run folders: those
    this process opened after ``mark``, modbench.runtime.runfolder.runs_mark); for `modbench
    study run` the runs kept and the command that goes on; else "interrupted"."""
    try:
        names, params = parsed(typer.main.get_command(app), "modbench", argv)
        if names == ["train"]:
            from modbench.train.cli import interrupted_train_line

            return interrupted_train_line(params, mark)
        if names == ["study", "run"]:
            from modbench.study.runner import interrupted_line as study_line

            return study_line(params.get("spec"), params.get("out"))
    except Exception:  # the line is a courtesy: never a traceback of its own
        pass
    return "interrupted"


# ------------------------------------------------------------------------------ listings


def _is_terminal() -> bool:
    return sys.stdout.isatty()


def _echo_table(headers: list[str], rows: list[list[str]], *, fancy: bool | None = None,
                right: tuple[int, ...] = (), wrap: tuple[int, ...] = (),
                ratios: dict[int, int] | None = None) -> None:
    """Print a listing: on a terminal (``fancy``) a rich table fitted to its width, the
    ``wrap`` columns wrapping on word boundaries; otherwise :func:`plain_table`."""
    fancy = _is_terminal() if fancy is None else fancy
    if fancy:
        from rich.console import Console

        Console(soft_wrap=False).print(
            rich_table(headers, rows, right=right, wrap=wrap, ratios=ratios))
    else:
        typer.echo(plain_table(headers, rows, right=right))


def rich_table(headers: list[str], rows: list[list[str]], *, right: tuple[int, ...] = (),
               wrap: tuple[int, ...] = (), ratios: dict[int, int] | None = None) -> Any:
    """A rich ``Table`` of ``rows`` (cells as plain text, never markup): columns not in
    ``wrap`` are never wrapped (a long name keeps its column straight); the ``wrap`` columns
    share the width left in proportion to ``ratios`` (equal shares by default)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for i, h in enumerate(headers):
        table.add_column(h, justify="right" if i in right else "left", no_wrap=i not in wrap,
                         overflow="fold", ratio=(ratios or {}).get(i, 1) if i in wrap else None)
    for r in rows:
        table.add_row(*(Text(c) for c in r))
    return table


def render_table(headers: list[str], rows: list[list[str]], *, width: int,
                 right: tuple[int, ...] = (), wrap: tuple[int, ...] = (),
                 ratios: dict[int, int] | None = None) -> str:
    """:func:`rich_table` as plain text ``width`` columns wide (what a terminal shows)."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False,
            soft_wrap=False).print(rich_table(headers, rows, right=right, wrap=wrap,
                                              ratios=ratios))
    return buf.getvalue()


def plain_table(headers: list[str], rows: list[list[str]], *,
                right: tuple[int, ...] = ()) -> str:
    """A header line and one line per row, columns aligned to their widest cell and two
    spaces apart, nothing wrapped or cut: for scripts and pipes (``--json`` is exact). Further
    lines of the last column's cell follow on lines of their own, indented to that column."""
    lines = [headers, *rows]
    last = len(headers) - 1
    widths = [max(len(r[i]) for r in lines) for i in range(last)]
    indent = sum(widths) + 2 * last
    out = []
    for r in lines:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=False))]
        first, *more = r[last].split("\n")
        out.append("  ".join([*cells, first]).rstrip())
        out.extend(" " * indent + line for line in more)
    return "\n".join(out)


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
