"""Activation memory of the residual-stream methods relative to the baseline, on ``cpu-small``.

Activation memory is measured deterministically, not timed: one training-mode forward (and
the loss) on a fixed random batch of the preset's shape (16 x 128 tokens on cpu-small), with
``torch.autograd.graph.saved_tensors_hooks`` recording every tensor autograd keeps for the
backward pass; each storage counts once (by data pointer), parameters and buffers are left
out (``modbench.measure.memory.saved_activation_bytes``). The same method string always gives
the same number.

What it shows (issue 5): Hyper-Connections keep n lanes per sublayer (n x the residual
activations; DHC also the normalised lanes); Attention Residuals stack their depth sources
at every op, so full AttnRes grows as sum_k (k + 1) and block AttnRes as sum_k (sources of
block k) — block must use less than full. cpu-small has 8 sublayers, so the paper's default
N = 8 blocks is the full variant there; the table uses N = 2 and N = 4.

Usage::

    python benchmarks/stream_memory.py                      # the default set, markdown table
    python benchmarks/stream_memory.py --preset tiny --methods baseline,attnres
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from modbench.config import resolve
from modbench.measure.memory import saved_activation_bytes
from modbench.methods.base import split_top
from modbench.methods.build import build_model

METHODS = [
    "baseline",
    "hyper_connections(n=2,dynamic=false)",
    "hyper_connections(n=2)",
    "hyper_connections(n=4,dynamic=false)",
    "hyper_connections",  # n=4, dynamic (the paper's DHC x4)
    "hyper_connections_2lane",
    "denseformer",
    "attnres",  # full
    "attnres(variant=block,blocks=4)",
    "attnres(variant=block,blocks=2)",
]


def measure(methods: list[str], preset: str, seed: int = 0) -> list[dict[str, Any]]:
    rows = []
    for method in methods:
        cfg = resolve(preset, method=method)
        model = build_model(cfg.model, seed=seed)
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len),
                            generator=g)
        rows.append({"method": method, "bytes": saved_activation_bytes(model, idx),
                     "batch": cfg.train.batch_size, "seq_len": cfg.train.seq_len})
    base = next((r["bytes"] for r in rows if r["method"] == "baseline"), None)
    for r in rows:
        r["ratio"] = r["bytes"] / base if base else None
    return rows


def table(rows: list[dict[str, Any]], preset: str) -> str:
    r0 = rows[0]
    lines = [f"Activation memory (bytes saved for backward), {preset}, batch {r0['batch']} x "
             f"{r0['seq_len']} tokens, float32", "",
             "| method | saved bytes | MiB | x baseline |", "|---|---:|---:|---:|"]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['method']} | {r['bytes']:,} | {r['bytes'] / 2**20:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated method strings (commas inside parentheses are kept)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    methods = [m.strip() for m in split_top(args.methods, ",") if m.strip()]
    print(table(measure(methods, args.preset, args.seed), args.preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
