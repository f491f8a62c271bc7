"""Train-step time of every registered method relative to the baseline (``cpu-small`` by
default): the method table of ``modbench bench`` (:mod:`modbench.measure.bench`), run for
every method and the study's combinations. Interleaved rounds, medians; aims: fast-path methods
within 1.15x of the baseline, explicit-score methods within 2x on CPU.

Usage::

    python benchmarks/method_overhead.py                       # every method, markdown table
    python benchmarks/method_overhead.py --methods baseline,softpick,diff_attn --steps 5
    python benchmarks/method_overhead.py --device cuda --dtype bf16 --preset llama-130m \\
        --batch-size 32 --methods baseline,qknorm,softcap
"""

from __future__ import annotations

import argparse
import sys

import torch

from modbench.measure.bench import BenchReport, markdown, method_overhead, peak_tflops
from modbench.methods import load_all
from modbench.methods.base import split_top

COMBOS = ["selective+qknorm", "gated_attn+qknorm", "qknorm+geglu"]


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
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile each model")
    ap.add_argument("--batch-size", type=int, default=0, help="rows per step (0: the preset's)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per row (0: the preset's)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = ([m.strip() for m in split_top(args.methods, ",") if m.strip()] if args.methods
               else sorted(load_all()) + COMBOS)
    batch = (args.batch_size, args.seq_len) if args.batch_size and args.seq_len else None
    rows = method_overhead(methods, args.preset, device, rounds=args.rounds, steps=args.steps,
                           dtype=args.dtype, compile=args.compile, seed=args.seed, batch=batch)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(markdown(BenchReport(name, str(torch.__version__), torch.get_num_threads(),
                               args.dtype, args.compile, args.rounds, args.steps, [], rows,
                               args.preset, peak_tflops(device))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
