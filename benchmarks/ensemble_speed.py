"""Train-step time of K seeds stacked in one process (``LocalEngine`` with K members) against
the same K models stepped one after another, interleaved in one process (medians).

One step = forward, loss, backward, per-member clipping and AdamW, on a fixed random batch of
the preset's shape, the same for every member, as in ``modbench train --seeds``.

Usage::

    python benchmarks/ensemble_speed.py                       # tiny, cpu-deep, cpu-small; K=3, 8
    python benchmarks/ensemble_speed.py --presets cpu-small --k 8 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from _timing import interleaved_medians  # benchmarks/_timing.py

from modbench.config import resolve
from modbench.methods.build import plan
from modbench.train.engine import LocalEngine
from modbench.train.optim import build_optimizer


def engine(preset: str, k: int, device: torch.device) -> tuple[LocalEngine, torch.Tensor]:
    cfg = resolve(preset)
    p = plan(cfg.model)
    models = [p.build(seed, device) for seed in range(k)]
    opts = [build_optimizer(m, cfg.recipe) for m in models]
    eng = LocalEngine(models, opts, device, contextlib.nullcontext)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len),
                          generator=g)
    return eng, batch


def measure(preset: str, k: int, rounds: int, device: torch.device) -> dict[str, float]:
    stacked, batch = engine(preset, k, device)
    singles = [engine(preset, 1, device)[0] for _ in range(k)]
    members = list(range(k))

    def step_stacked() -> None:
        stacked.backward(batch, None, members)
        stacked.clip_grad_norm(1.0, members)
        stacked.update(members)
        stacked.synchronize()

    def step_singles() -> None:
        for e in singles:
            e.backward(batch, None, [0])
            e.clip_grad_norm(1.0, [0])
            e.update([0])
        singles[0].synchronize()

    med = interleaved_medians({"stacked": step_stacked, "one by one": step_singles}, rounds)
    return {"stacked_ms": 1e3 * med["stacked"], "separate_ms": 1e3 * med["one by one"],
            "speedup": med["one by one"] / med["stacked"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,cpu-deep,cpu-small")
    ap.add_argument("--k", default="3,8", help="comma-separated member counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"{where}, torch {torch.__version__}, {args.rounds} rounds, medians\n")
    print("| preset | K | stacked step (ms) | K separate steps (ms) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for k in (int(x) for x in args.k.split(",")):
            r = measure(preset, k, args.rounds, device)
            print(f"| {preset} | {k} | {r['stacked_ms']:.1f} | {r['separate_ms']:.1f} | "
                  f"{r['speedup']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
