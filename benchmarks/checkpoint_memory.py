"""Peak memory of training with and without activation checkpointing (CPU).

Each case is a fresh Python process that trains ``--steps`` steps of a preset (default: 2
steps of ``cpu-deep`` at batch 256, 24 blocks of width 64, sequences of 64 tokens) through
``modbench.train.trainer.train`` into a temporary folder and reports its peak resident set
size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: the whole process, Python, torch and
the data included, as an out-of-memory killer sees it). The cases run one after another (not
side by side), so they do not share the machine's memory; each figure is one run.

Modes are values of ``train.activation_checkpointing`` (``false``, ``true`` = ``full``,
``attn``, ``every:K``); the ratio is each mode's peak over the ``false`` peak.

The resident set also holds memory that was freed but not given back to the system: glibc's
malloc serves tensors below its (dynamic, up to 32 MB) mmap threshold from its heap, and a
heap fragmented by the kept block inputs between freed activations is not trimmed.
``--mmap-threshold BYTES`` sets ``MALLOC_MMAP_THRESHOLD_`` in every case's process (all cases
alike), so that tensors above that size are mapped and unmapped one by one and the resident
set follows the memory in use.

Usage::

    python benchmarks/checkpoint_memory.py                    # cpu-deep, batch 256, 2 steps
    python benchmarks/checkpoint_memory.py --modes false,true,every:2,attn --method baseline
    python benchmarks/checkpoint_memory.py --mmap-threshold 65536     # memory in use
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def child(preset: str, method: str, batch: int, steps: int, mode: str, threads: int) -> None:
    """Train in this process and print one JSON line with the peak RSS."""
    import torch

    from modbench.config import resolve
    from modbench.train.trainer import train

    if threads:
        torch.set_num_threads(threads)
    overrides = [f"train.batch_size={batch}", f"train.activation_checkpointing={mode}",
                 "train.eval_every=0", f"train.threads={threads}"]
    cfg = resolve(preset, method=method, seed=0, steps=steps, overrides=overrides)
    with tempfile.TemporaryDirectory() as tmp:
        summary = train(cfg, Path(tmp) / "run", progress=False)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"mode": mode, "peak_bytes": peak_kib * 1024,
                      "final_val_loss": summary.get("final_val_loss")}))


def measure(preset: str, method: str, batch: int, steps: int, modes: list[str],
            threads: int, mmap_threshold: int = 0) -> list[dict[str, Any]]:
    env = {**os.environ}
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    rows = []
    for mode in modes:
        cmd = [sys.executable, __file__, "--child", "--preset", preset, "--method", method,
               "--batch", str(batch), "--steps", str(steps), "--modes", mode,
               "--threads", str(threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    base = next(r["peak_bytes"] for r in rows if r["mode"] == "false")
    lines = ["| train.activation_checkpointing | peak RSS (GB) | vs false | final val loss |",
             "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['peak_bytes'] / 1e9:.2f} | "
                     f"{r['peak_bytes'] / base:.2f}x | {r['final_val_loss']:.6f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-deep")
    p.add_argument("--method", default="baseline")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--modes", default="false,true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="MALLOC_MMAP_THRESHOLD_ for every case (0: glibc's default)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    modes = a.modes.split(",")
    if a.child:
        child(a.preset, a.method, a.batch, a.steps, modes[0], a.threads)
        return
    if "false" not in modes:
        modes = ["false", *modes]
    rows = measure(a.preset, a.method, a.batch, a.steps, modes, a.threads, a.mmap_threshold)
    note = f", MALLOC_MMAP_THRESHOLD_={a.mmap_threshold}" if a.mmap_threshold else ""
    print(f"{a.preset}, {a.method}, batch {a.batch}, {a.steps} steps{note}")
    print(table(rows))


if __name__ == "__main__":
    main()
