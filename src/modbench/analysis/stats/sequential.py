"""Sequential designs (``modbench study run --until-decided N``; docs/statistics.md, "Adding
seeds until decided"): which configurations need more seeds, the alpha a look may spend
(Lan & DeMets 1983), the optional futility rule (conditional power, Lachin 2005), one look of
the group-sequential design and its final verdicts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from modbench.analysis.stats.corrections import Correction
from modbench.analysis.stats.distributions import normal_isf, normal_sf, t_isf
from modbench.analysis.stats.floor import NoiseFloor
from modbench.analysis.stats.rule import MIN_SURVIVING_BASELINE, VerdictRule
from modbench.analysis.stats.scores import NAN, Scores, group
from modbench.analysis.stats.tests import decision_threshold
from modbench.analysis.stats.verdict import MethodResult, Verdict, compare

# --------------------------------------------------------------------------------------------
# Seed requests (the rule --until-decided used before the group-sequential design)


@dataclass(frozen=True)
class SeedRequest:
    """A configuration whose verdict could still change with more seeds.

    ``interval`` bounds the improvement (positive = better, metric units) of its mean;
    ``reason`` is ``"straddles"`` (+threshold or -threshold lies inside the interval),
    ``"no_data"`` (no finite seed yet) or ``"no_floor"`` (the baseline itself needs seeds).
    ``capped``: it already has ``max_seeds`` seeds, so a runner should stop adding.
    """

    method: str
    n: int
    interval: tuple[float, float]
    threshold: float
    reason: str
    capped: bool


def undecided(
    table: Mapping[str, Scores],
    floor: NoiseFloor,
    threshold: float | None = None,
    *,
    baseline: str = "baseline",
    n_tests: int | None = None,
    alpha: float = 0.05,
    correction: Correction = "holm",
    floor_sigmas: float = 1.0,
    confidence: float = 0.95,
    max_seeds: int | None = None,
) -> list[SeedRequest]:
    """Which configurations need more seeds before their verdict is settled.

    Each non-baseline method without a failed seed (``None``: diverged or stalled) with n
    finite seeds gets the interval
    ``improvement ± q * sigma * sqrt(1/n + 1/n_b)`` with ``q`` the Student-t quantile
    ``t^-1((1 + confidence) / 2)`` with the floor's degrees of freedom (``n_b - 1`` for the
    baseline's sigma): the uncertainty of its difference from the baseline's mean when sigma is
    itself estimated from the baseline's ``n_b`` seeds. It is returned when ``+threshold`` or
    ``-threshold`` lies strictly inside the interval (so with sigma = 0 nothing straddles:
    seeds do not vary). ``threshold`` defaults to the method's own :func:`decision_threshold`
    (its ``n``, the floor's ``n`` and ``df``; ``n_tests`` = the number of non-baseline,
    non-diverged methods), so it shrinks as seeds are added; it is in metric units, like the
    improvement. If the floor is undefined, only the baseline is returned (reason
    ``"no_floor"``). Methods with a failed seed are never returned (a divergence or a stall is
    a result). Order: the table's.
    """
    names = [m for m in table if m != baseline]
    cap = max_seeds if max_seeds is not None else math.inf
    if not floor.defined:
        return [SeedRequest(baseline, floor.n, (-math.inf, math.inf), NAN, "no_floor",
                            floor.n >= cap)]
    groups = {m: group(table[m]) for m in names}
    live = [m for m in names if groups[m].n_diverged == 0]
    m_tests = n_tests if n_tests is not None else len(live)
    q = t_isf((1.0 - confidence) / 2.0, floor.df)
    out: list[SeedRequest] = []
    for m in live:
        g = groups[m]
        thr = threshold
        if thr is None:
            thr = decision_threshold(floor.sigma, m_tests, alpha=alpha, correction=correction,
                                     floor_sigmas=floor_sigmas, n=max(1, g.n),
                                     n_baseline=floor.n, df=floor.df)
        if g.n == 0:
            out.append(SeedRequest(m, 0, (-math.inf, math.inf), thr, "no_data", cap <= 0))
            continue
        imp = floor.sign * (float(g.finite.mean()) - floor.mean)
        half = q * floor.sigma * math.sqrt(1.0 / g.n + 1.0 / floor.n)
        lo, hi = imp - half, imp + half
        if lo < thr < hi or lo < -thr < hi:
            out.append(SeedRequest(m, g.n, (lo, hi), thr, "straddles", g.n >= cap))
    return out


# --------------------------------------------------------------------------------------------
# Alpha spent over looks


#: The alpha-spending functions :func:`alpha_spent` knows (Lan & DeMets 1983).
SPENDING: tuple[str, ...] = ("obrien_fleming", "pocock")
DEFAULT_SPENDING: Final = "obrien_fleming"


def alpha_spent(t: float, alpha: float = 0.05, spending: str = DEFAULT_SPENDING) -> float:
    """The alpha spent by information fraction ``t``: Lan & DeMets (1983), "Discrete sequential
    boundaries for clinical trials", Biometrika 70:659–663, their O'Brien–Fleming-type
    function ``2 - 2 Phi(z_{1 - alpha/2} / sqrt(t))`` (``"obrien_fleming"``: next to nothing
    early, most of alpha at the end) or Pocock-type ``alpha ln(1 + (e - 1) t)``
    (``"pocock"``: evenly). 0 for t <= 0, alpha for t >= 1; nondecreasing in t."""
    if spending not in SPENDING:
        raise ValueError(f"spending must be one of {', '.join(SPENDING)}, not {spending!r}")
    if not t > 0.0:
        return 0.0
    if t >= 1.0:
        return alpha
    if spending == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    return min(alpha, 2.0 * normal_sf(normal_isf(alpha / 2.0) / math.sqrt(t)))


def information_fraction(n: int, n_baseline: int, cap: int) -> float:
    """The information of a comparison of ``n`` seeds against ``n_baseline`` relative to its
    most, ``cap`` against ``cap``: ``(2 / cap) / (1/n + 1/n_baseline)``, at most 1 (the inverse
    variance of the difference of means, for one per-seed sigma)."""
    if n < 1 or n_baseline < 1 or cap < 1:
        return 0.0
    return min(1.0, (2.0 / cap) / (1.0 / n + 1.0 / n_baseline))


def baseline_target(n: int, m: int, cap: int) -> int:
    """Baseline seeds for ``m`` open methods of ``n`` seeds: Dunnett's square-root allocation
    ``ceil(n sqrt(m))`` (one control serves m comparisons; ``study plan --baseline-seeds
    sqrt``), at most ``cap``."""
    return min(cap, math.ceil(n * math.sqrt(max(1, m)) - 1e-9))


# --------------------------------------------------------------------------------------------
# Futility (non-binding: the efficacy boundaries above do not change)


def final_boundary(alpha_left: float, m: int, cap: int, floor_sigmas: float = 1.0) -> float:
    """The z a method's test must reach at the cap to be decided, at best: Holm's first step
    ``z_{1 - alpha_left / (2 m)}`` over the ``m`` methods not yet decided, with
    ``alpha_left`` the alpha not yet spent (the most the looks to come can spend), and at
    least the guard ``|Δ| > floor_sigmas σ`` as a z at ``cap`` seeds against ``cap``
    (``floor_sigmas sqrt(cap / 2)``). Infinite when no alpha is left."""
    if not alpha_left > 0.0:
        return math.inf
    return max(normal_isf(alpha_left / (2.0 * max(1, m))), floor_sigmas * math.sqrt(cap / 2.0))


def conditional_power(z: float, fraction: float, boundary: float) -> float:
    """The conditional power under the current trend (Lachin 2005, "A review of methods for
    futility stopping based on conditional power", Stat. Med. 24:2747–2764; Jennison &
    Turnbull 2000, ch. 10): the chance that a statistic now at ``z`` (information fraction
    ``fraction``) ends above ``boundary`` at fraction 1 if the effect is what it estimates
    now, ``Phi((z / sqrt(t) - c) / sqrt(1 - t))`` (Brownian motion with drift ``z /
    sqrt(t)``). 1 or 0 at ``t >= 1`` (``z`` against ``c``); 1 for a ``z`` that is not a
    number (no test: nothing to stop on)."""
    if math.isnan(z):
        return 1.0
    if fraction >= 1.0:
        return 1.0 if z >= boundary else 0.0
    if not fraction > 0.0:
        return 1.0
    return normal_sf((boundary - z / math.sqrt(fraction)) / math.sqrt(1.0 - fraction))


def check_futility(futility: float | None) -> None:
    """``futility``: a conditional power in (0, 1), or None (never stop for futility)."""
    if futility is not None and not 0.0 < futility < 1.0:
        raise ValueError(f"futility must be a conditional power between 0 and 1 (e.g. 0.1), "
                         f"not {futility!r}")


# --------------------------------------------------------------------------------------------
# Looks


@dataclass(frozen=True)
class Look:
    """One look of a sequential study at one scale: the seeds each group had, the information
    fraction, the alpha its test used (``alpha``, spent at this look) and spent so far
    (``alpha_spent``), the methods it decided (improver or degrader) and the seeds each group
    gets before the next look (``add``; empty: this was the last look).

    ``futility``: the conditional power below which an open method stops (None: the design
    never stops for futility); ``futile``: the methods this look stopped so, each with its
    conditional power. Both are left out of :meth:`to_dict` when ``futility`` is None, so a
    design without futility writes the file it wrote before they existed."""

    index: int
    seeds: Mapping[str, int]
    fraction: float
    alpha: float
    alpha_spent: float
    decided: Mapping[str, str]
    add: Mapping[str, int]
    cap: int
    spending: str = DEFAULT_SPENDING
    note: str = ""
    futility: float | None = None
    futile: Mapping[str, float] = field(default_factory=dict)

    @property
    def last(self) -> bool:
        return not self.add

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(seeds=dict(self.seeds), decided=dict(self.decided), add=dict(self.add),
                 futile=dict(self.futile))
        if self.futility is None:
            del d["futility"], d["futile"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Look:
        return cls(index=int(d["index"]), seeds=dict(d["seeds"]), fraction=float(d["fraction"]),
                   alpha=float(d["alpha"]), alpha_spent=float(d["alpha_spent"]),
                   decided=dict(d["decided"]), add=dict(d["add"]), cap=int(d["cap"]),
                   spending=str(d.get("spending", DEFAULT_SPENDING)),
                   note=str(d.get("note", "")),
                   futility=None if d.get("futility") is None else float(d["futility"]),
                   futile={m: float(v) for m, v in dict(d.get("futile") or {}).items()})


def look_fraction(n: int, n_baseline: int, cap: int, previous: float, at_cap: bool) -> float:
    """A look's information fraction: :func:`information_fraction`, never below the previous
    look's, and 1 once every open method and the baseline have ``cap`` seeds."""
    return 1.0 if at_cap else max(previous, information_fraction(n, n_baseline, cap))


