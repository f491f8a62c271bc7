"""``modbench bench``: how fast one training step is, measured side by side in one process.

Two tables, each from interleaved rounds (every round visits each case once, in a fresh
random order, and times ``steps`` steps of it; the tables report medians over all rounds),
because the machines this runs on are shared and noisy:

- **modbench against Hugging Face.** The modbench baseline and ``transformers``'
  ``LlamaForCausalLM`` built with the identical shape (width, depth, heads and KV heads,
  SwiGLU width, vocabulary, tied embeddings, RMSNorm eps, RoPE theta; SDPA attention), the
  same batch of random tokens, AdamW with the same settings, gradient clipping at 1.0, and
  each library's own next-token loss (modbench's: what its trainer backpropagates,
  :func:`trainer_loss`; Llama's ``labels=`` path).
  Reported: tokens/s of each and their ratio. ``transformers`` is an optional extra.
- **Method overhead.** Each method's median step time over the baseline's, at one preset.

One step is the trainer's: forward, loss, backward, clipping, AdamW update. On CUDA, steps are
timed between synchronisations and the tables add model FLOPs utilisation (the analytic
training FLOPs per token of :mod:`modbench.measure.flops` — 3 x the forward's matrix
multiplications, attention scores included — times tokens/s over the device's dense bf16 peak)
and step memory (the peak a step allocates above the resident weights and optimizer state).
On the CPU the memory column is the activation memory a step keeps for backward
(:func:`modbench.measure.memory.saved_activation_bytes`), which does not depend on timing.

Defaults by device. On the CPU: fp32, eager, the preset's own batch (what the CPU tables in
BENCHMARKS.md were measured with). On CUDA: bf16 autocast and ``torch.compile`` (how the
trainer runs there: ``recipe.precision=auto``, ``train.compile=auto``), the method table on one
micro-batch (the memory plan's, :mod:`modbench.measure.plan`, that every method of the table
fits beside the others' resident state: :func:`micro_batch_for`), and MFU against the exact
GPU model's peak (:func:`modbench.runtime.gpus.peak_tflops`: an H100 PCIe is not an H100
SXM). Either may be
chosen on either device (``--dtype``, ``--compile``/``--no-compile``); the report says which
ran.

**The trainer's step** (:func:`trainer_step`; on CUDA by default, ``--trainer`` on the CPU):
the bare step above leaves out what a run does around it. This runs ``modbench train`` (a
fresh process, ``python -m modbench.train``) at the bench shape on the built-in corpus packed
for the preset's vocabulary (:func:`bench_data`), times its steady steps from its own
``metrics.jsonl`` (batch prefetch and copy, the windowed read-backs of losses and gradient
norms, logging) after the first read-back window (compilation), times one validation pass
from when its records appear, and charges that validation at the preset's schedule
(``eval_sequences`` every ``eval_every`` steps). Periodic checkpoints are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from modbench.config import ModelConfig, resolve
from modbench.errors import ModbenchError
from modbench.measure.flops import flop_report
from modbench.measure.memory import saved_activation_bytes
from modbench.methods.build import plan
from modbench.model.attention import ExplicitKernel
from modbench.runtime import loss as loss_mod
from modbench.runtime.device import fused_kernel
from modbench.runtime.gpus import detect, device_memory_bytes, lookup, peak_tflops
from modbench.runtime.loss import lm_loss

# The dense bf16 peaks (TFLOP/s) by the short names ``modbench study run --gpu-type`` takes
# (modbench.study.plan), from the catalogue of exact models (modbench.runtime.gpus: the SXM
# parts); MFU here divides by the detected model's own peak (peak_tflops), not by these.
PEAK_BF16_TFLOPS = {name: lookup(key).peak_bf16_tflops for name, key in (
    ("H100", "h100-80gb"), ("H200", "h200"), ("A100", "a100-80gb"), ("B200", "b200"))}
# The shapes of the Hugging Face comparison, and the batch each runs on the CPU (the presets'
# own batches of 512 rows are GPU batches): rows x tokens.
HF_PRESETS = ("cpu-small", "llama-60m")
CPU_BATCH = {"cpu-small": (16, 128), "llama-60m": (4, 256)}
GPU_BATCH = {"cpu-small": (64, 128), "llama-60m": (32, 256)}
# Tokens per micro-batch of the method table on CUDA until the memory plan gives one: 32 rows
# of 256 tokens (llama presets), 8 of 1024 (climb presets; ~35 GB at climb-1.2b in bf16 with
# its AdamW state), which fit an 80 GB GPU at every preset up to climb-1.2b.
GPU_TOKENS = 8192
# The trainer's read-back window on an accelerator (modbench.train.trainer.SYNC_EVERY; the CPU
# reads back every step): the trainer's first window holds compilation, and is not timed.
SYNC_WINDOW = 16
# The default method table: one or two methods per category (``--methods all``: every one).
DEFAULT_METHODS = ("baseline", "qknorm", "softpick", "geglu", "post_ln", "ln_scaling",
                   "layerscale", "comt")


def is_explicit(model: nn.Module) -> bool:
    """True when attention materialises the T x T scores outside a fused kernel (the method
    table's aim is looser for these)."""
    from modbench.methods.selective import SelectiveKernel
    from modbench.methods.softcap import HardCapKernel

    return any(isinstance(m, SelectiveKernel)
               or (isinstance(m, ExplicitKernel) and not isinstance(m, HardCapKernel))
               for m in model.modules())


@dataclass
class Case:
    """One model, its optimizer and a fixed batch; :meth:`step` times one training step."""

    label: str
    model: nn.Module
    loss: Callable[[], torch.Tensor]  # forward and loss on the fixed batch
    device: torch.device
    tokens: int  # per step
    train_flops_per_token: float
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    times: list[float] = field(default_factory=list)
    step_gib: float | None = None  # CUDA: peak allocation a step adds

    def __post_init__(self) -> None:
        params = list(self.model.parameters())  # the trainer's kernel, for both libraries
        self.opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                     fused=fused_kernel(params))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        with self.autocast():
            loss = self.loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0


