"""``--until-decided`` (:func:`modbench.analysis.stats.sequential_look`) vectorised over
simulated studies, for tests/analysis/test_sequential_sim.py and benchmarks/verdict_power.py.

A study starts as a baseline of ``n_base`` seeds and methods of ``n_seeds`` seeds (no failed
seeds), all seeds drawn up front to ``cap``; each look is the verdict rule of
:func:`modbench.analysis.stats.compare` (Brown–Forsythe, then the pooled t or Welch's t, Holm,
|Δ| > 1 baseline sigma) at the alpha the look spends, and the looks add seeds exactly as
``sequential_look`` does (the baseline first, by Dunnett's square root; one seed to each open
method). With ``futility`` = gamma, an open method below the cap whose conditional power
under the current trend is below gamma at a look that tested stops getting seeds, as
``sequential_look(..., futility=gamma)`` does. :func:`check_against_looks` replays the first
studies through ``sequential_look`` itself, look for look.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from modbench.analysis import stats as S

try:  # a test's package import, or benchmarks/verdict_power.py's (tests/analysis on the path)
    from .verdict_sim import holm
except ImportError:
    from verdict_sim import holm  # type: ignore[no-redef]

ALPHA = 0.05


def spent(t: np.ndarray, alpha: float, spending: str) -> np.ndarray:
    """:func:`modbench.analysis.stats.alpha_spent`, vectorised."""
    tt = np.clip(t, 1e-12, 1.0)
    if spending == "pocock":
        a = alpha * np.log1p((math.e - 1.0) * tt)
    else:
        a = np.minimum(alpha, 2.0 * sps.norm.sf(sps.norm.isf(alpha / 2) / np.sqrt(tt)))
    return np.where(t <= 0, 0.0, np.where(t >= 1, alpha, a))


def _masked(x: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask, mean and sum of squares of the first n seeds along the last axis."""
    mask = np.arange(x.shape[-1]) < n[..., None]
    mean = (x * mask).sum(-1) / n
    ss = (((x - mean[..., None]) * mask) ** 2).sum(-1)
    return mask, mean, ss