def next_seeds(open_: Sequence[tuple[str, int]], baseline: str, n_baseline: int, cap: int
               ) -> dict[str, int]:
    """The seeds each group gets before the next look, given the open methods (name, finite
    seeds) below ``cap``: the baseline first, up to :func:`baseline_target` of the open
    methods (Dunnett's square root); once it has them, one seed to each open method and the
    baseline what the new count needs."""
    add: dict[str, int] = {}
    if not open_:
        return add
    n_o = max(n for _, n in open_)
    target = baseline_target(n_o, len(open_), cap)
    if n_baseline < target:  # the baseline first
        add[baseline] = target - n_baseline
        return add
    add.update({m: 1 for m, _ in open_})
    more = baseline_target(min(cap, n_o + 1), len(open_), cap) - n_baseline
    if more > 0:
        add[baseline] = more
    return add


def sequential_look(
    table: Mapping[str, Scores],
    history: Sequence[Look] = (),
    cap: int = 10,
    *,
    baseline: str = "baseline",
    alpha: float = 0.05,
    spending: str = DEFAULT_SPENDING,
    futility: float | None = None,
    **compare_kw: Any,
) -> Look:
    """The next look of a group-sequential study (``--until-decided cap``): test what the seeds
    of ``table`` show at the alpha this look may spend, and say who gets seeds next.

    * **Alpha over looks** (Lan & DeMets 1983, :func:`alpha_spent`): look k has the
      information fraction ``t_k`` (:func:`look_fraction`) and tests with
      ``alpha_k = alpha_spent(t_k) - alpha_spent(t_{k-1})``, the alpha spent at that look. The
      looks' alphas add up to at most ``alpha``: with look times fixed in advance the union
      bound over looks keeps the family-wise false-positive rate at most ``alpha`` however the
      looks' statistics correlate (conservative: exact boundaries would use that correlation);
      the timing here depends a little on the data, which tests/analysis/test_sequential_sim.py
      measures. When everything open has ``cap`` seeds, t = 1 and the last look spends what
      is left.
    * **The verdict's own test**: the look is :func:`~modbench.analysis.stats.compare` at
      ``alpha_k`` (``compare_kw`` as the report passes them; a ``rule`` there is used with
      its alpha replaced). A method it calls improver or degrader is decided at this look and
      gets no more seeds.
    * **Futility** (``futility`` = gamma; None: never): at a look that tested, an open method
      below the cap whose :func:`conditional_power` under the current trend is below gamma
      (its test's two-sided p as ``z = Phi^-1(1 - p/2)``, its own
      :func:`information_fraction`, the :func:`final_boundary` of the alpha left after this
      look over the methods not decided) is stopped: it gets no more seeds and is not tested
      again (``futile``). Non-binding: the alpha each look spends is the same function of
      its information fraction, so stopping only removes chances to reject.
    * **Who gets seeds next** (:func:`next_seeds`): the open methods, those not decided nor
      stopped, without a failed seed (a failure is a result) and below ``cap``. Without a
      noise floor (fewer than 2 finite baseline seeds, or fewer than
      :data:`MIN_SURVIVING_BASELINE` with failed ones) nothing is tested or spent and the
      baseline gets a seed.

    Pure: the caller keeps the looks (``history``, oldest first) and adds the seeds.
    """
    if cap < 1:
        raise ValueError(f"cap must be at least 1, got {cap}")
    check_futility(futility)
    if baseline not in table:
        raise KeyError(f"baseline {baseline!r} is not in the table")
    groups = {m: group(s) for m, s in table.items()}
    seeds = {m: len(g.values) if not g.whole_none else 1 for m, g in groups.items()}
    closed = {m for look in history for m in (*look.decided, *look.futile)}
    prev_t = history[-1].fraction if history else 0.0
    spent = history[-1].alpha_spent if history else 0.0
    index = len(history) + 1
    base = groups[baseline]

    def look(t: float, a: float, decided: Mapping[str, str], add: Mapping[str, int],
             note: str = "", futile: Mapping[str, float] | None = None) -> Look:
        return Look(index, seeds, t, a, spent + a, dict(decided), dict(add), cap, spending,
                    note, futility, dict(futile or {}))

    need = MIN_SURVIVING_BASELINE if base.n_diverged else 2
    if base.n < need:
        more = {baseline: 1} if seeds[baseline] < cap else {}
        return look(prev_t, 0.0, {}, more, f"no noise floor ({base.n} finite baseline seeds)")
    methods = [m for m in table if m != baseline]
    candidates = [m for m in methods if m not in closed and groups[m].n > 0]
    if not candidates:
        return look(prev_t, 0.0, {}, {}, "nothing left to decide")
    open_ = [m for m in candidates if groups[m].n_diverged == 0]
    n = max(groups[m].n for m in (open_ or candidates))
    at_cap = all(groups[m].n >= cap for m in open_) and base.n >= cap
    t = look_fraction(n, base.n, cap, prev_t, at_cap)
    a = max(0.0, alpha_spent(t, alpha, spending) - alpha_spent(prev_t, alpha, spending))
    decided: dict[str, str] = {}
    futile: dict[str, float] = {}
    if a > 0.0:
        res, floor_sigmas = _compare_at(table, baseline, a, compare_kw)
        decided = {r.method: str(r.verdict) for r in res if r.method in candidates
                   and r.verdict in (Verdict.IMPROVER, Verdict.DEGRADER)}
        if futility is not None:
            c = final_boundary(alpha - alpha_spent(t, alpha, spending),
                               len(candidates) - len(decided), cap, floor_sigmas)
            futile = _futile(res, [m for m in open_ if m not in decided and groups[m].n < cap],
                             base.n, cap, c, futility)
    still = [(m, groups[m].n) for m in open_
             if m not in decided and m not in futile and groups[m].n < cap]
    return look(t, a, decided, next_seeds(still, baseline, base.n, cap), futile=futile)


