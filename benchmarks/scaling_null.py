"""How often the scaling section's gain trend reads grows/shrinks when the gain is constant,
and how often the leave-last-out interval holds the measured loss (docs/statistics.md,
"Scaling fits"): synthetic ladders of 5 rungs x 3 seeds (tests/analysis/test_scaling.py's
``ladder_points``), baseline 2 + 50 N^-0.3 and a method 0.1 better everywhere, seed noise
0.002, 100 bootstrap resamples each.

    python benchmarks/scaling_null.py [LADDERS]      # default 40
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.analysis.test_scaling import ladder_points

from modbench.analysis.scaling import analyse


def main(ladders: int) -> None:
    laws = {"baseline": (2.0, 50.0, 0.3), "offset": (1.9, 50.0, 0.3)}
    trends: Counter[str] = Counter()
    inside = 0
    for seed in range(ladders):
        an = analyse(ladder_points(laws, noise=0.002, seed=100 + seed), "baseline", boot=100)
        assert an is not None
        trends[an.methods["offset"].trend] += 1
        p = an.methods["offset"].prediction
        assert p is not None
        inside += abs(p.loss_z) <= 1
    print(f"{ladders} ladders: trend {dict(trends)}; leave-last-out loss inside its 95 % "
          f"interval in {inside}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
