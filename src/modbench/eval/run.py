"""``modbench eval``: held-out loss and offline probes of a trained run, into ``eval.json``.

``RUN_DIR/eval.json``::

    {"run": "...", "method": "...", "preset": "...", "seed": 0, "step": 300,
     "validation": {"loss": 5.47, "ppl": 238.0, "sequences": 128},
     "tasks": {"mqar": {"accuracy": 0.41, "n": 200, "chance": 0.0156, "guess": 0.13,
                        "items": [{"score": 0.5, "hits": 4, "scored": 8}, ...]}, ...}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.eval.probes import probe_sets, score
from modbench.fsutil import atomic_write_text
from modbench.methods._common import set_step
from modbench.methods.build import build_model
from modbench.runtime.checkpoint import load_checkpoint, load_weights
from modbench.runtime.data import open_data
from modbench.runtime.device import resolve_device
from modbench.runtime.loss import finite_or_none, perplexity, validation_loss
from modbench.runtime.runfolder import CHECKPOINT, CONFIG, EVAL

DEFAULT_PROBE_ITEMS = 200


def check_run_folder(run_dir: Path) -> None:
    """Refuse, in one line, a folder that is not a finished or checkpointed training run:
    missing, no ``config.yaml``, or no checkpoint yet."""
    if not run_dir.is_dir():
        raise ModbenchError(f"run folder {run_dir} does not exist; pass the --out folder of a "
                            "`modbench train` run")
    if not (run_dir / CONFIG).is_file():
        raise ModbenchError(f"{run_dir} is not a run folder (no config.yaml); pass the --out "
                            "folder of a `modbench train` run")
    if not (run_dir / CHECKPOINT).is_file():
        raise ModbenchError(f"{run_dir} has no checkpoint ({CHECKPOINT}); let its training "
                            "finish (or resume it with `modbench train --out RUN --resume`) "
                            "first")
    from modbench.methods.plugins import check_recorded

    check_recorded(run_dir, "use it")  # its outside methods loaded, with the code it trained


def load_run(run_dir: Path, device: torch.device | None = None) -> tuple[Any, torch.nn.Module,
                                                                         int]:
    """The run's config, its model with the last checkpoint's weights, and that step.

    Step-dependent modules (PowerNorm's warm-up, PRepBN's lambda) are set to the step of the
    checkpoint's last batch, as the trainer left them for its last validation, so the loaded
    model computes the function the run was validated with."""
    check_run_folder(run_dir)
    cfg = resolve(yaml_file=run_dir / CONFIG)
    if cfg.train.micro_batch_size == "auto":  # the micro-batch the run chose (its meta)
        chosen = (yaml.safe_load((run_dir / CONFIG).read_text()) or {}).get(
            "meta", {}).get("micro_batch_size")
        cfg.train.micro_batch_size = chosen if isinstance(chosen, int) else None
    state = load_checkpoint(run_dir / CHECKPOINT)
    model = build_model(cfg.model, seed=cfg.seed)
    load_weights(model, state["model"], run_dir / CHECKPOINT)
    step = int(state["step"])
    set_step(model, max(step - 1, 0), cfg.train.steps)
    model.to(device or "cpu").eval()
    return cfg, model, step


def evaluate_run(run_dir: str | Path, *, probes: bool = True, tasks: list[str] | None = None,
                 limit: int | None = None, batch_size: int | None = None,
                 num_fewshot: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Evaluate a run and write ``eval.json`` next to its ``summary.json``.

    ``tasks``: lm-evaluation-harness task names, suites (``climb12``) or local task YAML
    files, run in process through :func:`modbench.eval.harness.make_adapter`.
    """
    run = Path(run_dir)
    cfg, model, step = load_run(run)
    device = resolve_device(cfg.train.device)
    model.to(device)
    data = open_data(cfg, progress=progress)
    bs = batch_size or cfg.train.forward_rows()
    n_val = cfg.train.eval_sequences if limit is None else min(limit, cfg.train.eval_sequences)
    val = validation_loss(model, data, n_val, bs, device)
    result: dict[str, Any] = {
        "run": str(run), "method": cfg.model.method, "preset": cfg.preset, "seed": cfg.seed,
        "step": step,
        "validation": {"loss": finite_or_none(val), "ppl": perplexity(val),
                       "sequences": n_val},
        "tasks": {},
    }
    if probes:
        sets = probe_sets(cfg, data, limit or DEFAULT_PROBE_ITEMS)
        for ps in tqdm(sets, desc="probes", disable=not progress, unit="task"):
            result["tasks"][ps.name] = score(model, ps, bs, device)
    if tasks:
        from modbench.eval.harness import make_adapter, run_tasks

        lm = make_adapter(model, data.tokenizer(), batch_size=bs, device=device)
        harness = run_tasks(lm, tasks, limit=limit, num_fewshot=num_fewshot)
        if "climb_avg" in harness:
            result["climb_avg"] = harness.pop("climb_avg")
        result["tasks"].update(harness)
    atomic_write_text(run / EVAL, json.dumps(result, indent=1) + "\n")
    return result


__all__ = ["evaluate_run", "load_run"]
