"""The memory plan (``modbench plan``, :mod:`modbench.measure.plan`) against the memory a real
training step takes, on the CPU in fp32.

For each (preset, method) a fresh subprocess warms torch's kernels up on a toy model (so
libraries loaded at first use are not counted), records its resident memory, resets the
kernel's high-water mark (``/proc/self/clear_refs``), then builds the run's model and
optimizer and trains two steps through the trainer's own engine
(:class:`modbench.train.engine.LocalEngine`: micro-batches, clipping, the fused AdamW; the
second step is the steady state the plan describes, the optimizer's moments existing during
the forward) and runs validation and probe-style scoring at the micro-batch. The measured
peak is the high-water mark (``VmHWM``) over the baseline. The plan (device ``cpu``: fp32,
traced under FakeTensorMode in the parent) is compared with it: ratio = planned / measured.

The plan counts live tensors, as a GPU's caching allocator holds them. glibc's allocator by
default raises its mmap threshold after large frees and then keeps freed heap memory resident,
so the child is measured twice: with glibc told to return freed memory
(``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``: the figure compared) and with its
defaults (reported beside it: what a CPU run's RSS really is).

    python benchmarks/plan_vs_measured.py            # 4 presets x 3 methods, a table
    python benchmarks/plan_vs_measured.py --preset tiny --preset cpu-small
    python benchmarks/plan_vs_measured.py --json

Each subprocess stays under about 3 GB (llama-60m at batch 16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

CASES = {  # preset: (batch size, micro-batch)
    "tiny": (32, 16),
    "cpu-small": (16, 8),
    "cpu-deep": (32, 16),
    "llama-60m": (16, 8),
}
METHODS = ("baseline", "diff_attn", "hyper_connections")
TRIMMED = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(preset: str, method: str, batch: int, micro: int) -> dict[str, Any]:
    import torch

    from modbench.config import resolve
    from modbench.methods.build import plan_run
    from modbench.runtime.device import autocast_for
    from modbench.train.engine import LocalEngine
    from modbench.train.optim import build_optimizer

    torch.set_num_threads(1)
    overrides = [f"train.batch_size={batch}", f"train.micro_batch_size={micro}"]

    def step(cfg: Any, idx: torch.Tensor, mb: int, steps: int) -> None:
        run, p = plan_run(cfg)
        model = p.build(0, "cpu")
        opt = build_optimizer(model, run.recipe)
        engine = LocalEngine([model], [opt], torch.device("cpu"),
                             autocast_for("fp32", torch.device("cpu")),
                             n_micro=idx.shape[0] // mb)
        for _ in range(steps):
            engine.backward(idx, None, [0])
            engine.clip_grad_norm(run.recipe.grad_clip, [0])
            engine.update([0])
        model.eval()
        with torch.no_grad():
            for rows in idx.split(mb):
                model(rows, loss=True)  # validation
                model(rows)  # probe scoring (logits)

    # warm-up: the same method on a toy shape loads every kernel the real step will use
    toy = resolve("tiny", method=method, overrides=["train.batch_size=2"])
    step(toy, torch.randint(0, toy.model.vocab_size, (2, 16)), 1, 1)
    cfg = resolve(preset, method=method, overrides=overrides)
    idx = torch.randint(0, cfg.model.vocab_size, (batch, cfg.train.seq_len))
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step(cfg, idx, micro, 2)
    return {"baseline_bytes": base, "peak_bytes": _status("VmHWM") - base}


def planned(preset: str, method: str, batch: int, micro: int) -> dict[str, Any]:
    from modbench.config import resolve
    from modbench.measure.plan import plan_memory
    from modbench.runtime.gpus import lookup

    cfg = resolve(preset, method=method,
                  overrides=[f"train.batch_size={batch}", f"train.micro_batch_size={micro}"])
    return plan_memory(cfg, device=lookup("cpu"), micro_batch=micro).to_json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--preset", action="append", choices=sorted(CASES),
                    help="only these presets (repeatable) [default: all]")
    ap.add_argument("--child", nargs=4, metavar=("PRESET", "METHOD", "BATCH", "MICRO"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        p, m, b, mb = args.child
        print(json.dumps(child(p, m, int(b), int(mb))))
        return
    rows = []
    for preset, (batch, micro) in CASES.items():
        if args.preset and preset not in args.preset:
            continue
        for method in METHODS:
            t0 = time.perf_counter()
            plan = planned(preset, method, batch, micro)
            cmd = [sys.executable, __file__, "--child", preset, method, str(batch), str(micro)]
            measured = {}
            for name, env in (("trimmed", TRIMMED), ("default", {})):
                out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                     env={**os.environ, **env})
                measured[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
            rows.append({"preset": preset, "method": method, "batch": batch, "micro": micro,
                         "planned_bytes": plan["peak_bytes"], "terms": plan["terms"],
                         "measured_bytes": measured["trimmed"],
                         "measured_default_malloc_bytes": measured["default"],
                         "ratio": plan["peak_bytes"] / measured["trimmed"],
                         "seconds": time.perf_counter() - t0})
            print(f"{preset} {method}: planned {plan['peak_bytes'] / 2**20:.0f} MiB, measured "
                  f"{measured['trimmed'] / 2**20:.0f} MiB ({measured['default'] / 2**20:.0f} "
                  "MiB with glibc's defaults)", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| preset | method | batch / micro | planned MiB | measured MiB | planned / measured "
          "| measured, glibc defaults MiB |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['method']} | {r['batch']} / {r['micro']} | "
              f"{r['planned_bytes'] / 2**20:.0f} | {r['measured_bytes'] / 2**20:.0f} | "
              f"{r['ratio']:.2f} | {r['measured_default_malloc_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
