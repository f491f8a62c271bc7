"""One trainer for every method.

The loop (:meth:`Trainer.run`) owns the schedule, the batches, clipping, metrics, validation,
divergence detection and atomic checkpoints. The numerical work of a step goes through an
engine (:mod:`modbench.train.engine`: one model on one device today; an ensemble or a
distributed run is another engine under the same loop). Everything else attaches as a
:class:`~modbench.runtime.callback.Callback` at the loop's named points: the methods' own
callbacks (nGPT's renormalisation, step-aware norms), probe scoring (``train.eval_probes``),
and the caller's.

The seed split: the init seed fixes the weights, the data seed the batch order, so every
method and every init seed sees the same batch at the same step.

A fresh start may take its initial weights from another run (``train.init_from``: a run
folder or a checkpoint file; ignored on resume): after the usual initialisation the trainer
loads that checkpoint's model weights, through each method's ``grow_state_dict`` hook (e.g.
TokenFormer growth), and records the source under ``meta.init_from`` in ``config.yaml``.

The run folder's files are described in :mod:`modbench.runtime.runfolder` and docs/runs.md.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from tqdm.auto import tqdm

from modbench.config import ModelConfig, RunConfig, dump_yaml, from_dict
from modbench.errors import ModbenchError
from modbench.eval.probes import ProbeScoring
from modbench.fsutil import atomic_write_text
from modbench.methods.base import Method
from modbench.methods.build import plan_run
from modbench.runtime.callback import Callback
from modbench.runtime.checkpoint import load_checkpoint, save_checkpoint
from modbench.runtime.data import open_data
from modbench.runtime.device import autocast_for, resolve_device
from modbench.runtime.loss import finite_or_none, perplexity
from modbench.runtime.runfolder import (
    CHECKPOINT,
    CONFIG,
    METRICS,
    SUMMARY,
    MetricsLog,
    code_version,
)
from modbench.train.engine import Engine, ModelEngine
from modbench.train.optim import build_optimizer
from modbench.train.schedule import lr_at

LAST_GRAD_NORMS = 10


@dataclass
class Progress:
    """Where the run stands: what a checkpoint saves besides the weights, and the outcome."""

    step: int = 0  # optimizer steps done when the loop (re)starts
    train_time: float = 0.0
    initial_val: float | None = None
    last_val: float | None = None
    status: str = "completed"
    diverged_at: int | None = None
    grad_norms: collections.deque[tuple[int, float | None]] = field(
        default_factory=lambda: collections.deque(maxlen=LAST_GRAD_NORMS))
    # sha256 chained over every training batch seen, in step order (None: a resume from a
    # checkpoint that did not record it)
    batches_sha256: str | None = ""

    def diverge(self, at: int) -> None:
        self.status, self.diverged_at = "diverged", at

    def saw(self, batch: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Chain the step's batch (and loss mask) into :attr:`batches_sha256`."""
        if self.batches_sha256 is None:
            return
        h = hashlib.sha256(self.batches_sha256.encode())
        h.update(batch.numpy().tobytes())
        if mask is not None:
            h.update(mask.numpy().tobytes())
        self.batches_sha256 = h.hexdigest()


