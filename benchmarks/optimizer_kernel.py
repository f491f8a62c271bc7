"""Train-step time with torch's fused Adam/AdamW kernel (what the trainer uses where it can:
``modbench.train.optim.fused_kernel``) against the for-loop implementation that is torch's
default on the CPU, each preset's own recipe (the built-in study's ``cpu-deep`` trains with
Adam, ``cpu-small`` with AdamW), one process, interleaved rounds, medians.

One step = forward, loss, backward, clipping at 1.0 and the optimizer's update on a fixed
random batch of the preset's shape.

Usage::

    python benchmarks/optimizer_kernel.py            # cpu-deep and cpu-small, 1 and 2 threads
    python benchmarks/optimizer_kernel.py --presets cpu-deep --threads 1 --rounds 15
"""

from __future__ import annotations

import argparse
import sys

import torch
from _timing import interleaved_medians  # benchmarks/_timing.py

from modbench.config import resolve
from modbench.methods.build import plan
from modbench.runtime.loss import lm_loss
from modbench.train.optim import param_groups


def stepper(preset: str, fused: bool) -> tuple[object, int]:
    cfg = resolve(preset)
    model = plan(cfg.model).build(0)
    kind = torch.optim.Adam if cfg.recipe.optimizer == "adam" else torch.optim.AdamW
    opt = kind(param_groups(model, cfg.recipe.weight_decay), lr=cfg.recipe.lr,
               betas=cfg.recipe.betas, eps=cfg.recipe.eps, fused=fused)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len),
                          generator=g)

    def step() -> None:
        lm_loss(model(batch), batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(1 for _ in model.parameters())


def measure(preset: str, rounds: int, steps: int) -> dict[str, float]:
    med = interleaved_medians({"fused": stepper(preset, True)[0],
                               "for-loop": stepper(preset, False)[0]}, rounds, steps=steps)
    return {"fused_ms": 1e3 * med["fused"], "loop_ms": 1e3 * med["for-loop"],
            "speedup": med["for-loop"] / med["fused"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="cpu-deep,cpu-small")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed sample")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps, medians\n")
    print("| preset | optimizer | tensors | threads | fused step (ms) | for-loop step (ms) | "
          "speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            r = measure(preset, args.rounds, args.steps)
            n = stepper(preset, True)[1]
            print(f"| {preset} | {resolve(preset).recipe.optimizer} | {n} | {threads} | "
                  f"{r['fused_ms']:.1f} | {r['loop_ms']:.1f} | {r['speedup']:.3f}x |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