def look_p(base: np.ndarray, nb: np.ndarray, meth: np.ndarray, nm: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """compare()'s raw p, Δ and the baseline's sigma for each method at these seed counts."""
    mb, mean_b, ss_b = _masked(base, nb)
    mm, mean_m, ss_m = _masked(meth, nm)
    delta = mean_m - mean_b[:, None]
    sb = np.sqrt(ss_b / (nb - 1))
    # Brown–Forsythe (scipy.stats.levene, center="median") over the baseline and the methods
    xb = np.where(mb, base, np.nan)
    xm = np.where(mm, meth, np.nan)
    zb = np.abs(xb - np.nanmedian(xb, axis=-1)[:, None])
    zm = np.abs(xm - np.nanmedian(xm, axis=-1)[..., None])
    zbar_b, zbar_m = np.nanmean(zb, -1), np.nanmean(zm, -1)
    n_all = nb + nm.sum(1)
    k = 1 + meth.shape[1]
    zbar = (np.nansum(zb, -1) + np.nansum(zm, (1, 2))) / n_all
    between = nb * (zbar_b - zbar) ** 2 + (nm * (zbar_m - zbar[:, None]) ** 2).sum(1)
    within = np.nansum((zb - zbar_b[:, None]) ** 2, -1) + np.nansum(
        (zm - zbar_m[..., None]) ** 2, (1, 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        w = (n_all - k) / (k - 1) * between / within
    hom = sps.f.sf(w, k - 1, n_all - k)
    pooled = ~(hom <= S.HOMOGENEITY_ALPHA)
    df_p = (nb - 1) + (nm - 1).sum(1)
    sp = np.sqrt((ss_b + ss_m.sum(1)) / df_p)
    t_p = delta / (sp[:, None] * np.sqrt(1 / nm + 1 / nb[:, None]))
    p_pool = 2 * sps.t.sf(np.abs(t_p), df_p[:, None])
    vm, vb = ss_m / (nm - 1), (ss_b / (nb - 1))[:, None]
    a, b = vm / nm, vb / nb[:, None]
    df_w = (a + b) ** 2 / (a**2 / (nm - 1) + b**2 / (nb[:, None] - 1))
    p_w = 2 * sps.t.sf(np.abs(delta / np.sqrt(a + b)), df_w)
    return np.where(pooled[:, None], p_pool, p_w), delta, sb


def futile(p: np.ndarray, nm: np.ndarray, nb: np.ndarray, t: np.ndarray, undecided: np.ndarray,
           cap: int, alpha: float, spending: str, gamma: float) -> np.ndarray:
    """``sequential_look``'s futility rule, vectorised: which methods' conditional power under
    the current trend (:func:`modbench.analysis.stats.conditional_power` of the look's raw p
    as a z, each method's own information fraction and
    :func:`modbench.analysis.stats.final_boundary`: the alpha not yet spent at Holm's first
    step over the ``undecided`` methods, or the guard of 1 sigma) is below ``gamma``."""
    z = sps.norm.isf(np.clip(p, 1e-300, 1.0) / 2)
    tj = np.minimum(1.0, (2.0 / cap) / (1 / np.maximum(nm, 1) + 1 / nb[:, None]))
    rest = np.maximum(alpha - spent(t, alpha, spending), 0.0)
    m = np.maximum(undecided, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.maximum(sps.norm.isf(rest / (2 * m)), math.sqrt(cap / 2))
        cp = sps.norm.cdf((z / np.sqrt(tj) - c[:, None]) / np.sqrt(1 - tj))
    return np.where(tj < 1, np.nan_to_num(cp, nan=1.0) < gamma, False)


@dataclass
class Outcome:
    verdicts: np.ndarray  # (studies, methods): +1 improver, -1 degrader, 0 not decided
    seeds: np.ndarray  # (studies,) seeds the study ran in all
    looks: np.ndarray  # (studies,) looks it took
    spent: np.ndarray  # (studies,) alpha spent
    stopped: np.ndarray  # (studies, methods): the look that stopped it for futility, 0 none
    method_seeds: np.ndarray  # (studies, methods) each method's seeds at the end


def run(base: np.ndarray, meth: np.ndarray, n_base: int, n_seeds: int, cap: int,
        alpha: float = ALPHA, spending: str = S.DEFAULT_SPENDING,
        futility: float | None = None) -> Outcome:
    """Every study to its last look; ``base`` (studies, cap), ``meth`` (studies, methods,
    cap), the first ``n_base`` / ``n_seeds`` seeds being the spec's; ``futility``: the
    conditional power below which an open method stops (None: never)."""
    studies, m = meth.shape[:2]
    nb = np.full(studies, n_base)
    nm = np.full((studies, m), n_seeds)
    prev = np.zeros(studies)
    used = np.zeros(studies)
    verdicts = np.zeros((studies, m))
    done = np.zeros(studies, dtype=bool)
    looks = np.zeros(studies, dtype=int)
    stopped = np.zeros((studies, m), dtype=int)
    while not done.all():
        act = ~done
        cand = act[:, None] & (verdicts == 0) & (stopped == 0)
        none_left = act & ~cand.any(1)
        looks[none_left] += 1
        done |= none_left
        act &= ~none_left
        if not act.any():
            break
        n_open = np.where(cand, nm, 0).max(1)
        t = np.maximum(prev, np.minimum(1.0, (2.0 / cap) / (1 / np.maximum(n_open, 1) + 1 / nb)))
        full = (np.where(cand, nm, cap) >= cap).all(1) & (nb >= cap)
        t = np.where(full, 1.0, t)
        a = np.maximum(0.0, spent(t, alpha, spending) - spent(prev, alpha, spending))
        p, delta, sb = look_p(base, nb, meth, nm)
        rej = (holm(p) <= a[:, None]) & (np.abs(delta) > sb[:, None]) & (a > 0)[:, None]
        new = cand & rej & act[:, None]
        verdicts[new] = np.sign(delta[new])
        used[act] += a[act]
        prev = np.where(act, t, prev)
        looks[act] += 1
        still = cand & ~new & (nm < cap) & act[:, None]
        if futility is not None:
            undecided = ((verdicts == 0) & (stopped == 0)).sum(1)
            stop = still & (a > 0)[:, None] & futile(p, nm, nb, t, undecided, cap, alpha,
                                                     spending, futility)
            stopped[stop] = np.broadcast_to(looks[:, None], stopped.shape)[stop]
            still &= ~stop
        m_o = still.sum(1)
        n_o = np.where(still, nm, 0).max(1)
        root = np.sqrt(np.maximum(m_o, 1))
        target = np.minimum(cap, np.ceil(n_o * root - 1e-9)).astype(int)
        go = act & (m_o > 0)
        first = go & (nb < target)
        nb = np.where(first, target, nb)
        step = go & ~first
        nm = nm + (still & step[:, None])
        more = np.minimum(cap, np.ceil(np.minimum(cap, n_o + 1) * root - 1e-9)).astype(int)
        nb = np.where(step, np.maximum(nb, more), nb)
        done |= act & (m_o == 0)
    return Outcome(verdicts, nb + nm.sum(1), looks, used, stopped, nm)


def check_against_looks(base: np.ndarray, meth: np.ndarray, n_base: int, n_seeds: int,
                        cap: int, out: Outcome, count: int,
                        spending: str = S.DEFAULT_SPENDING,
                        futility: float | None = None) -> None:
    """sequential_look() over compare() runs the first ``count`` studies exactly as :func:`run`:
    the same verdicts, methods stopped for futility (at the same looks), seeds, looks and
    alpha spent."""
    for i in range(min(count, base.shape[0])):
        n = {"baseline": n_base, **{f"m{j}": n_seeds for j in range(meth.shape[1])}}
        data = {"baseline": base[i], **{f"m{j}": meth[i, j] for j in range(meth.shape[1])}}
        history: list[S.Look] = []
        while not history or not history[-1].last:
            table = {g: list(data[g][:k]) for g, k in n.items()}
            look = S.sequential_look(table, history, cap, spending=spending, futility=futility,
                                     n_resamples=1)
            history.append(look)
            for g, k in look.add.items():
                n[g] += k
        got = {g: v for lk in history for g, v in lk.decided.items()}
        want = {f"m{j}": ("improver" if v > 0 else "degrader")
                for j, v in enumerate(out.verdicts[i]) if v}
        assert got == want, (i, got, want)
        stops = {g: lk.index for lk in history for g in lk.futile}
        assert stops == {f"m{j}": int(k) for j, k in enumerate(out.stopped[i]) if k}, (i, stops)
        assert [n[f"m{j}"] for j in range(meth.shape[1])] == list(out.method_seeds[i]), i
        assert sum(n.values()) == out.seeds[i], i
        assert len(history) == out.looks[i], (i, len(history), out.looks[i])
        assert math.isclose(history[-1].alpha_spent, out.spent[i], rel_tol=1e-9,
                            abs_tol=1e-12), i
