"""The verdict rule of :func:`modbench.analysis.stats.compare`, vectorised over simulated
studies, for the error-rate simulations (test_verdicts.py, test_power_sim.py and
benchmarks/verdict_power.py).

A study is a baseline of ``n_base`` seeds and ``n_methods`` methods of ``n_seeds`` seeds each,
no failed seeds. The rule as shipped (docs/statistics.md): the Brown–Forsythe check
(``scipy.stats.levene(center="median")``) over the baseline and the methods; when it does not
reject at ``HOMOGENEITY_ALPHA``, each method is tested with the pooled error term of all the
groups (df = sum(n_i - 1)) when some method has >= 2 seeds; otherwise with the prediction
test (one seed) or Welch's t; Holm
over the family; a verdict needs the adjusted p <= alpha and |delta| > 1 baseline sigma. The
tests check :func:`compare` decides the first studies of a scenario exactly the same way.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

from modbench.analysis import stats as S

ALPHA = 0.05
SIGN = {"improver": 1, "degrader": -1, "within_noise": 0}


def holm(p: np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values along axis 1."""
    m = p.shape[1]
    order = np.argsort(p, axis=1, kind="mergesort")
    steps = np.take_along_axis(p, order, axis=1) * (m - np.arange(m))
    adj = np.minimum(1.0, np.maximum.accumulate(steps, axis=1))
    out = np.empty_like(p)
    np.put_along_axis(out, order, adj, axis=1)
    return out


def rule(base: np.ndarray, meth: np.ndarray, alpha: float = ALPHA,
         test: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Verdicts (+1 improver, -1 degrader, 0 within noise), raw p and whether the pooled test
    decided, for base (studies, n_base) and meth (studies, methods, seeds)."""
    studies, n_methods, n = meth.shape
    n_base = base.shape[1]
    mb, sb = base.mean(axis=1), base.std(axis=1, ddof=1)
    delta = meth.mean(axis=2) - mb[:, None]
    if test == "auto" and (n >= 2 or n_base >= 2):
        groups = [base] + ([meth[:, j, :] for j in range(n_methods)] if n >= 2 else [])
        if len(groups) >= 2:
            hom = sps.levene(*groups, center="median", axis=-1).pvalue
            pooled = ~(hom <= S.HOMOGENEITY_ALPHA)
        else:  # one-seed methods add no spread: the pooled term is the prediction test's
            pooled = np.zeros(studies, dtype=bool)
    else:
        pooled = np.full(studies, test == "pooled")
    ss = ((base - mb[:, None]) ** 2).sum(axis=1) + (
        (meth - meth.mean(axis=2, keepdims=True)) ** 2).sum(axis=(1, 2))
    dfp = (n_base - 1) + n_methods * (n - 1)
    sp = np.sqrt(ss / dfp)
    t_pool = delta / (sp[:, None] * math.sqrt(1 / n + 1 / n_base))
    p_pool = 2 * sps.t.sf(np.abs(t_pool), dfp)
    if n == 1:
        t = delta / (sb[:, None] * math.sqrt(1 + 1 / n_base))
        p_fb = 2 * sps.t.sf(np.abs(t), n_base - 1)
    else:
        b = np.broadcast_to(base[:, None, :], (studies, n_methods, n_base))
        p_fb = sps.ttest_ind(meth, b, axis=-1, equal_var=False).pvalue
    p = np.where(pooled[:, None], p_pool, p_fb)
    decided = (holm(p) <= alpha) & (np.abs(delta) > sb[:, None])
    return np.sign(delta) * decided, p, pooled


def simulate(rng: np.random.Generator, studies: int, n_base: int, effects: np.ndarray,
             n_seeds: int, noise: str = "normal", scales: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Baseline (studies, n_base) and methods (studies, methods, n_seeds) with unit per-seed
    spread: ``noise`` "normal" or "t4" (Student t with 4 df, scaled to unit variance);
    ``effects`` shift each method's mean (in sigmas, sign: positive = higher); ``scales``
    multiply each method's noise (sqrt 2: twice the variance)."""
    def draw(shape: tuple[int, ...]) -> np.ndarray:
        if noise == "t4":
            return rng.standard_t(4, shape) / math.sqrt(2.0)
        return rng.standard_normal(shape)

    base = draw((studies, n_base))
    k = len(effects)
    sc = np.ones(k) if scales is None else np.asarray(scales, dtype=float)
    meth = draw((studies, k, n_seeds)) * sc[None, :, None] + np.asarray(effects)[None, :, None]
    return base, meth


def check_against_compare(base: np.ndarray, meth: np.ndarray, verdicts: np.ndarray,
                          p: np.ndarray, pooled: np.ndarray, count: int) -> None:
    """compare() decides the first ``count`` studies exactly as :func:`rule`."""
    for i in range(min(count, base.shape[0])):
        table = {"baseline": list(base[i]),
                 **{f"m{j}": list(meth[i, j]) for j in range(meth.shape[1])}}
        res = S.compare(table, n_resamples=1)[1:]
        assert [SIGN[str(r.verdict)] for r in res] == list(verdicts[i]), i
        np.testing.assert_allclose([r.p for r in res], p[i], rtol=1e-7)
        want = "pooled" if pooled[i] else ("prediction" if meth.shape[2] == 1 else "welch")
        assert {r.test for r in res} == {want}


def rates(verdicts: np.ndarray, effects: np.ndarray) -> tuple[float, float]:
    """Family-wise false-positive rate over the null methods, and the rate at which the first
    planted (non-zero) effect is found in its direction (NaN without one)."""
    nulls = np.asarray(effects) == 0
    fwer = float(np.mean((verdicts[:, nulls] != 0).any(axis=1)))
    planted = np.flatnonzero(~nulls)
    if planted.size == 0:
        return fwer, math.nan
    j = int(planted[0])
    return fwer, float(np.mean(verdicts[:, j] == np.sign(effects[j])))