def _compare_at(table: Mapping[str, Scores], baseline: str, a: float,
                compare_kw: Mapping[str, Any]) -> tuple[list[MethodResult], float]:
    """:func:`compare` at alpha ``a`` (a ``rule`` in ``compare_kw`` with its alpha replaced),
    and the rule's guard in sigmas."""
    kw = dict(compare_kw)
    rule = kw.pop("rule", None)
    if isinstance(rule, VerdictRule):
        res = compare(table, baseline, rule=dataclasses.replace(rule, alpha=a), **kw)
        return res, rule.floor_sigmas
    return compare(table, baseline, alpha=a, **kw), float(kw.get("floor_sigmas", 1.0))


def _futile(results: Sequence[MethodResult], open_: Sequence[str], n_baseline: int, cap: int,
            boundary: float, futility: float) -> dict[str, float]:
    """The methods of ``open_`` whose conditional power (their test's p as a z, their
    information fraction, ``boundary``) is below ``futility``, with it."""
    by = {r.method: r for r in results}
    out: dict[str, float] = {}
    for m in open_:
        r = by[m]
        z = normal_isf(r.p / 2.0) if math.isfinite(r.p) else NAN
        cp = conditional_power(z, information_fraction(r.n, n_baseline, cap), boundary)
        if cp < futility:
            out[m] = cp
    return out


