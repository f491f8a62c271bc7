"""``modbench bench``: how fast one training step is, measured side by side in one process.

Two tables, each from interleaved rounds (every round visits each case once, in a fresh
random order, and times ``steps`` steps of it; the tables report medians over all rounds),
because the machines this runs on are shared and noisy:

- **modbench against Hugging Face.** The modbench baseline and ``transformers``'
  ``LlamaForCausalLM`` built with the identical shape (width, depth, heads and KV heads,
  SwiGLU width, vocabulary, tied embeddings, RMSNorm eps, RoPE theta; SDPA attention), the
  same batch of random tokens, AdamW with the same settings, gradient clipping at 1.0, and
  each library's own next-token loss (modbench's ``lm_loss``; Llama's ``labels=`` path).
  Reported: tokens/s of each and their ratio. ``transformers`` is an optional extra.
- **Method overhead.** Each method's median step time over the baseline's, at one preset.

One step is the trainer's: forward, loss, backward, clipping, AdamW update. On CUDA, steps are
timed between synchronisations and the tables add model FLOPs utilisation (the analytic
training FLOPs per token of :mod:`modbench.analysis.flops` — 3 x the forward's matrix
multiplications, attention scores included — times tokens/s over the device's dense bf16 peak)
and step memory (the peak a step allocates above the resident weights and optimizer state).
On the CPU the memory column is the activation memory a step keeps for backward
(:func:`modbench.analysis.memory.saved_activation_bytes`), which does not depend on timing.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from modbench.analysis.flops import flop_report
from modbench.analysis.memory import saved_activation_bytes
from modbench.config import ModelConfig, resolve
from modbench.errors import ModbenchError
from modbench.methods.build import plan
from modbench.model.attention import ExplicitKernel
from modbench.runtime.device import fused_kernel
from modbench.runtime.loss import lm_loss

# Dense bf16 peak (TFLOP/s) by device name, from the vendors' datasheets (SXM parts).
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "B200": 2250.0}
# The shapes of the Hugging Face comparison, and the batch each runs on the CPU (the presets'
# own batches of 512 rows are GPU batches): rows x tokens.
HF_PRESETS = ("cpu-small", "llama-60m")
CPU_BATCH = {"cpu-small": (16, 128), "llama-60m": (4, 256)}
GPU_BATCH = {"cpu-small": (64, 128), "llama-60m": (32, 256)}
# The default method table: one or two methods per category (``--methods all``: every one).
DEFAULT_METHODS = ("baseline", "qknorm", "softpick", "geglu", "post_ln", "ln_scaling",
                   "layerscale", "comt")


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from :data:`PEAK_BF16_TFLOPS` (None on the CPU or an
    unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


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
    return Case(label or method, model, lambda: lm_loss(fn(idx), idx), device, rows * seq,
                flop_report(cfg, seq).train_flops_per_token, _autocast(device, dtype))


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


def method_overhead(methods: Iterable[str], preset: str, device: torch.device, *,
                    rounds: int = 5, steps: int = 2, dtype: str = "fp32",
                    compile: bool = False, seed: int = 0, batch: tuple[int, int] | None = None,
                    progress: bool = True) -> list[dict[str, Any]]:
    """Each method's median step time over the baseline's, interleaved, at ``preset``;
    the aim is 1.15x for fused-attention methods and 2x for explicit-score ones."""
    names = list(dict.fromkeys(["baseline", *methods]))
    base_cfg = resolve(preset)
    rows, seq = batch or (base_cfg.train.batch_size, base_cfg.train.seq_len)
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_bench(*, device: str = "cpu", hf_presets: Iterable[str] | None = HF_PRESETS,
              methods: Iterable[str] | None = DEFAULT_METHODS, preset: str = "cpu-small",
              rounds: int = 5, steps: int = 2, dtype: str = "fp32", compile: bool = False,
              seed: int = 0, threads: int = 0, progress: bool = True) -> BenchReport:
    """Both tables (either may be skipped with None)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModbenchError(f"--device {device} but CUDA is not available; use cpu")
    if dtype not in ("fp32", "bf16"):
        raise ModbenchError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if rounds < 1 or steps < 1:
        raise ModbenchError("--rounds and --steps must be at least 1")
    if threads:
        torch.set_num_threads(threads)
    hf = compare_hf(hf_presets, dev, rounds=rounds, steps=steps, dtype=dtype,
                    compile=compile, seed=seed, progress=progress) if hf_presets else []
    rows = method_overhead(methods, preset, dev, rounds=rounds, steps=steps, dtype=dtype,
                           compile=compile, seed=seed, progress=progress) if methods else []
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return BenchReport(name, str(torch.__version__), torch.get_num_threads(), dtype, compile,
                       rounds, steps, hf, rows, preset, peak_tflops(dev))


def markdown(r: BenchReport) -> str:
    """The report as markdown tables (what BENCHMARKS.md records)."""
    where = r.device if r.device != "cpu" else f"CPU, {r.threads} threads"
    lines = [f"{where}, torch {r.torch}, {r.dtype}{', compiled' if r.compiled else ''}, "
             f"{r.rounds} rounds x {r.steps} steps, medians"
             + (f", MFU against {r.peak_tflops:g} TFLOP/s" if r.peak_tflops else ""), ""]
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
        lines += [f"Method overhead at {r.methods_preset}:", "",
                  "| method | path | median step (ms) | vs baseline | aim | within | tokens/s | "
                  + mem_head + " |" + (" MFU |" if mfu else ""),
                  "|---|---|---:|---:|---:|---|---:|---:|" + ("---:|" if mfu else "")]
        for m in r.methods:
            mem_cell = f"{m[mem]:.1f}" if mem in m else "–"
            lines.append(f"| `{m['method']}` | {m['path']} | {m['median_ms']:.1f} | "
                         f"{m['ratio']:.2f}x | {m['aim']:.2f}x | "
                         f"{'yes' if m['within_aim'] else 'no'} | {m['tokens_per_s']:,.0f} | "
                         f"{mem_cell} |" + (f" {100 * m['mfu']:.1f} % |" if mfu else ""))
    return "\n".join(lines)
