"""One trainer for every method.

It owns the schedule, clipping, precision, the seed split (init seed -> weights; data seed ->
batch order), metrics, validation, divergence detection and atomic checkpoints. Extras
attach as :class:`Callback` objects, never as edits to the loop.

A fresh start may take its initial weights from another run (``train.init_from``: a run
folder or a checkpoint file; ignored on resume): after the usual initialisation the trainer
loads that checkpoint's model weights, through each method's ``grow_state_dict`` hook (e.g.
TokenFormer growth), and records the source under ``meta.init_from`` in ``config.yaml``.

Run folder::

    DIR/config.yaml         fully resolved config (+ method recipe exceptions, code version)
    DIR/metrics.jsonl       one JSON object per line: train steps and validation points
    DIR/summary.json        written once, at the end (status completed | diverged)
    DIR/checkpoints/last.pt latest checkpoint (model, optimizer, step, metrics offset)
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import platform
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from tqdm.auto import tqdm

import modbench
from modbench.config import ModelConfig, RunConfig, dump_yaml, from_dict
from modbench.errors import ModbenchError
from modbench.eval import probes
from modbench.fsutil import atomic_write_text
from modbench.methods.base import Method, collect_recipe_exceptions
from modbench.model.build import Plan, build_model, count_params, plan
from modbench.model.transformer import lm_loss
from modbench.train.callback import Callback
from modbench.train.checkpoint import load_checkpoint, save_checkpoint
from modbench.train.optim import build_optimizer
from modbench.train.schedule import lr_at

CHECKPOINT = Path("checkpoints") / "last.pt"
LAST_GRAD_NORMS = 10


def code_version() -> dict[str, Any]:
    git = None
    with contextlib.suppress(Exception):
        here = Path(modbench.__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            git = out.stdout.strip()
    return {"modbench": modbench.__version__, "git_commit": git, "torch": str(torch.__version__),
            "python": platform.python_version()}


def open_data(cfg: RunConfig, progress: bool = True) -> Any:
    """Open (preparing the built-in corpus if needed) and check the token data."""
    from modbench.data import builtin_dataset, open_dataset

    if cfg.data.source == "builtin":
        path = builtin_dataset(cfg.model.vocab_size, cfg.train.seq_len, progress=progress)
    else:
        path = Path(cfg.data.source)
        if not path.exists():
            raise ModbenchError(
                f"data source {path} does not exist; prepare it with `modbench data prepare` "
                "or use data.source=builtin"
            )
    ds = open_dataset(path, verify=cfg.data.verify)
    ds.check_vocab(cfg.model.vocab_size)
    if ds.seq_len != cfg.train.seq_len:
        raise ModbenchError(
            f"data at {path} is packed in rows of {ds.seq_len} tokens but train.seq_len is "
            f"{cfg.train.seq_len}; use --set train.seq_len={ds.seq_len} or re-prepare the data"
        )
    if cfg.data.probe_mix:
        from modbench.data.mix import ProbeMixDataset

        return ProbeMixDataset(ds, cfg.data.probe_mix, cfg.data.probe_loss)
    return ds


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModbenchError(f"train.device={name} but CUDA is not available; use cpu or auto")
    return dev


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


@torch.no_grad()
def validation_loss(model: nn.Module, data: Any, n_sequences: int, batch_size: int,
                    device: torch.device, autocast: Any) -> float:
    """Mean next-token loss over the fixed validation set (the first ``n_sequences`` rows)."""
    was_training = model.training
    model.eval()
    total, rows = 0.0, 0
    for batch in data.val_batches(n_sequences, batch_size):
        batch = batch.to(device)
        with autocast():
            loss = lm_loss(model(batch), batch)
        total += loss.item() * batch.shape[0]
        rows += batch.shape[0]
    model.train(was_training)
    return total / max(rows, 1)


class Trainer:
    """Train one run. Construct (which validates everything), then :meth:`run`."""

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: str | Path,
        *,
        resume: bool = False,
        callbacks: Sequence[Callback] = (),
        progress: bool = True,
    ) -> None:
        self.out = Path(out_dir)
        self.resume = resume
        self.progress = progress
        cfg.validate()
        # 1. methods: unknown or conflicting ones fail here, before any file is written
        self.plan: Plan = plan(cfg.model)
        cfg.model.method = self.plan.method
        cfg.recipe_exceptions = collect_recipe_exceptions(self.plan.methods)
        for key, value in cfg.recipe_exceptions.items():
            if not hasattr(cfg.recipe, key):
                raise ValueError(f"recipe exception {key!r} is not a recipe key")
            setattr(cfg.recipe, key, value)
        cfg.recipe.validate()
        self.cfg = cfg
        # 2. the run folder (and the initial weights of a fresh start)
        self._check_out_dir()
        self.init_checkpoint = (None if resume or cfg.train.init_from is None
                                else init_checkpoint(cfg.train.init_from))
        # 3. data (missing, corrupt, wrong vocabulary, wrong packing)
        self.data = open_data(cfg, progress)
        self.device = resolve_device(cfg.train.device)
        self.callbacks: list[Callback] = [cb for m in self.plan.methods for cb in m.callbacks()]
        self.callbacks += list(callbacks)

    # ------------------------------------------------------------------ set-up helpers

    def _check_out_dir(self) -> None:
        if self.resume:
            cfg_file = self.out / "config.yaml"
            if not (self.out / CHECKPOINT).is_file() or not cfg_file.is_file():
                raise ModbenchError(
                    f"cannot resume: {self.out} has no {CHECKPOINT}; run without --resume"
                )
            stored = yaml.safe_load(cfg_file.read_text())
            stored.pop("meta", None)
            now = self.cfg.to_dict()
            diff = sorted(_diff_keys(stored, now))
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

    def _autocast(self) -> Any:
        prec = self.cfg.recipe.precision
        use_bf16 = prec == "bf16" or (prec == "auto" and self.device.type == "cuda")
        if not use_bf16:
            return contextlib.nullcontext
        return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)

    # ----------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        cfg, tc = self.cfg, self.cfg.train
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        autocast = self._autocast()
        created = not self.out.exists()
        try:
            self.model = build_model(cfg.model, seed=cfg.seed, device=self.device)
            self.optimizer = build_optimizer(self.model, cfg.recipe)
            start_step, train_time, metrics_offset = 0, 0.0, 0
            initial_val: float | None = None
            if self.resume:
                state = load_checkpoint(self.out / CHECKPOINT)
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                start_step, train_time = state["step"], state["train_time"]
                metrics_offset, initial_val = state["metrics_offset"], state["initial_val_loss"]
                with open(self.out / "metrics.jsonl", "r+b") as f:
                    f.truncate(metrics_offset)
            else:
                meta_init = None
                if self.init_checkpoint is not None:
                    meta_init = load_initial_weights(self.model, self.plan.methods, cfg.model,
                                                     self.init_checkpoint)
                self.out.mkdir(parents=True, exist_ok=True)
                meta = {"meta": {"code": code_version(), "slots": self.plan.spec.describe(),
                                 "params": count_params(cfg.model)}}
                if meta_init is not None:
                    meta["meta"]["init_from"] = meta_init
                atomic_write_text(self.out / "config.yaml",
                                  dump_yaml(cfg) + "\n" + yaml.safe_dump(meta, sort_keys=False))
        except BaseException:
            if created and not self.resume:
                shutil.rmtree(self.out, ignore_errors=True)
            raise

        model = torch.compile(self.model) if tc.compile else self.model
        params = sum(p.numel() for p in self.model.parameters())
        n_micro = tc.batch_size // (tc.micro_batch_size or tc.batch_size)
        tokens_per_step = tc.batch_size * tc.seq_len
        eval_bs = tc.micro_batch_size or tc.batch_size
        grad_norms: collections.deque[tuple[int, float | None]] = collections.deque(
            maxlen=LAST_GRAD_NORMS)
        status, diverged_at, last_val = "completed", None, None
        self.step = start_step

        metrics = open(self.out / "metrics.jsonl", "a")  # noqa: SIM115 - closed in finally

        def log(rec: dict[str, Any]) -> None:
            metrics.write(json.dumps(rec, allow_nan=False) + "\n")
            metrics.flush()

        probe_sets = probes.probe_sets(cfg, self.data, tc.eval_probes) if tc.eval_probes else []
        last_probes: dict[str, float | None] = {}

        def evaluate(step: int) -> float:
            v = validation_loss(self.model, self.data, tc.eval_sequences, eval_bs, self.device,
                                autocast)
            rec: dict[str, Any] = {"kind": "val", "step": step, "val_loss": _finite_or_none(v),
                                   "val_ppl": _finite_or_none(_ppl(v))}
            if probe_sets and math.isfinite(v):
                last_probes.update({ps.name: probes.score(self.model, ps, eval_bs,
                                                          self.device)["accuracy"]
                                    for ps in probe_sets})
                rec["probes"] = dict(last_probes)
            log(rec)
            for cb in self.callbacks:
                cb.on_eval(self, step, v)
            return v

        def checkpoint(step: int) -> None:
            save_checkpoint(self.out / CHECKPOINT, {
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": step, "train_time": train_time, "metrics_offset": metrics.tell(),
                "initial_val_loss": initial_val, "config": cfg.to_dict(),
            })

        bar = tqdm(total=tc.steps, initial=start_step, disable=not self.progress,
                   desc=f"{cfg.model.method} s{cfg.seed}", unit="step", dynamic_ncols=True)
        try:
            for cb in self.callbacks:
                cb.on_train_start(self)
            if initial_val is None:
                initial_val = last_val = evaluate(0)
            self.model.train()
            for step in range(start_step, tc.steps):
                self.step = step
                t0 = time.perf_counter()
                lr = lr_at(step, cfg.recipe, tc.steps)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                mask = None
                if hasattr(self.data, "train_batch_and_mask"):
                    batch, mask = self.data.train_batch_and_mask(step, tc.batch_size,
                                                                 cfg.data.data_seed)
                else:
                    batch = self.data.train_batch(step, tc.batch_size, cfg.data.data_seed)
                for cb in self.callbacks:
                    cb.on_batch(self, step, batch)
                micros = batch.to(self.device).chunk(n_micro)
                # data.probe_loss=answers: a mask, and one denominator for the whole batch
                count = int(mask.sum()) if mask is not None else 0
                masks = (mask.to(self.device).chunk(n_micro) if mask is not None
                         else (None,) * len(micros))
                loss_sum = 0.0
                for micro, m in zip(micros, masks, strict=True):
                    with autocast():
                        logits = model(micro)
                        loss = (lm_loss(logits, micro) / n_micro if m is None
                                else lm_loss(logits, micro, m, count))
                    loss.backward()
                    loss_sum += loss.item()
                clip = cfg.recipe.grad_clip if cfg.recipe.grad_clip > 0 else float("inf")
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
                grad_norms.append((step + 1, _finite_or_none(grad_norm)))
                if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
                    status, diverged_at = "diverged", step + 1
                    log({"kind": "train", "step": step + 1, "loss": _finite_or_none(loss_sum),
                         "lr": lr, "grad_norm": _finite_or_none(grad_norm), "nonfinite": True})
                    self.optimizer.zero_grad(set_to_none=True)
                    break
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                for cb in self.callbacks:
                    cb.after_optimizer_step(self, step)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                train_time += dt
                rec = {"kind": "train", "step": step + 1, "loss": loss_sum, "lr": lr,
                       "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt,
                       "tokens": (step + 1) * tokens_per_step}
                if (step + 1) % max(tc.log_every, 1) == 0 or step + 1 == tc.steps:
                    log(rec)
                for cb in self.callbacks:
                    cb.on_step_end(self, step, rec)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum:.3f}", lr=f"{lr:.2e}")
                done = step + 1
                if tc.eval_every and done % tc.eval_every == 0 and done != tc.steps:
                    last_val = evaluate(done)
                    if not math.isfinite(last_val):
                        status, diverged_at = "diverged", done
                        break
                if tc.checkpoint_every and done % tc.checkpoint_every == 0 and done != tc.steps:
                    checkpoint(done)
            else:
                last_val = evaluate(tc.steps)
                if not math.isfinite(last_val):
                    status, diverged_at = "diverged", tc.steps
                else:
                    checkpoint(tc.steps)
        finally:
            bar.close()
            metrics.close()

        steps_done = (diverged_at - 1) if diverged_at is not None else tc.steps
        summary = {
            "status": status,
            "method": cfg.model.method,
            "preset": cfg.preset,
            "recipe": cfg.recipe.name,
            "seed": cfg.seed,
            "data_seed": cfg.data.data_seed,
            "steps": steps_done,
            "steps_planned": tc.steps,
            "tokens": steps_done * tokens_per_step,
            "params": params,
            "initial_val_loss": _finite_or_none(initial_val) if initial_val is not None else None,
            "final_val_loss": _finite_or_none(last_val) if status == "completed" else None,
            "val_ppl": _finite_or_none(_ppl(last_val)) if status == "completed" else None,
            **({"final_probes": last_probes} if last_probes and status == "completed" else {}),
            "tokens_per_s": (steps_done - start_step) * tokens_per_step / train_time
            if train_time > 0 else None,
            "diverged_at_step": diverged_at,
            "last_grad_norms": [{"step": s, "grad_norm": g} for s, g in grad_norms],
            "device": str(self.device),
            "train_time_s": train_time,
        }
        atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        for cb in self.callbacks:
            cb.on_train_end(self, summary)
        return summary


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


def _ppl(loss: float | None) -> float:
    if loss is None or not math.isfinite(loss):
        return float("nan")
    return math.exp(min(loss, 700.0))


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


__all__ = ["Callback", "Trainer", "init_checkpoint", "load_initial_weights", "open_data", "train",
           "validation_loss"]
