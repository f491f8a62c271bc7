"""The power planner (``modbench study plan``) against simulation: the power
``modbench.analysis.power.verdict_power`` computes for a method truly d sigma better, and the
rate at which the verdict rule calls it an improver over 100,000 simulated studies per design
(the vectorised ``compare`` of tests/analysis/verdict_sim.py, which tests/analysis/
test_power_sim.py checks against ``compare`` itself), with the pooled t's power alone (no
|Δ| > 1σ guard) beside it: ``python benchmarks/power_plan.py`` (about half a minute).
BENCHMARKS.md quotes its output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "analysis"))
import verdict_sim as V

from modbench.analysis.power import t_power, verdict_power

N = 100_000
DESIGNS = [  # (effect in sigmas, seeds per method, baseline seeds, methods)
    (3.0, 3, 3, 5), (2.0, 3, 3, 5), (2.0, 7, 7, 5), (2.0, 5, 12, 5), (1.5, 10, 10, 5),
    (1.2, 8, 8, 2), (0.5, 20, 20, 3)]


def main() -> None:
    print("| effect | n | n_b | methods | planned | simulated | t alone |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, (d, n, n_b, m) in enumerate(DESIGNS):
        eff = np.array([d] + [0.0] * (m - 1))
        base, meth = V.simulate(np.random.default_rng(2000 + i), N, n_b, eff, n)
        sim = V.rates(V.rule(base, meth)[0], eff)[1]
        print(f"| {d:g}σ | {n} | {n_b} | {m} | {verdict_power(d, n, n_b, m):.1%} | "
              f"{sim:.1%} | {t_power(d, n, n_b, m):.1%} |")


if __name__ == "__main__":
    main()