def _batch(vocab: int, rows: int, seq: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, seq), generator=g).to(device)


def _autocast(device: torch.device, dtype: str) -> Callable[[], Any]:
    if dtype == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def modbench_case(method: str, preset: str, rows: int, seq: int, device: torch.device, *,
                  dtype: str = "fp32", compile: bool = False, seed: int = 0,
                  label: str | None = None) -> Case:
    """The modbench model of ``method`` at ``preset``'s shape, on ``rows`` x ``seq`` tokens."""
    cfg = resolve(preset, method=method).model
    cfg.max_seq_len = max(cfg.max_seq_len, seq)
    model = plan(cfg).build(seed, device)
    fn = torch.compile(model) if compile else model
    idx = _batch(cfg.vocab_size, rows, seq, device, seed)
    return Case(label or method, model, lambda: trainer_loss(fn, idx), device, rows * seq,
                flop_report(cfg, seq).train_flops_per_token, _autocast(device, dtype))


def trainer_loss(fn: Callable[..., Any], idx: torch.Tensor) -> torch.Tensor:
    """The objective the trainer's engine backpropagates on one micro-batch: the model's own
    summed loss (``runtime.loss.micro_loss``, no full logits) where this tree has it, else
    ``lm_loss`` of the logits; plus the cores' auxiliary terms (0 when none adds any)."""
    micro = getattr(loss_mod, "micro_loss", None)
    if micro is not None:
        lm, aux = micro(fn, idx, None, 0, n_micro=1)
        return lm + aux
    logits, aux = fn(idx, with_aux=True)
    return lm_loss(logits, idx) + aux


