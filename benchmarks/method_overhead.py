"""Train-step time of every registered method relative to the baseline, on ``cpu-small``.

One optimizer step = forward, backward and AdamW update on a fixed random batch of the
preset's shape (16 x 128 tokens on cpu-small). All methods are measured in one process,
interleaved: each round visits every method once in a fresh random order and times
``--steps`` steps of it; the table reports each method's median step time over all rounds
and its ratio to the baseline's median (the machine is shared and noisy, so medians of
interleaved measurements, not means of back-to-back ones).

Aims (issue 3): fast-path methods within 1.15x of the baseline, explicit-score methods
within 2x on CPU.

On a GPU (``--device cuda``) the same table also gives tokens/s, model FLOPs utilisation
(the analytic training FLOPs per token of ``modbench.analysis.flops`` times tokens/s, over
the device's dense bf16 peak, or ``--peak-tflops``) and step memory (the peak a step
allocates over the resident weights and optimizer state: activations, gradients,
workspace); ``--dtype bf16`` runs under bf16 autocast as the trainer does on CUDA,
``--compile`` wraps each model in ``torch.compile``. Step times there are taken between
device synchronisations.

Usage::

    python benchmarks/method_overhead.py                       # every method, markdown table
    python benchmarks/method_overhead.py --methods baseline,softpick,diff_attn --steps 5
    python benchmarks/method_overhead.py --device cuda --dtype bf16 --preset llama-130m \
        --batch-size 32 --methods baseline,qknorm,softcap
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from typing import Any

import torch

from modbench.analysis.flops import flop_report
from modbench.config import resolve
from modbench.methods import load_all
from modbench.methods.base import _split_top
from modbench.methods.build import build_model
from modbench.methods.selective import SelectiveKernel
from modbench.methods.softcap import HardCapKernel
from modbench.model.attention import ExplicitKernel
from modbench.runtime.loss import lm_loss

COMBOS = ["selective+qknorm", "gated_attn+qknorm", "qknorm+geglu"]

# Dense bf16 peak (TFLOP/s) by device name, from the vendors' datasheets (SXM parts).
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "B200": 2250.0}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def is_explicit(model: torch.nn.Module) -> bool:
    """True when attention materialises the T x T scores outside a fused kernel."""
    for m in model.modules():
        if isinstance(m, SelectiveKernel):
            return True
        if isinstance(m, ExplicitKernel) and not isinstance(m, HardCapKernel):
            return True
    return False


class Case:
    def __init__(self, method: str, preset: str, seed: int, device: torch.device,
                 dtype: str, compile_: bool, batch_size: int, seq_len: int) -> None:
        cfg = resolve(preset, method=method)
        self.method = method
        self.device = device
        self.batch_size = batch_size or cfg.train.batch_size
        self.seq_len = seq_len or cfg.train.seq_len
        self.model = build_model(cfg.model, seed=seed, device=device)
        self.model.train()
        self.explicit = is_explicit(self.model)
        self.fn = torch.compile(self.model) if compile_ else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(seed)
        self.idx = torch.randint(0, cfg.model.vocab_size, (self.batch_size, self.seq_len),
                                 generator=g).to(device)
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) \
            if dtype == "bf16" else contextlib.nullcontext
        self.train_flops_per_token = flop_report(cfg.model, self.seq_len).train_flops_per_token
        self.times: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        self._sync()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = lm_loss(self.fn(self.idx), self.idx)
        loss.backward()
        self.opt.step()
        self._sync()
        return time.perf_counter() - t0


def run(methods: list[str], preset: str, rounds: int, steps: int, seed: int,
        device: torch.device | None = None, dtype: str = "fp32", compile_: bool = False,
        batch_size: int = 0, seq_len: int = 0, warmup: int = 1,
        peak: float | None = None) -> list[dict[str, Any]]:
    device = device or torch.device("cpu")
    cases = [Case(m, preset, seed, device, dtype, compile_, batch_size, seq_len)
             for m in methods]
    for c in cases:  # warm-up: allocator, kernels, first-call overheads, compilation
        for _ in range(warmup):
            c.step()
    rng = random.Random(seed)
    step_mem: dict[str, float] = {}  # what a step adds over the resident weights and state
    for r in range(rounds):
        order = cases[:]
        rng.shuffle(order)
        for c in order:
            if device.type == "cuda":
                c.opt.zero_grad(set_to_none=True)
                resident = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(steps):
                c.times.append(c.step())
            if device.type == "cuda":
                extra = (torch.cuda.max_memory_allocated(device) - resident) / 2**30
                step_mem[c.method] = max(step_mem.get(c.method, 0.0), extra)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    base = statistics.median(next(c for c in cases if c.method == "baseline").times)
    rows = []
    for c in cases:
        med = statistics.median(c.times)
        aim = 2.0 if c.explicit else 1.15
        tps = c.batch_size * c.seq_len / med
        row: dict[str, Any] = {
            "method": c.method, "path": "explicit" if c.explicit else "fast",
            "median_ms": 1e3 * med, "ratio": med / base, "aim": aim,
            "within_aim": med / base <= aim, "tokens_per_s": tps}
        if peak:
            row["mfu"] = c.train_flops_per_token * tps / (peak * 1e12)
        if c.method in step_mem:
            row["step_gib"] = step_mem[c.method]
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    extra = [k for k in ("mfu", "step_gib") if any(k in r for r in rows)]
    head = {"mfu": "MFU", "step_gib": "step memory (GiB)"}
    lines = ["| method | path | median step (ms) | vs baseline | aim | within | tokens/s |"
             + "".join(f" {head[k]} |" for k in extra),
             "|---|---|---:|---:|---:|---|---:|" + "---:|" * len(extra)]
    for r in rows:
        ok = "yes" if r["within_aim"] else "no"
        cells = {"mfu": f"{100 * r.get('mfu', float('nan')):.1f} %",
                 "step_gib": f"{r.get('step_gib', float('nan')):.2f}"}
        lines.append(f"| `{r['method']}` | {r['path']} | {r['median_ms']:.1f} | "
                     f"{r['ratio']:.2f}x | {r['aim']:.2f}x | {ok} | {r['tokens_per_s']:,.0f} |"
                     + "".join(f" {cells[k]} |" for k in extra))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=None,
                    help="comma-separated method strings (default: baseline, every registered "
                         "method and the study's combinations)")
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per method per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: bf16 autocast, as the trainer does on CUDA")
    ap.add_argument("--compile", action="store_true", help="torch.compile each model")
    ap.add_argument("--batch-size", type=int, default=0, help="rows per step (0: the preset's)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per row (0: the preset's)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per method first")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="peak for MFU (0: the device's dense bf16 datasheet peak, if known)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods:
        methods = [m.strip() for m in _split_top(args.methods, ",") if m.strip()]
    else:
        methods = sorted(load_all()) + COMBOS
    if "baseline" not in methods:
        methods = ["baseline", *methods]
    peak = args.peak_tflops or peak_tflops(device)
    rows = run(methods, args.preset, args.rounds, args.steps, args.seed, device, args.dtype,
               args.compile, args.batch_size, args.seq_len, args.warmup, peak)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    print(f"preset {args.preset}, {args.rounds} rounds x {args.steps} steps, {where}, "
          f"{args.dtype}{', compiled' if args.compile else ''}, torch {torch.__version__}"
          + (f", MFU against {peak:g} TFLOP/s" if peak else "") + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
