"""Family-wise false-positive rate and power of the verdict rule as shipped against Welch's t
alone (the rule before issue 29), at the built-in study's design (3-seed baseline, 5 methods of
3 seeds), 200,000 simulated studies per scenario: ``python benchmarks/verdict_power.py``
(about a minute). The rule is tests/analysis/verdict_sim.py, the vectorised
``modbench.analysis.stats.compare`` that tests/analysis/test_power_sim.py checks against
``compare`` itself. BENCHMARKS.md and docs/statistics.md quote its output.

``python benchmarks/verdict_power.py --sequential`` measures ``--until-decided 10`` instead
(tests/analysis/sequential_sim.py, the vectorised ``stats.sequential_look``, which
tests/analysis/test_sequential_sim.py checks look for look against the function itself): the
same design growing to at most 10 seeds per group, 100,000 studies per scenario and spending
function (a few minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "analysis"))
import sequential_sim as Q
import verdict_sim as V

N = 200_000
ROOT2 = 2**0.5
SCENARIOS = {  # name: (effects in sigmas, noise, per-method noise scale)
    "normal null": ([0] * 5, "normal", None),
    "t4 null": ([0] * 5, "t4", None),
    "2x var": ([0] * 5, "normal", [ROOT2, 1, 1, 1, 1]),
    "4x var": ([0] * 5, "normal", [2, 1, 1, 1, 1]),
    "3 sigma": ([3, 0, 0, 0, 0], "normal", None),
    "3 sigma t4": ([3, 0, 0, 0, 0], "t4", None),
    "2 sigma": ([2, 0, 0, 0, 0], "normal", None),
}


def main() -> None:
    for i, (name, (effects, noise, scales)) in enumerate(SCENARIOS.items()):
        rng = np.random.default_rng(1000 + i)
        e = np.asarray(effects, dtype=float)
        b, m = V.simulate(rng, N, 3, e, 3, noise, None if scales is None else np.asarray(scales))
        v, _, pooled = V.rule(b, m)
        vw, _, _ = V.rule(b, m, test="welch")
        f, pw = V.rates(v, e)
        fw, pww = V.rates(vw, e)
        print(f"{name}: shipped FWER {f:.4f} power {pw:.3f} (pooled in {pooled.mean():.4f}); "
              f"welch-only FWER {fw:.4f} power {pww:.3f}")


SEQ_N = 100_000
SEQ_SCENARIOS = {k: SCENARIOS[k] for k in ("normal null", "t4 null", "2x var", "2 sigma",
                                            "3 sigma")}
SEQ_SCENARIOS["1.5 sigma"] = ([1.5, 0, 0, 0, 0], "normal", None)


def sequential() -> None:
    for i, (name, (effects, noise, scales)) in enumerate(SEQ_SCENARIOS.items()):
        e = np.asarray(effects, dtype=float)
        for spending in ("obrien_fleming", "pocock"):
            rng = np.random.default_rng(2000 + i)
            b, m = V.simulate(rng, SEQ_N, 10, e, 10, noise,
                              None if scales is None else np.asarray(scales))
            out = Q.run(b, m, 3, 3, 10, spending=spending)
            f, pw = V.rates(out.verdicts, e)
            print(f"{name}, {spending}: FWER {f:.4f} power {pw:.3f} seeds {out.seeds.mean():.1f}"
                  f" looks {out.looks.mean():.2f} alpha spent {out.spent.mean():.4f}",
                  flush=True)


if __name__ == "__main__":
    sequential() if "--sequential" in sys.argv[1:] else main()
