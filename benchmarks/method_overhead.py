"""Train-step time of every registered method relative to the baseline, on ``cpu-small``.

One optimizer step = forward, backward and AdamW update on a fixed random batch of the
preset's shape (16 x 128 tokens on cpu-small). All methods are measured in one process,
interleaved: each round visits every method once in a fresh random order and times
``--steps`` steps of it; the table reports each method's median step time over all rounds
and its ratio to the baseline's median (the machine is shared and noisy, so medians of
interleaved measurements, not means of back-to-back ones).

Aims (issue 3): fast-path methods within 1.15x of the baseline, explicit-score methods
within 2x on CPU.

Usage::

    python benchmarks/method_overhead.py                       # every method, markdown table
    python benchmarks/method_overhead.py --methods baseline,softpick,diff_attn --steps 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import torch

from modbench.config import resolve
from modbench.methods import load_all
from modbench.methods.base import _split_top
from modbench.methods.selective import SelectiveKernel
from modbench.methods.softcap import HardCapKernel
from modbench.model.attention import ExplicitKernel
from modbench.model.build import build_model
from modbench.model.transformer import lm_loss

COMBOS = ["selective+qknorm", "gated_attn+qknorm", "qknorm+geglu"]


def is_explicit(model: torch.nn.Module) -> bool:
    """True when attention materialises the T x T scores outside a fused kernel."""
    for m in model.modules():
        if isinstance(m, SelectiveKernel):
            return True
        if isinstance(m, ExplicitKernel) and not isinstance(m, HardCapKernel):
            return True
    return False


class Case:
    def __init__(self, method: str, preset: str, seed: int) -> None:
        cfg = resolve(preset, method=method)
        self.method = method
        self.model = build_model(cfg.model, seed=seed)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(seed)
        self.idx = torch.randint(0, cfg.model.vocab_size,
                                 (cfg.train.batch_size, cfg.train.seq_len), generator=g)
        self.explicit = is_explicit(self.model)
        self.times: list[float] = []

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.model(self.idx), self.idx)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0


def run(methods: list[str], preset: str, rounds: int, steps: int,
        seed: int) -> list[dict[str, Any]]:
    cases = [Case(m, preset, seed) for m in methods]
    for c in cases:  # warm-up: allocator, kernels, first-call overheads
        c.step()
    rng = random.Random(seed)
    for r in range(rounds):
        order = cases[:]
        rng.shuffle(order)
        for c in order:
            for _ in range(steps):
                c.times.append(c.step())
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    base = statistics.median(next(c for c in cases if c.method == "baseline").times)
    rows = []
    for c in cases:
        med = statistics.median(c.times)
        aim = 2.0 if c.explicit else 1.15
        rows.append({"method": c.method, "path": "explicit" if c.explicit else "fast",
                     "median_ms": 1e3 * med, "ratio": med / base, "aim": aim,
                     "within_aim": med / base <= aim})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | path | median step (ms) | vs baseline | aim | within |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        ok = "yes" if r["within_aim"] else "no"
        lines.append(f"| `{r['method']}` | {r['path']} | {r['median_ms']:.1f} | "
                     f"{r['ratio']:.2f}x | {r['aim']:.2f}x | {ok} |")
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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods:
        methods = [m.strip() for m in _split_top(args.methods, ",") if m.strip()]
    else:
        methods = sorted(load_all()) + COMBOS
    if "baseline" not in methods:
        methods = ["baseline", *methods]
    rows = run(methods, args.preset, args.rounds, args.steps, args.seed)
    print(f"preset {args.preset}, {args.rounds} rounds x {args.steps} steps, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
