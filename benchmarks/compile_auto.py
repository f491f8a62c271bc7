"""Calibrate ``train.compile=auto`` on the CPU (issue 32, item 2): for each preset, the eager
and the compiled step's CPU time, and the compilation's cost cold (an empty inductor cache)
and warm (the same cache again), each in its own process with one intra-op thread.

    python benchmarks/compile_auto.py --presets tiny,cpu-small,cpu-deep --steps 30

Each case is ``python -m modbench train --preset P --set train.steps=N --set
train.eval_every=0 --set train.threads=1 --set train.compile=...`` (``--no-progress``) in a
fresh process; the figure is the process's CPU seconds (``resource``'s children time),
which load from other work disturbs less than wall time. The per-step time of a case is
(CPU s at N steps − CPU s at ``--short`` steps) / (N − short), so start-up and compilation
cancel; the compilation's cost is the compiled case's CPU s less the eager case's at the same
steps, less the steps' own saving. The constants of ``modbench.runtime.device``
(``CPU_COMPILE_SPEEDUP`` and the compile costs) come from these figures (BENCHMARKS.md,
"train.compile=auto on the CPU")."""

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


def cpu_seconds(preset: str, steps: int, compile_: str, cache: str, out: Path) -> float:
    """The CPU seconds of one training process (user + system of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "modbench", "train", "--preset", preset, "--no-progress",
           "--out", str(out), "--set", f"train.steps={steps}", "--set", "train.eval_every=0",
           "--set", "train.threads=1", "--set", f"train.compile={compile_}"]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,cpu-small,cpu-deep")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--short", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    run = iter(range(10**6))  # one run folder per process
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.presets.split(","):
            cache = str(Path(tmp) / f"inductor-{preset}")

            def t(steps: int, mode: str, preset: str = preset, cache: str = cache,
                  run: Any = run) -> float:
                return cpu_seconds(preset, steps, mode, cache, Path(tmp) / f"r{next(run)}")

            e_short, e_long = t(a.short, "false"), t(a.steps, "false")
            cold = t(a.steps, "true")  # the empty cache: compiles cold
            c_short, warm = t(a.short, "true"), t(a.steps, "true")  # the cache is warm now
            eager_step = (e_long - e_short) / (a.steps - a.short)
            comp_step = (warm - c_short) / (a.steps - a.short)
            row = {"preset": preset, "eager_step_s": eager_step, "compiled_step_s": comp_step,
                   "speedup": eager_step / comp_step if comp_step > 0 else None,
                   "cold_compile_s": cold - e_long + a.steps * (eager_step - comp_step),
                   "warm_compile_s": warm - e_long + a.steps * (eager_step - comp_step)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| preset | eager step (CPU s) | compiled step | speed-up | cold compile (CPU s) "
          "| warm compile |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['eager_step_s']:.3f} | {r['compiled_step_s']:.3f} | "
              f"{r['speedup']:.2f}× | {r['cold_compile_s']:.0f} | {r['warm_compile_s']:.0f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
