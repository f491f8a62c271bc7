"""What ``modbench train`` does with its options, as Python: resolve the config, name the run
folder, and train one run, a torchrun group (``nproc`` > 1) or several init seeds (stacked in
one process when the method allows it, else one at a time).

:mod:`modbench.train.cli` parses the options into :class:`TrainOptions`, calls
:func:`train_runs`, prints each run's summary and turns a diverged or stalled run into its
exit code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modbench.errors import ModbenchError

if TYPE_CHECKING:
    from modbench.config import RunConfig


@dataclass(frozen=True)
class TrainOptions:
    """The options of ``modbench train`` (its ``--help`` says what each does); ``seeds``:
    the init seeds of ``--seeds``, parsed (empty: one run of ``seed``)."""

    preset: str | None = None
    method: str | None = None
    seed: int | None = None
    seeds: list[int] = field(default_factory=list)
    steps: int | None = None
    out: Path | None = None
    recipe: str | None = None
    config: Path | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    overrides: list[str] = field(default_factory=list)
    nproc: int | None = None
    progress: bool = True
    max_restarts: int | None = None


@dataclass
class Trained:
    """The runs :func:`train_runs` trained, each as its folder and summary. ``report``: this
    process reports them (not a torchrun group's rank > 0); ``judge``: this process's exit code
    follows them (not a member of a torchrun group, which exits 0 for a diverged run)."""

    runs: list[tuple[Path, dict[str, Any]]]
    report: bool = True
    judge: bool = True


def parse_seeds(seeds: str | None, seed: int | None) -> list[int]:
    """``--seeds 0,1,2`` as distinct ints ([] when not given)."""
    if seeds is None:
        return []
    if seed is not None:
        raise ModbenchError("give --seed or --seeds, not both")
    try:
        out = [int(x) for x in seeds.split(",") if x.strip()]
    except ValueError:
        raise ModbenchError(f"--seeds takes comma-separated integers, e.g. 0,1,2; got "
                            f"{seeds!r}") from None
    if not out or len(set(out)) != len(out):
        raise ModbenchError(f"--seeds needs distinct init seeds, e.g. 0,1,2; got {seeds!r}")
    return out


def _check_nproc(nproc: int | None) -> None:
    if nproc is not None:
        if nproc < 1:
            raise ModbenchError(f"--nproc must be at least 1, got {nproc}")
        if os.environ.get("WORLD_SIZE") and nproc > 1:
            raise ModbenchError("--nproc starts a torchrun group, but this process already runs "
                                "in one (WORLD_SIZE is set); drop --nproc")


def _check_same_code(run: Path) -> None:
    """Refuse to resume a run whose outside methods' code is not the code it trained with
    (the two halves of its curve would come from two versions of the method)."""
    from modbench.methods.plugins import check_recorded

    check_recorded(run, "resume it")


def _default_out(cfg: RunConfig, seeds: list[int]) -> Path:
    """A new folder under ``runs/`` named after the preset, method, seed(s) and time."""
    safe = cfg.model.method.replace("+", "_").replace("(", "_").replace(")", "")
    safe = "".join(c if c.isalnum() or c in "_-.=" else "_" for c in safe)[:80]
    which = f"s{cfg.seed}" if not seeds else "seeds" + "_".join(map(str, seeds))
    return Path("runs") / f"{cfg.preset}-{safe}-{which}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_training(opts: TrainOptions) -> tuple[RunConfig, Path, TrainOptions]:
    """Check the options and resolve the run's config and folder. Resuming, the run's own
    ``config.yaml`` is the starting point (unless ``config`` names another); the options come
    back with that config file, the ``checkpoint_every`` override, and the folder."""
    from modbench.config import resolve
    from modbench.train.distributed import check_world

    _check_nproc(opts.nproc)
    overrides = list(opts.overrides)
    if opts.checkpoint_every is not None:
        overrides.append(f"train.checkpoint_every={opts.checkpoint_every}")
    if opts.max_restarts is not None:
        if opts.nproc is None or opts.nproc < 2:
            raise ModbenchError("--max-restarts starts a torchrun group again after a failure; "
                                "add --nproc N with N >= 2, or drop --max-restarts")
        overrides.append(f"train.max_restarts={opts.max_restarts}")
    config, out = opts.config, opts.out
    first = out / f"s{opts.seeds[0]}" if opts.seeds and out is not None else out
    if opts.resume and config is None and first is not None and (
            first / "config.yaml").is_file():
        config = first / "config.yaml"
    cfg = resolve(opts.preset, recipe=opts.recipe, yaml_file=config, method=opts.method,
                  seed=opts.seed, steps=opts.steps, overrides=overrides)
    if opts.resume and first is not None:
        _check_same_code(first)
    if opts.nproc is not None and opts.nproc > 1:
        check_world(cfg.train, opts.nproc, len(opts.seeds) or 1, cfg.recipe.optimizer)
    if out is None:
        if opts.resume:
            raise ModbenchError("--resume needs --out, the folder of the run to continue")
        out = _default_out(cfg, opts.seeds)
    return cfg, out, replace(opts, config=config, overrides=overrides, checkpoint_every=None,
                             max_restarts=None, out=out)


def _train_seeds(cfg: RunConfig, opts: TrainOptions, out: Path,
                 note: Callable[[str], Any]) -> list[dict[str, Any]]:
    """Every seed of ``opts.seeds``: stacked in one process when the method can stack, else
    one run at a time (``note`` says which)."""
    from modbench.config import resolve
    from modbench.methods.build import plan
    from modbench.train.trainer import train, train_seeds

    p = plan(cfg.model)
    if p.stackable:
        summaries = train_seeds(cfg, opts.seeds, out, resume=opts.resume, progress=opts.progress)
        note(f"stacked {len(opts.seeds)} seeds in one process")
        return summaries
    note(f"note: method '{p.method}' cannot stack seeds in one process "
         f"({p.stack_note}); training them one at a time")
    summaries = []
    for s in opts.seeds:
        one = resolve(opts.preset, recipe=opts.recipe, yaml_file=opts.config, method=opts.method,
                      seed=s, steps=opts.steps, overrides=opts.overrides)
        summaries.append(train(one, out / f"s{s}", resume=opts.resume, progress=opts.progress))
    return summaries


def restarted(opts: TrainOptions) -> TrainOptions:
    """The options of a process that torchrun started again after its group failed
    (``train.max_restarts``, ``TORCHELASTIC_RESTART_COUNT`` >= 1): it continues the run in
    ``out`` from the last checkpoint (``resume``; a folder with no ``config.yaml`` yet starts
    afresh, as the first start did). A group stopped by its launcher's stop file (a
    pre-emption: the failure torchrun saw was the saved stop's exit 75) is not started
    again: this process exits 75 at once."""
    from modbench.runtime.checkpoint import Preempted, signal_name, stop_requested
    from modbench.train.distributed import restart_count

    if restart_count() == 0 or opts.out is None or opts.seeds:
        return opts
    signum = stop_requested()
    if signum is not None:
        raise Preempted(f"stopped by {signal_name(signum)} before a restart; continue with "
                        "--resume", signum)
    if not opts.resume and (opts.out / "config.yaml").is_file():
        return replace(opts, resume=True)
    return opts


def train_runs(opts: TrainOptions, note: Callable[[str], Any] = print) -> Trained:
    """Train what ``modbench train`` asks for (module docstring); ``note`` receives the line
    that says how several seeds were trained. Raises :class:`ModbenchError` for a usage or
    input error, before any run folder is written."""
    from modbench.train.distributed import launch
    from modbench.train.trainer import train

    cfg, out, opts = resolve_training(restarted(opts))
    if opts.nproc is not None and opts.nproc > 1:
        summary = launch(cfg, out, opts.nproc, resume=opts.resume, progress=opts.progress)
        return Trained([(out, summary)])
    if not opts.seeds:
        summary = train(cfg, out, resume=opts.resume, progress=opts.progress)
        return Trained([(out, summary)],
                       report=int(os.environ.get("RANK") or 0) == 0,  # one summary per group
                       judge=int(os.environ.get("WORLD_SIZE") or 1) == 1)
    summaries = _train_seeds(cfg, opts, out, note)
    return Trained([(out / f"s{s}", summary)
                    for s, summary in zip(opts.seeds, summaries, strict=True)])


__all__ = ["TrainOptions", "Trained", "parse_seeds", "resolve_training", "train_runs"]