def sequential_alpha(looks: Sequence[Look], alpha: float = 0.05) -> float:
    """The alpha a sequential study's final verdicts use: the alpha spent at its last look
    that tested (``alpha`` when none did)."""
    tested = [lk.alpha for lk in looks if lk.alpha > 0.0]
    return tested[-1] if tested else alpha


def sequential_verdicts(results: Sequence[MethodResult], looks: Sequence[Look]
                        ) -> list[MethodResult]:
    """A sequential study's verdicts: ``results`` (:func:`~modbench.analysis.stats.compare`
    of the final seeds at :func:`sequential_alpha`) with each method decided at a look given
    that look's verdict (the decision stands: its seeds stopped there), and an improver or
    degrader that no look decided (seeds added after the last look, or a method a look
    stopped for futility) made ``within_noise``; each note says which, and at which look a
    method was stopped for futility."""
    if not looks:
        return list(results)
    decided = {m: (lk, v) for lk in looks for m, v in lk.decided.items()}
    futile = {m: (lk, cp) for lk in looks for m, cp in lk.futile.items()}
    k = len(looks)
    out: list[MethodResult] = []
    for r in results:
        if r.is_baseline or r.verdict not in (Verdict.IMPROVER, Verdict.DEGRADER,
                                              Verdict.WITHIN_NOISE, Verdict.UNDETERMINED):
            out.append(r)
            continue
        note = [r.note] if r.note else []
        verdict = r.verdict
        if r.method in decided:
            lk, v = decided[r.method]
            verdict = Verdict(v)
            note.append(f"sequential: decided {v} at look {lk.index} of {k} (α = "
                        f"{lk.alpha:.2g} spent there, {lk.seeds.get(r.method, r.n)} seeds)")
        elif r.method in futile:
            lk, cp = futile[r.method]
            if r.verdict in (Verdict.IMPROVER, Verdict.DEGRADER):
                verdict = Verdict.WITHIN_NOISE
            note.append(f"sequential: stopped for futility at look {lk.index} of {k} "
                        f"(conditional power {cp:.2g} < {lk.futility:g}, "
                        f"{lk.seeds.get(r.method, r.n)} seeds)")
        elif r.verdict in (Verdict.IMPROVER, Verdict.DEGRADER):
            verdict = Verdict.WITHIN_NOISE
            note.append("sequential: no look decided it (seeds added after the last look)")
        out.append(dataclasses.replace(r, verdict=verdict, note="; ".join(note)))
    return out
