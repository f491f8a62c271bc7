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

``python benchmarks/verdict_power.py --futility`` measures ``--until-decided 10 --futility
0.1`` (conditional power under the current trend below 0.1 stops a method; the same
simulation, ``sequential_sim.run(..., futility=...)``) at the same scenarios, beside the
design without it, then the runs each design needs for equal power at 2 sigma: the
sequential design at other caps, with and without futility, and fixed designs (the same
rule, ``verdict_sim.rule``, every seed up front).
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


FUTILITY = 0.1


def futility() -> None:
    """The futility rule at the built-in design, then designs of equal power at 2 sigma."""
    for i, (name, (effects, noise, scales)) in enumerate(SEQ_SCENARIOS.items()):
        e = np.asarray(effects, dtype=float)
        for spending in ("obrien_fleming", "pocock"):
            for gamma in (None, FUTILITY):
                rng = np.random.default_rng(2000 + i)
                b, m = V.simulate(rng, SEQ_N, 10, e, 10, noise,
                                  None if scales is None else np.asarray(scales))
                out = Q.run(b, m, 3, 3, 10, spending=spending, futility=gamma)
                f, pw = V.rates(out.verdicts, e)
                planted = out.stopped[:, e != 0] > 0
                print(f"{name}, {spending}, futility {gamma}: FWER {f:.4f} power {pw:.3f} "
                      f"runs {out.seeds.mean():.1f} seeds per method "
                      f"{out.method_seeds.mean():.2f} baseline "
                      f"{(out.seeds - out.method_seeds.sum(1)).mean():.2f} planted stopped "
                      f"{planted.mean() if planted.size else 0.0:.4f} looks "
                      f"{out.looks.mean():.2f}", flush=True)
    e = np.asarray(SEQ_SCENARIOS["2 sigma"][0], dtype=float)
    for cap, gamma in ((9, None), (10, None), (10, FUTILITY), (12, FUTILITY), (16, FUTILITY)):
        b, m = V.simulate(np.random.default_rng(3000), SEQ_N, cap, e, cap, "normal")
        out = Q.run(b, m, 3, 3, cap, futility=gamma)
        f, pw = V.rates(out.verdicts, e)
        print(f"2 sigma, sequential cap {cap}, futility {gamma}: FWER {f:.4f} power {pw:.3f} "
              f"runs {out.seeds.mean():.1f}", flush=True)
    for n_base, n in ((7, 7), (8, 8), (9, 9), (10, 10), (12, 5), (13, 6), (16, 7)):
        b, m = V.simulate(np.random.default_rng(3000), SEQ_N, n_base, e, n, "normal")
        v, _, _ = V.rule(b, m)
        f, pw = V.rates(v, e)
        print(f"2 sigma, fixed {n_base} baseline / {n} per method: FWER {f:.4f} power "
              f"{pw:.3f} runs {n_base + 5 * n}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    futility() if "--futility" in args else sequential() if "--sequential" in args else main()