def hf_llama(cfg: ModelConfig) -> nn.Module:
    """``LlamaForCausalLM`` with the baseline's shape (raises a one-line error, with the
    install command, when ``transformers`` is missing)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ModbenchError("the Hugging Face comparison needs transformers; install it with "
                            "`pip install 'modbench[eval]'` or run `modbench bench --no-hf`"
                            ) from e
    hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                     intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
                     num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
                     rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                     tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
                     attention_bias=False, mlp_bias=False, hidden_act="silu",
                     attn_implementation="sdpa")
    return LlamaForCausalLM(hc)


def hf_case(preset: str, rows: int, seq: int, device: torch.device, *, dtype: str = "fp32",
            compile: bool = False, seed: int = 0) -> Case:
    cfg = resolve(preset).model
    cfg.max_seq_len = max(cfg.max_seq_len, seq)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf_llama(cfg).to(device)
    model.train()
    fn = torch.compile(model) if compile else model
    idx = _batch(cfg.vocab_size, rows, seq, device, seed)
    return Case(f"hf:{preset}", model, lambda: fn(input_ids=idx, labels=idx).loss, device,
                rows * seq, flop_report(cfg, seq).train_flops_per_token,
                _autocast(device, dtype))


def interleave(cases: list[Case], rounds: int, steps: int, *, warmup: int = 1, seed: int = 0,
               progress: bool = True, desc: str = "bench") -> None:
    """Warm every case up, then ``rounds`` rounds in a fresh random order each, timing
    ``steps`` steps of every case (into ``case.times``); on CUDA also each case's peak step
    memory."""
    for c in cases:  # allocator, kernels, first-call overheads, compilation
        for _ in range(warmup):
            c.step()
    rng = random.Random(seed)
    for _ in tqdm(range(rounds), desc=desc, unit="round", disable=not progress):
        order = cases[:]
        rng.shuffle(order)
        for c in order:
            cuda = c.device.type == "cuda"
            if cuda:
                resident = torch.cuda.memory_allocated(c.device)
                torch.cuda.reset_peak_memory_stats(c.device)
            c.times += [c.step() for _ in range(steps)]
            if cuda:
                extra = (torch.cuda.max_memory_allocated(c.device) - resident) / 2**30
                c.step_gib = max(c.step_gib or 0.0, extra)


def _measures(c: Case, peak: float | None) -> dict[str, Any]:
    med = statistics.median(c.times)
    out: dict[str, Any] = {"median_ms": 1e3 * med, "tokens_per_s": c.tokens / med}
    if peak:
        out["mfu"] = c.train_flops_per_token * c.tokens / med / (peak * 1e12)
    if c.step_gib is not None:
        out["step_gib"] = c.step_gib
    return out


def compare_hf(presets: Iterable[str], device: torch.device, *, rounds: int = 5,
               steps: int = 2, dtype: str = "fp32", compile: bool = False, seed: int = 0,
               batch: tuple[int, int] | None = None, progress: bool = True,
               ) -> list[dict[str, Any]]:
    """For each preset, the modbench baseline and ``LlamaForCausalLM`` of the same shape,
    interleaved: tokens/s of each and modbench's over Hugging Face's."""
    peak = peak_tflops(device)
    out = []
    for preset in presets:
        rows, seq = batch or (GPU_BATCH if device.type == "cuda" else CPU_BATCH).get(
            preset, (resolve(preset).train.batch_size, resolve(preset).train.seq_len))
        ours = modbench_case("baseline", preset, rows, seq, device, dtype=dtype,
                             compile=compile, seed=seed, label=f"modbench:{preset}")
        theirs = hf_case(preset, rows, seq, device, dtype=dtype, compile=compile, seed=seed)
        n_ours = sum(p.numel() for p in ours.model.parameters())
        n_theirs = sum(p.numel() for p in theirs.model.parameters())
        if n_ours != n_theirs:
            raise ModbenchError(f"bench: the Llama of {preset} has {n_theirs:,} parameters, "
                                f"modbench {n_ours:,}; the shapes differ (a bug: report it)")
        interleave([ours, theirs], rounds, steps, seed=seed, progress=progress,
                   desc=f"vs Hugging Face, {preset}")
        m, h = _measures(ours, peak), _measures(theirs, peak)
        out.append({"preset": preset, "batch": [rows, seq], "params": n_ours,
                    "modbench": m, "hf": h, "ratio": m["tokens_per_s"] / h["tokens_per_s"]})
    return out


def micro_batch_for(preset: str, seq: int, device: torch.device,
                    methods: Iterable[str] = ("baseline",)) -> tuple[int, str]:
    """Rows of the method table's micro-batch on ``device`` and where the number came from:
    the smallest of the memory plan's choices for ``methods`` at ``preset`` (``"plan"``), or
    :data:`GPU_TOKENS` tokens a micro-batch (``"fixed"``) where no plan is available.

    The table keeps every method's model and AdamW state resident at once (gradients are
    freed after each step), so each method is planned against the device less the others'
    fp32 weights and two moments (12 bytes a parameter): every case fits at the chosen size.
    Planning traces each method on the CPU (seconds each)."""
    try:
        from modbench.measure import plan as memory_plan
    except ImportError:
        return max(1, GPU_TOKENS // seq), "fixed"
    known = detect(device)  # the exact model where known: its own memory and type
    total = known.memory_bytes if known is not None else device_memory_bytes(device)
    cfgs = {m: resolve(preset, method=m) for m in dict.fromkeys(methods)}
    resident = {m: 12 * flop_report(c.model).params for m, c in cfgs.items()}
    rows = []
    for m, cfg in cfgs.items():
        budget = total - (sum(resident.values()) - resident[m])
        if budget <= 0:
            raise ModbenchError(f"bench: the {len(cfgs)} methods' weights and AdamW state do "
                                f"not fit {total / 1e9:.0f} GB together at {preset}; time "
                                "fewer methods (--methods) or a smaller preset")
        target: Any = (dataclasses.replace(known, memory_gb=budget / 1e9)
                       if known is not None else budget)
        rows.append(int(memory_plan.choose_micro_batch(cfg, target).micro_batch))
    return min(rows), "plan"


def bench_data(vocab_size: int, seq_len: int, progress: bool = False) -> Path:
    """A prepared dataset for the trainer at any preset's shape (cached): the built-in corpus
    through the built-in tokenizer of ``min(vocab_size, 4096)`` tokens, packed in rows of
    ``seq_len`` and recorded for a model of ``vocab_size`` (the trainer accepts the padded
    vocabulary; the ids above the tokenizer's are never drawn, the step's work is the
    model's). 10 % of the documents are held out, so long rows still give a few validation
    batches."""
    from modbench.data import (
        PrepareSettings,
        builtin_documents,
        builtin_tokenizer,
        prepare_dataset,
    )
    from modbench.data._fs import cache_dir
    from modbench.data.corpus import builtin_corpus_fingerprint

    tok_vocab = min(vocab_size, 4096)
    name = f"bench-v{tok_vocab}-m{vocab_size}-s{seq_len}-{builtin_corpus_fingerprint()[:10]}"
    target = cache_dir() / "data" / name
    if (target / "metadata.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        prepare_dataset(
            builtin_documents(), builtin_tokenizer(tok_vocab), work / "d",
            PrepareSettings(seq_len=seq_len, val_fraction=0.1, progress=progress,
                            model_vocab_size=vocab_size if vocab_size > tok_vocab else None),
        )
        try:
            os.replace(work / "d", target)
        except OSError:  # another process put its copy there first: use that one
            if not (target / "metadata.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _appearances(samples: list[tuple[float, int]], text: str) -> list[tuple[float, dict[str, Any]]]:
    """Each line of a metrics log with the first time its whole line was seen on disk
    (``samples``: (time, file size) as polled while the run wrote it)."""
    out, end = [], 0
    for line in text.splitlines(keepends=True):
        end += len(line.encode())
        if line.strip():
            seen = next((t for t, size in samples if size >= end), samples[-1][0])
            out.append((seen, json.loads(line)))
    return out


def trainer_step(preset: str, method: str, rows: int, seq: int, device: torch.device, *,
                 dtype: str, compile: bool, steps: int = 0, seed: int = 0, threads: int = 0,
                 timeout: float = 1800.0) -> dict[str, Any]:
    """Time the trainer's own step at the bench shape: ``modbench train`` in a fresh process
    on :func:`bench_data`, ``rows`` x ``seq`` tokens a step in one micro-batch, the bench's
    precision and compilation. ``steps`` timed steps (default: 2 read-back windows on CUDA,
    4 steps on the CPU) after a first window that is not timed; one validation of the
    preset's ``eval_sequences`` (as many as the data holds) midway, timed from when its record
    appears on disk. Returns the steady step (the trainer's own per-window times from
    ``metrics.jsonl``), the validation pass and the step with validation charged at the
    preset's ``eval_every`` (a pass of fewer sequences scaled to ``eval_sequences``)."""
    window = SYNC_WINDOW if device.type != "cpu" else 1
    timed = steps or (2 * window if device.type != "cpu" else 4)
    if timed % window:
        raise ModbenchError(f"--trainer-steps must be a multiple of {window} on {device.type} "
                            f"(the trainer's read-back window), got {timed}")
    total = window + timed
    val_at = window * (1 + max(1, timed // window // 2))  # a window boundary inside the run
    run_cfg = resolve(preset, method=method)
    from modbench.data import open_dataset

    data = bench_data(run_cfg.model.vocab_size, seq)
    val_rows = min(run_cfg.train.eval_sequences, open_dataset(data).num_sequences("val"))
    sets = {"train.batch_size": rows, "train.micro_batch_size": "null", "train.seq_len": seq,
            "model.max_seq_len": max(run_cfg.model.max_seq_len, seq),
            "train.eval_every": val_at, "train.eval_sequences": run_cfg.train.eval_sequences,
            "train.checkpoint_every": 0, "train.log_every": 1, "train.device": str(device),
            "train.compile": "true" if compile else "false", "train.threads": threads,
            "recipe.precision": dtype, "data.source": str(data), "train.stall_margin": 0}
    with tempfile.TemporaryDirectory(prefix="modbench-bench-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "modbench.train", "--preset", preset, "--method", method,
               "--seed", str(seed), "--steps", str(total), "--out", str(out), "--no-progress",
               *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
        samples: list[tuple[float, int]] = []
        metrics, last = out / "metrics.jsonl", -1
        with open(Path(tmp) / "log", "w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            t_end = time.perf_counter() + timeout
            while proc.poll() is None:
                if time.perf_counter() > t_end:
                    proc.kill()
                    proc.wait()
                    raise ModbenchError(f"bench: the trainer at {preset} ran past {timeout:.0f}"
                                        " s; lower --trainer-steps or run --no-trainer")
                try:
                    size = metrics.stat().st_size
                except FileNotFoundError:
                    size = -1
                if size != last:
                    samples.append((time.perf_counter(), size))
                    last = size
                time.sleep(0.002)
            log.seek(0)
            tail = log.read().strip().splitlines()
        if proc.returncode != 0 or not metrics.is_file():
            raise ModbenchError(f"bench: the trainer at {preset} exited with code "
                                f"{proc.returncode}: {tail[-1] if tail else 'no output'}")
        samples.append((time.perf_counter(), metrics.stat().st_size))
        records = _appearances(samples, metrics.read_text())
    train = {r["step"]: r for _, r in records if r["kind"] == "train"}
    seen = {(r["kind"], r["step"]): t for t, r in records}
    dts = [rows * seq / train[k]["tokens_per_s"] for k in range(window + 1, total + 1)]
    step_s = statistics.fmean(dts)
    val_s = seen[("val", val_at)] - seen[("train", val_at)]
    per_step = (val_s * run_cfg.train.eval_sequences / max(val_rows, 1)
                / max(run_cfg.train.eval_every, 1)) if run_cfg.train.eval_every else 0.0
    return {"preset": preset, "method": method, "batch": [rows, seq], "steps_timed": timed,
            "step_ms": 1e3 * step_s, "validation_s": val_s, "validation_sequences": val_rows,
            "eval_every": run_cfg.train.eval_every,
            "eval_sequences": run_cfg.train.eval_sequences,
            "step_with_validation_ms": 1e3 * (step_s + per_step),
            "tokens_per_s": rows * seq / (step_s + per_step),
            "train_flops_per_token": flop_report(resolve(preset, method=method).model,
                                                 seq).train_flops_per_token}


def method_overhead(methods: Iterable[str], preset: str, device: torch.device, *,
                    rounds: int = 5, steps: int = 2, dtype: str = "fp32",
                    compile: bool = False, seed: int = 0, batch: tuple[int, int] | None = None,
                    progress: bool = True) -> list[dict[str, Any]]:
    """Each method's median step time over the baseline's, interleaved, at ``preset``;
    the aim is 1.15x for fused-attention methods and 2x for explicit-score ones."""
    names = list(dict.fromkeys(["baseline", *methods]))
    rows, seq = batch or table_batch(preset, device, methods=names)[:2]
    cases = [modbench_case(m, preset, rows, seq, device, dtype=dtype, compile=compile,
                           seed=seed) for m in names]
    interleave(cases, rounds, steps, seed=seed, progress=progress, desc=f"methods, {preset}")
    peak = peak_tflops(device)
    base = statistics.median(cases[0].times)
    out = []
    for c in cases:
        explicit = is_explicit(c.model)
        med = statistics.median(c.times)
        row = {"method": c.label, "path": "explicit" if explicit else "fast",
               **_measures(c, peak), "ratio": med / base, "aim": 2.0 if explicit else 1.15}
        row["within_aim"] = row["ratio"] <= row["aim"]
        if device.type == "cpu":
            cfg = resolve(preset, method=c.label).model
            idx = _batch(cfg.vocab_size, rows, seq, device, seed)
            row["activation_mib"] = saved_activation_bytes(c.model, idx) / 2**20
        out.append(row)
    return out


def table_batch(preset: str, device: torch.device, micro_batch: int = 0,
                methods: Iterable[str] = ("baseline",)) -> tuple[int, int, str]:
    """Rows, tokens and their source for the method table (and the trainer's step): the
    preset's own batch on the CPU (``"preset"``), one micro-batch on CUDA that every one of
    ``methods`` fits (the memory plan's or a fixed one: :func:`micro_batch_for`), or
    ``micro_batch`` rows (``"given"``)."""
    tc = resolve(preset).train
    if micro_batch:
        return micro_batch, tc.seq_len, "given"
    if device.type == "cpu":
        return tc.batch_size, tc.seq_len, "preset"
    rows, source = micro_batch_for(preset, tc.seq_len, device, methods)
    return rows, tc.seq_len, source


@dataclass
class BenchReport:
    device: str
    torch: str
    threads: int
    dtype: str
    compiled: bool
    rounds: int
    steps: int
    hf: list[dict[str, Any]]
    methods: list[dict[str, Any]]
    methods_preset: str
    peak_tflops: float | None
    gpu: str | None = None  # the catalogue model the peak is of (modbench.runtime.gpus)
    batch: list[int] | None = None  # rows x tokens of the method table and the trainer
    batch_source: str | None = None  # preset | plan | fixed | given
    trainer: dict[str, Any] | None = None  # trainer_step's figures (and the bare step's)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_precision(device: torch.device, dtype: str = "auto",
                      compile: bool | None = None) -> tuple[str, bool]:
    """``auto`` dtype and unset compilation by device: bf16 and compiled on CUDA (how the
    trainer runs there), fp32 and eager on the CPU."""
    if dtype not in ("auto", "fp32", "bf16"):
        raise ModbenchError(f"--dtype must be auto, fp32 or bf16, got {dtype!r}")
    gpu = device.type == "cuda"
    return (("bf16" if gpu else "fp32") if dtype == "auto" else dtype,
            gpu if compile is None else compile)


def run_bench(*, device: str = "cpu", hf_presets: Iterable[str] | None = HF_PRESETS,
              methods: Iterable[str] | None = DEFAULT_METHODS, preset: str = "cpu-small",
              rounds: int = 5, steps: int = 2, dtype: str = "auto",
              compile: bool | None = None, seed: int = 0, threads: int = 0,
              progress: bool = True, micro_batch: int = 0, trainer: bool | None = None,
              trainer_steps: int = 0) -> BenchReport:
    """Both tables (either may be skipped with None), and the trainer's step at the method
    table's shape (``trainer``; None: on CUDA only). ``dtype`` auto and ``compile`` None:
    :func:`resolve_precision`."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModbenchError(f"--device must be cpu, cuda or cuda:N, got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModbenchError(f"--device {device} but CUDA is not available; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ModbenchError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    dtype, compile = resolve_precision(dev, dtype, compile)
    if rounds < 1 or steps < 1:
        raise ModbenchError("--rounds and --steps must be at least 1")
    if micro_batch < 0 or trainer_steps < 0:
        raise ModbenchError("--micro-batch and --trainer-steps must be 0 (automatic) or "
                            "positive")
    resolve(preset)  # an unknown preset fails here, before anything runs
    if threads:
        torch.set_num_threads(threads)
    methods = list(dict.fromkeys(["baseline", *methods])) if methods else None
    rows, seq, source = table_batch(preset, dev, micro_batch, methods or ("baseline",))
    peak = peak_tflops(dev)
    timed = None
    # the trainer first, in its own process: on a GPU the micro-batch is planned to fill the
    # device, and this process's caching allocator would otherwise still hold the bare steps'
    if trainer if trainer is not None else dev.type == "cuda":
        timed = trainer_step(preset, "baseline", rows, seq, dev, dtype=dtype, compile=compile,
                             steps=trainer_steps, seed=seed, threads=threads)
        if peak:
            timed["mfu"] = (timed["train_flops_per_token"] * timed["tokens_per_s"]
                            / (peak * 1e12))
    hf = compare_hf(hf_presets, dev, rounds=rounds, steps=steps, dtype=dtype,
                    compile=compile, seed=seed, progress=progress) if hf_presets else []
    table = method_overhead(methods, preset, dev, rounds=rounds, steps=steps, dtype=dtype,
                            compile=compile, seed=seed, batch=(rows, seq),
                            progress=progress) if methods else []
    if timed is not None and table:
        bare = table[0]
        timed["bare_tokens_per_s"] = bare["tokens_per_s"]
        timed["bare_step_ms"] = bare["median_ms"]
        if "mfu" in bare:
            timed["bare_mfu"] = bare["mfu"]
        timed["trainer_over_bare"] = timed["step_with_validation_ms"] / bare["median_ms"]
    model = detect(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return BenchReport(name, str(torch.__version__), torch.get_num_threads(), dtype, compile,
                       rounds, steps, hf, table, preset, peak,
                       gpu=model.key if model is not None and dev.type == "cuda" else None,
                       batch=[rows, seq], batch_source=source, trainer=timed)


def markdown(r: BenchReport) -> str:
    """The report as markdown tables (what BENCHMARKS.md records)."""
    where = r.device if r.device != "cpu" else f"CPU, {r.threads} threads"
    precision = "bf16 autocast" if r.dtype == "bf16" else "fp32"
    head = (f"{where}, torch {r.torch}, {precision}, "
            f"{'torch.compile' if r.compiled else 'eager'}, "
            f"{r.rounds} rounds x {r.steps} steps, medians"
            + (f", MFU against {r.peak_tflops:g} TFLOP/s ({r.gpu})" if r.peak_tflops else ""))
    lines = [head, ""]
    mfu = r.peak_tflops is not None
    if r.hf:
        lines += ["| shape | batch | params | modbench tokens/s | HF Llama tokens/s | "
                  "modbench / HF |" + (" MFU modbench | MFU HF |" if mfu else ""),
                  "|---|---|---:|---:|---:|---:|" + ("---:|---:|" if mfu else "")]
        for h in r.hf:
            cells = (f" {100 * h['modbench']['mfu']:.1f} % | {100 * h['hf']['mfu']:.1f} % |"
                     if mfu else "")
            lines.append(f"| {h['preset']} | {h['batch'][0]} x {h['batch'][1]} | "
                         f"{h['params']:,} | {h['modbench']['tokens_per_s']:,.0f} | "
                         f"{h['hf']['tokens_per_s']:,.0f} | {h['ratio']:.2f}x |" + cells)
        lines.append("")
    if r.methods:
        mem = "activation_mib" if "activation_mib" in r.methods[0] else "step_gib"
        mem_head = "activations (MiB)" if mem == "activation_mib" else "step memory (GiB)"
        shape = (f", {r.batch[0]} x {r.batch[1]} tokens a step ({r.batch_source})"
                 if r.batch else "")
        lines += [f"Method overhead at {r.methods_preset}{shape}:", "",
                  "| method | path | median step (ms) | vs baseline | aim | within | tokens/s | "
                  + mem_head + " |" + (" MFU |" if mfu else ""),
                  "|---|---|---:|---:|---:|---|---:|---:|" + ("---:|" if mfu else "")]
        for m in r.methods:
            mem_cell = f"{m[mem]:.1f}" if mem in m else "–"
            lines.append(f"| `{m['method']}` | {m['path']} | {m['median_ms']:.1f} | "
                         f"{m['ratio']:.2f}x | {m['aim']:.2f}x | "
                         f"{'yes' if m['within_aim'] else 'no'} | {m['tokens_per_s']:,.0f} | "
                         f"{mem_cell} |" + (f" {100 * m['mfu']:.1f} % |" if mfu else ""))
        lines.append("")
    if r.trainer:
        t = r.trainer
        lines += [f"The trainer's step at {t['preset']} ({t['batch'][0]} x {t['batch'][1]}; "
                  f"`modbench train`, {t['steps_timed']} steps after its first read-back "
                  f"window; one validation of {t['validation_sequences']} sequences charged "
                  f"as {t['eval_sequences']} every {t['eval_every']} steps):", "",
                  "| step | ms | tokens/s |" + (" MFU |" if mfu else ""),
                  "|---|---:|---:|" + ("---:|" if mfu else "")]
        if "bare_step_ms" in t:
            lines.append(f"| bare (the table's baseline) | {t['bare_step_ms']:.1f} | "
                         f"{t['bare_tokens_per_s']:,.0f} |"
                         + (f" {100 * t['bare_mfu']:.1f} % |" if mfu and "bare_mfu" in t
                            else (" – |" if mfu else "")))
        lines.append(f"| trainer, without validation | {t['step_ms']:.1f} | "
                     f"{t['batch'][0] * t['batch'][1] / (t['step_ms'] / 1e3):,.0f} |"
                     + (" – |" if mfu else ""))
        lines.append(f"| trainer, validation charged | {t['step_with_validation_ms']:.1f} | "
                     f"{t['tokens_per_s']:,.0f} |"
                     + (f" {100 * t['mfu']:.1f} % |" if mfu and "mfu" in t else
                        (" – |" if mfu else "")))
        if "trainer_over_bare" in t:
            lines += ["", f"Trainer step / bare step: {t['trainer_over_bare']:.2f}x "
                      f"(validation pass {t['validation_s']:.2f} s)."]
    return "\n".join(lines).rstrip()