class Trainer:
    """Train one run. Construct (which validates everything and writes nothing), then
    :meth:`run`. The caller's config is not changed: :attr:`cfg` is the run's own copy, with
    the canonical method string and the methods' recipe exceptions."""

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: str | Path,
        *,
        resume: bool = False,
        callbacks: Sequence[Callback] = (),
        progress: bool = True,
    ) -> None:
        self.out, self.resume, self.progress = Path(out_dir), resume, progress
        # 1. methods: unknown or conflicting ones fail here, before any file is written
        self.cfg, self.plan = plan_run(cfg)
        # 2. the run folder (and the initial weights of a fresh start)
        self._check_out_dir()
        tc = self.cfg.train
        self.init_checkpoint = (None if resume or tc.init_from is None
                                else init_checkpoint(tc.init_from))
        # 3. data (missing, corrupt, wrong vocabulary, wrong packing)
        self.data = open_data(self.cfg, progress)
        self.device = resolve_device(tc.device)
        standard: list[Callback] = [ProbeScoring(tc.eval_probes)] if tc.eval_probes else []
        self.callbacks: list[Callback] = [cb for m in self.plan.methods for cb in m.callbacks()]
        self.callbacks += [*standard, *callbacks]
        self.step = 0

    # ----------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        """Train to ``train.steps`` (or to divergence) and return the summary, which is also
        written to ``summary.json``."""
        tc = self.cfg.train
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        prog, metrics_offset = self._start()
        self.step = prog.step
        self.log = MetricsLog(self.out / METRICS, truncate_at=metrics_offset)
        bar = tqdm(total=tc.steps, initial=prog.step, disable=not self.progress, unit="step",
                   desc=f"{self.cfg.model.method} s{self.cfg.seed}", dynamic_ncols=True)
        try:
            self._emit("on_train_start")
            if prog.initial_val is None:
                prog.initial_val = self._validate(prog, 0)
            for step in range(prog.step, tc.steps):
                self.step, done, t0 = step, step + 1, time.perf_counter()
                lr = lr_at(step, self.cfg.recipe, tc.steps)
                self.engine.set_lr(lr)
                batch, mask = self.data.train_batch_and_mask(step, tc.batch_size,
                                                             self.cfg.data.data_seed)
                prog.saw(batch, mask)
                self._emit("on_batch", step, batch)
                loss = self.engine.backward(batch, mask)
                grad_norm = self.engine.clip_grad_norm(self.cfg.recipe.grad_clip)
                prog.grad_norms.append((done, finite_or_none(grad_norm)))
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    self.engine.discard()
                    self.log.write({"kind": "train", "step": done, "loss": finite_or_none(loss),
                                    "lr": lr, "grad_norm": finite_or_none(grad_norm),
                                    "nonfinite": True})
                    prog.diverge(done)
                    break
                self.engine.update()
                self._emit("after_optimizer_step", step)
                self.engine.synchronize()
                dt = time.perf_counter() - t0
                prog.train_time += dt
                record = {"kind": "train", "step": done, "loss": loss, "lr": lr,
                          "grad_norm": grad_norm, "tokens_per_s": self._tokens(1) / dt,
                          "tokens": self._tokens(done)}
                self._emit("on_step_end", step, record)
                if done % max(tc.log_every, 1) == 0 or done == tc.steps:
                    self.log.write(record)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
                if done == tc.steps:
                    break
                if _every(tc.eval_every, done) and not math.isfinite(self._validate(prog, done)):
                    prog.diverge(done)
                    break
                if _every(tc.checkpoint_every, done):
                    self._checkpoint(prog, done)
            if prog.status == "completed":  # the end: a last validation and checkpoint
                if math.isfinite(self._validate(prog, tc.steps)):
                    self._checkpoint(prog, tc.steps)
                else:
                    prog.diverge(tc.steps)
        finally:
            bar.close()
            self.log.close()
        return self._finish(prog)

    # ------------------------------------------------------------------ the loop's parts

    def _emit(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _tokens(self, steps: int) -> int:
        return steps * self.cfg.train.batch_size * self.cfg.train.seq_len

    def _validate(self, prog: Progress, step: int) -> float:
        """Validation loss at ``step``, logged (with what callbacks add) and remembered."""
        tc = self.cfg.train
        v = self.engine.validation_loss(self.data, tc.eval_sequences,
                                        tc.micro_batch_size or tc.batch_size)
        record = {"kind": "val", "step": step, "val_loss": finite_or_none(v),
                  "val_ppl": perplexity(v)}
        self._emit("on_eval", step, record)
        self.log.write(record)
        prog.last_val = v
        return v

    def _checkpoint(self, prog: Progress, step: int) -> None:
        save_checkpoint(self.out / CHECKPOINT, {
            **self.engine.state_dict(), "step": step, "train_time": prog.train_time,
            "metrics_offset": self.log.tell(), "initial_val_loss": prog.initial_val,
            "config": self.cfg.to_dict(), "batches_sha256": prog.batches_sha256,
            "data_fingerprint": self.data.fingerprint(),
        })

    def _start(self) -> tuple[Progress, int | None]:
        """Build the model, optimizer and engine; then load the checkpoint of a resumed run
        (its progress and the metrics offset to cut back to), or write a fresh run's
        ``config.yaml``. A fresh run whose set-up fails leaves no folder behind."""
        cfg, tc = self.cfg, self.cfg.train
        created = not self.out.exists()
        try:
            self.model: nn.Module = self.plan.build(cfg.seed, self.device)
            self.optimizer = build_optimizer(self.model, cfg.recipe)
            self.engine: Engine = ModelEngine(
                self.model, self.optimizer, self.device,
                autocast_for(cfg.recipe.precision, self.device),
                n_micro=tc.batch_size // (tc.micro_batch_size or tc.batch_size),
                compile=tc.compile)
            if self.resume:
                state = load_checkpoint(self.out / CHECKPOINT)
                self._check_same_data(state.get("data_fingerprint"))
                self.engine.load_state_dict(state)
                prog = Progress(step=state["step"], train_time=state["train_time"],
                                initial_val=state["initial_val_loss"],
                                batches_sha256=state.get("batches_sha256"))
                return prog, state["metrics_offset"]
            meta: dict[str, Any] = {"code": code_version(), "slots": self.plan.spec.describe(),
                                    "params": self.plan.count_params(),
                                    "data": {"fingerprint": self.data.fingerprint()}}
            if self.init_checkpoint is not None:
                meta["init_from"] = load_initial_weights(self.model, self.plan.methods,
                                                         cfg.model, self.init_checkpoint)
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out / CONFIG, dump_yaml(cfg) + "\n"
                              + yaml.safe_dump({"meta": meta}, sort_keys=False))
            return Progress(), None
        except BaseException:
            if created and not self.resume:
                shutil.rmtree(self.out, ignore_errors=True)
            raise

    def _finish(self, prog: Progress) -> dict[str, Any]:
        """The summary: computed, offered to the callbacks, written to ``summary.json``."""
        cfg, tc = self.cfg, self.cfg.train
        completed = prog.status == "completed"
        steps_done = prog.diverged_at - 1 if prog.diverged_at is not None else tc.steps
        ran = steps_done - prog.step  # steps this process trained
        summary = {
            "status": prog.status,
            "method": cfg.model.method,
            "preset": cfg.preset,
            "recipe": cfg.recipe.name,
            "seed": cfg.seed,
            "data_seed": cfg.data.data_seed,
            "steps": steps_done,
            "steps_planned": tc.steps,
            "tokens": self._tokens(steps_done),
            "params": sum(p.numel() for p in self.model.parameters()),
            "initial_val_loss": finite_or_none(prog.initial_val),
            "final_val_loss": finite_or_none(prog.last_val) if completed else None,
            "val_ppl": perplexity(prog.last_val) if completed else None,
            "tokens_per_s": self._tokens(ran) / prog.train_time if prog.train_time > 0 else None,
            "diverged_at_step": prog.diverged_at,
            "last_grad_norms": [{"step": s, "grad_norm": g} for s, g in prog.grad_norms],
            "device": str(self.device),
            "train_time_s": prog.train_time,
            "batches_sha256": prog.batches_sha256,
        }
        self._emit("on_train_end", summary)
        atomic_write_text(self.out / SUMMARY, json.dumps(summary, indent=2) + "\n")
        return summary

    # ------------------------------------------------------------------ set-up checks

    def _check_same_data(self, recorded: str | None) -> None:
        """A resumed run must read the tokens it started on (old checkpoints: not recorded)."""
        now = self.data.fingerprint()
        if recorded is not None and recorded != now:
            raise ModbenchError(
                f"cannot resume {self.out}: the data at {self.data.path} changed since the run "
                f"started (fingerprint {recorded[:12]} then, {now[:12]} now); resume on the "
                "data it started with, or start a new run"
            )

    def _check_out_dir(self) -> None:
        if self.resume:
            cfg_file = self.out / CONFIG
            if not (self.out / CHECKPOINT).is_file() or not cfg_file.is_file():
                raise ModbenchError(
                    f"cannot resume: {self.out} has no {CHECKPOINT}; run without --resume"
                )
            stored = yaml.safe_load(cfg_file.read_text())
            stored.pop("meta", None)
            diff = sorted(_diff_keys(stored, self.cfg.to_dict()))
            if diff:
                raise ModbenchError(
                    f"cannot resume {self.out}: the config differs from its config.yaml in "
                    f"{', '.join(diff)}; repeat the original command with --resume"
                )
        elif self.out.exists() and any(self.out.iterdir()):
            raise ModbenchError(
                f"run folder {self.out} already exists and is not empty; use --resume to "
                "continue it or choose another --out"
            )


def _every(k: int, done: int) -> bool:
    return bool(k) and done % k == 0


def init_checkpoint(source: str | Path) -> Path:
    """The checkpoint file that ``train.init_from`` names: the file itself, or a run folder's
    ``checkpoints/last.pt``."""
    path = Path(str(source))
    if path.is_dir() and (path / CHECKPOINT).is_file():
        return path / CHECKPOINT
    if path.is_file():
        return path
    raise ModbenchError(
        f"train.init_from={source} is neither a checkpoint file nor a run folder with "
        f"{CHECKPOINT}; give the folder of a finished run"
    )


def load_initial_weights(model: nn.Module, methods: Sequence[Method], new_cfg: ModelConfig,
                         path: Path) -> dict[str, Any]:
    """Load the model weights of checkpoint ``path`` into ``model`` (a fresh start from
    another run's weights). Each method's ``grow_state_dict`` hook may first map them onto
    the new shapes; then names and shapes must match the model exactly. Returns what the
    run's config records under ``meta.init_from``."""
    state = load_checkpoint(path)
    if "model" not in state or "config" not in state:
        raise ModbenchError(f"{path} is not a modbench training checkpoint (no model weights "
                            "or config); give a run folder written by `modbench train`")
    old_cfg = from_dict(state["config"]).model
    weights: dict[str, Any] = state["model"]
    target = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for m in methods:
        weights = m.grow_state_dict(weights, old_cfg, new_cfg, target)
    missing = sorted(set(target) - set(weights))
    extra = sorted(set(weights) - set(target))
    if missing or extra:
        which = (f"lacks parameter '{missing[0]}'" if missing
                 else f"has parameter '{extra[0]}' that this model does not")
        raise ModbenchError(
            f"cannot initialise from {path}: it {which} (method {old_cfg.method!r} there, "
            f"{new_cfg.method!r} here); initialise from a run of the same architecture"
        )
    for k, v in target.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise ModbenchError(
                f"cannot initialise from {path}: parameter '{k}' has shape "
                f"{tuple(weights[k].shape)} there and {tuple(v.shape)} here; only a method "
                "with a growth rule (tokenformer slots) may change shapes"
            )
    model.load_state_dict(weights)
    return {"checkpoint": str(path), "step": state.get("step"), "method": old_cfg.method}


def _diff_keys(a: Any, b: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")


def train(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Train one run and return its summary (also written to ``out_dir/summary.json``)."""
    return Trainer(cfg, out_dir, resume=resume, callbacks=callbacks, progress=progress).run()


__all__ = ["Callback", "Trainer", "init_checkpoint", "load_initial_weights", "train"]
