"""Render a study's results (:class:`modbench.analysis.results.StudyResults`): tables, plots,
markdown, self-contained HTML and CSV. This module only renders; ``write_study_report`` in the
study package loads a study folder's results and calls :func:`write_report`.

Writes ``DIR/report/``: ``report.md``, ``report.html`` (PNG figures embedded), ``results.csv``
(one row per run), ``results.json`` (the statistics per method and scale, and the verdict rule
that produced them) and the PNGs.

The views follow arXiv 2605.20798: Table 2 (seeds, steps and tokens per method, metric, Δ, z, the
test used with t and df, significance under Bonferroni, Holm and Benjamini–Hochberg, verdict,
parameters, FLOPs/token), Table 3 (ranks across scales with Spearman's ρ), Table 6
(divergences and stalls: status, step, last finite validation loss against the unigram level,
grad-norm signature), Table 7 / Figure 2 (validation loss against the
downstream score), Figure 3 (per-task Δ heatmap), and the loss and grad-norm curves.

Right after the title, a "Warnings" list says when the runs are short of what a verdict needs
(:func:`budget_warnings`): a method at a scale with fewer than :data:`MIN_SEEDS` finite seeds
(or a scale without a finished baseline), runs that stopped before their planned steps or did
not finish, runs that should have seen the same batches and did not (``batches_sha256``
against the spec's data order), runs that stalled at the unigram level (status ``stalled``),
and a baseline that stopped far from convergence: its validation loss still falling
fast when training ended (over its last validation interval it fell by more than
:data:`STILL_FALLING` of its value), or fewer than :data:`MIN_TOKENS_PER_PARAM` training
tokens per parameter.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modbench.analysis.results import (
    ALPHA,
    CORRECTION,
    FLOOR_SIGMAS,
    ClaimCheck,
    RunRow,
    StudyResults,
    higher_is_better,
    read_looks,
    rule_record,
)
from modbench.analysis.stats import MethodResult, decision_threshold, spearman_across_scales
from modbench.errors import ModbenchError
from modbench.fsutil import atomic_write_text
from modbench.report.blocks import Block
from modbench.report.blocks import fmt as _fmt
from modbench.report.blocks import to_html as _html
from modbench.report.blocks import to_markdown as _markdown
from modbench.report.columns import FAILED, TRAINED_COLUMNS, VERDICT_COLUMNS, Column, rows_at, table
from modbench.report.columns import count as _count
from modbench.report.columns import dof as _df
from modbench.report.columns import span as _span
from modbench.report.diagnostics import study_diagnostics
from modbench.report.plots import curves_plot, heatmap, scatter_plot
from modbench.runtime.runfolder import CURVES, curves, is_storage_error, write_failure

#: a section a study's stage adds to the report: (results, report folder) -> its blocks
Section = Callable[[StudyResults, Path], list[Block]]

#: Fewer finite seeds than this for any configuration at a scale: the report warns (the seed
#: protocol's noise floor runs three seeds per reference configuration, arXiv 2605.20798 §3.3).
MIN_SEEDS = 3
#: A baseline run whose validation loss fell by more than this fraction of its value between
#: its last two validation points was still far from converged: the report warns.
STILL_FALLING = 0.01
#: A baseline trained on fewer tokens per parameter than this stopped far from convergence,
#: whatever its last validation points say (a decayed learning rate flattens the end of any
#: schedule): the report warns. The seed study trains 1.2B parameters on 23.07B tokens (~19).
MIN_TOKENS_PER_PARAM = 10.0


def write_report(results: StudyResults, out: Path, *,
                 columns: Sequence[Column] = VERDICT_COLUMNS,
                 trained_columns: Sequence[Column] = TRAINED_COLUMNS,
                 sections: Sequence[Section] = ()) -> Path:
    """Write the report files of ``results`` into the folder ``out``; returns ``out``.

    ``columns`` and ``trained_columns`` are Table 2's two tables per scale, the verdicts and
    what each method trained (:mod:`modbench.report.columns`; pass a longer list to show
    another statistic). ``sections``: the sections the study's stages add, each called with
    ``results`` and ``out`` (:meth:`modbench.study.stages.Stage.report`, given by
    :func:`modbench.study.reporting.write_study_report`).

    Each file is replaced whole or not at all, so a write the storage refuses (a full disk)
    leaves the files already there as they were and raises one line
    (:func:`modbench.runtime.runfolder.write_failure`), not a traceback."""
    try:
        return _write_report(results, Path(out), columns, trained_columns, sections)
    except OSError as e:
        if not is_storage_error(e):
            raise
        where = Path(str(e.filename)) if e.filename else Path(out)
        raise write_failure(e, where, "the report files already there are kept as they "
                            f"were (each is replaced whole); free some space and run "
                            f"`modbench study report {results.folder}` again") from None


def _write_report(results: StudyResults, out: Path, columns: Sequence[Column],
                  trained_columns: Sequence[Column], sections: Sequence[Section] = ()) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rows, metric, baseline = results.rows, results.metric, results.baseline
    blocks: list[Block] = [Block("h1", f"Study report: {results.name}")]
    if results.claim is not None:
        _claim(results.claim, blocks)
    warnings = budget_warnings(results)
    if warnings:
        blocks += [Block("h2", "Warnings"), Block("ul", items=warnings)]
    blocks.append(Block(
        "p", f"{len(rows)} runs in `{results.folder}`; baseline `{baseline}`; primary metric "
             f"`{metric}` ({'higher' if higher_is_better(metric) else 'lower'} is better). "
             f"Verdict rule: a method is an improver (degrader) when its {CORRECTION.title()}"
             f"-corrected p ≤ α = {ALPHA:g}, {CORRECTION.title()} over the non-baseline "
             f"methods of its scale (one score test each, and one failure-rate test for each "
             f"method with a failed seed), and |Δ| > {FLOOR_SIGMAS:g}σ, σ being "
             "the std of the baseline's n seeds (n − 1 degrees of freedom). Failed seeds "
             "(diverged, or stalled at the unigram level) are judged as a rate: k of n against "
             "the baseline's by Fisher's exact test; the verdict is diverged or stalled when "
             "that test shows the method fails more often or no seed survived, otherwise its "
             "surviving seeds are compared. The p-values are two-sided and use a t reference, "
             "since σ is itself estimated from a few seeds. When the Brown–Forsythe check does "
             "not reject equal variances, every method is tested with the pooled error term "
             "of all the scale's groups (pooled t, Σ(n_i − 1) df); otherwise a method with one "
             "seed gets the prediction test, t = Δ / (σ·√(1 + 1/n)) with n − 1 df, and one "
             "with two or more seeds Welch's t; the test column names the one that decided. "
             "No verdict rests on an estimated σ of 0 (below 1e-6 of the mean): undetermined. "
             "Δ [CI] is the test's interval, simultaneous (Bonferroni) over the scale's "
             "methods; MDE is the |Δ| the test finds with 80 % power at this design (in σ in "
             "brackets); within_noise with |Δ| < MDE means not shown, not no effect. "
             "z = Δ/σ is descriptive only. Bonferroni and Benjamini–Hochberg adjusted p are "
             "shown beside Holm's; * marks adjusted p ≤ α."))
    _table2(results, blocks, columns, trained_columns)
    _secondary(rows, baseline, blocks)
    _cross_scale(rows, metric, blocks)
    _divergence(rows, blocks)
    _figures(rows, baseline, out, blocks)
    from modbench.report.trajectory import trajectory_section, with_trajectories

    traj = trajectory_section(results, out, blocks)  # verdicts over training, sequential looks
    from modbench.report.scaling import scaling_section

    blocks += scaling_section(results, out)  # fits along a ladder (3+ scales), scaling.json
    for section in sections:  # the study's stages' own (sequential looks, frozen vs tuned)
        blocks += section(results, out)
    blocks += study_diagnostics(rows, baseline, out)  # diagnostics.json, train.log_layers
    _write_csv(rows, out / "results.csv")
    # each file atomically: a report cut mid-write (a killed study) leaves whole files
    atomic_write_text(out / "results.json",
                      json.dumps(results_json(results, with_trajectories(results.comparisons,
                                                                         traj)),
                                 indent=1, default=str) + "\n")
    atomic_write_text(out / "report.md", _markdown(blocks, out))
    atomic_write_text(out / "report.html", _html(blocks))
    return out


def results_json(results: StudyResults, comparisons: dict[str, Any]) -> dict[str, Any]:
    """``results.json``'s content: the comparisons per scale
    (:func:`~modbench.report.trajectory.with_trajectories`), then ``"rule"``, the verdict rule
    that produced them (:func:`~modbench.analysis.results.rule_record`). A method the
    learning-rate profile flags rate-dependent has ``"rate_dependent": true`` (no other has
    the key). A scale may not be named ``rule``."""
    if "rule" in comparisons:
        raise ModbenchError("a scale is named 'rule', the name of results.json's record of the "
                            "verdict rule; rename the scale")
    for scale, flagged in results.rate_dependent.items():  # the profile's flag, where set
        for r in comparisons.get(scale, []):
            if r.get("method") in flagged:
                r["rate_dependent"] = True
    return comparisons | {"rule": rule_record(read_looks(results.folder))}


_OUTCOME_WORDS = {"agrees": "agrees", "contradicts": "contradicts the claim",
                  "not shown": "not shown at this budget", "not run": "not run"}


def _claim(claim: ClaimCheck, blocks: list[Block]) -> None:
    """The published claim the study tests, and whether the verdicts agree: the report's
    first lines."""
    head = {"agrees": "the measured verdicts agree with it",
            "contradicted": "the measured verdicts contradict it in part",
            "partly shown": "the measured verdicts agree with it in part; the rest is not "
                            "shown at this budget"}[claim.summary]
    n, c = len(claim.rows), claim.count("contradicts")
    counts = "; ".join([f"{claim.count('agrees')} of {n} agree"]
                       + ([f"{c} contradict{'s' if c == 1 else ''} it"] if c else [])
                       + [f"{claim.count(o)} {w}" for o, w in (("not shown", "not shown at "
                          "this budget"), ("not run", "not run")) if claim.count(o)])
    source = f" ({claim.source})" if claim.source else ""
    blocks.append(Block("h2", "The claim this study tests"))
    blocks.append(Block("p", f"**Claim**{source}: {claim.text}"))
    blocks.append(Block("p", f"**Result: {head}** ({counts})."))
    items = []
    for r in claim.rows:
        expected = " or ".join(r.expected)
        items.append(f"`{r.method}` at {r.scale}: measured **{r.verdict}**, the claim predicts "
                     f"{expected}: {_OUTCOME_WORDS[r.outcome]}"
                     f"{f' ({r.why})' if getattr(r, 'why', '') else ''}.")
    blocks.append(Block("ul", items=items))


def _table2(results: StudyResults, blocks: list[Block], columns: Sequence[Column],
            trained_columns: Sequence[Column]) -> None:
    """Per scale, the noise floor, the verdicts' table (``columns``), the verdicts' notes and
    what each method trained (``trained_columns``): each table from its list of columns."""
    for scale, res in results.comparisons.items():
        blocks.append(Block("h2", f"Methods against the baseline — {scale} (Table 2 view)"))
        if res:
            floor = res[0].floor
            blocks.append(Block("p", f"Noise floor: baseline σ = {_fmt(floor.sigma)} over "
                                     f"{floor.n} seeds ({_df(floor.df)} degrees of freedom; "
                                     f"mean {_fmt(floor.mean)})."))
        # the verdict's columns here; what was trained (steps, tokens, size, FLOPs) in a table
        # of its own below, so that neither is wider than a 1,400-pixel window
        rows = rows_at(results, scale)
        blocks.append(table(columns, rows, results.metric))
        noted = [f"`{r.method}`: {r.note}" for r in res if r.note]
        if noted:
            blocks.append(Block("ul", items=noted))
        if any(row.fewer for row in rows):
            blocks.append(Block("p", _fewer_note(res)))
        blocks.append(Block("p", f"What each method trained — {scale} (steps: of the planned "
                                 "where fewer, as for a stalled run stopped early):"))
        blocks.append(table(trained_columns, rows, results.metric))


def _fewer_note(res: list[MethodResult]) -> str:
    floor = res[0].floor
    m = sum(1 for r in res if not r.is_baseline and str(r.verdict) not in FAILED)
    text = (f"† fewer finite seeds than the baseline ({floor.n}): the verdict rests on fewer "
            "seeds than the noise floor.")
    thr = decision_threshold(floor.sigma, m, alpha=ALPHA, correction=CORRECTION,
                             floor_sigmas=FLOOR_SIGMAS, n=1, n_baseline=floor.n, df=floor.df)
    if math.isfinite(thr) and floor.sigma > 0:
        text += (f" With this floor and {m} methods, one seed must lie more than "
                 f"{thr / floor.sigma:.1f}σ from the baseline's mean to be decided "
                 f"({CORRECTION.title()}'s strictest step).")
    return text


def budget_warnings(results: StudyResults) -> list[str]:
    """What the report warns about in its first lines (an empty list: nothing).

    * seeds: a configuration at a scale with fewer than :data:`MIN_SEEDS` finite seeds
      (the baseline included; not one whose verdict is a failure, diverged or stalled: its
      failed seeds are its result), or a scale with runs but no finished baseline;
    * steps: finished runs, not diverged or stalled, that stopped before their planned steps
      (a stalled run may stop early: ``train.stop_stalled_after``), and runs
      that did not finish (failed, pending, running: they are in no table);
    * data: runs that should have seen the same batches and did not, runs that stalled at the
      unigram level (status ``stalled``), and completed runs that did not learn at all, which
      the stall rule could not judge (:func:`_data_warnings`);
    * rate: a method the learning-rate profile flags rate-dependent (an improver at one rate
      and a degrader at another; ``results.rate_dependent``);
    * convergence: a finished baseline run whose validation loss, between its last two
      validation points (``metrics.jsonl`` through ``runtime.runfolder.curves``), fell by more
      than :data:`STILL_FALLING` of the earlier value; or finished baseline runs that saw fewer
      than :data:`MIN_TOKENS_PER_PARAM` tokens per parameter (the summary's ``tokens`` and
      ``params``). Either way training stopped far from convergence.
    """
    rows, out = results.rows, []
    few = []
    for scale, res in results.comparisons.items():
        by_n: dict[int, list[str]] = {}
        for r in res:  # a failed method's verdict does not rest on its finite seeds
            if r.n < MIN_SEEDS and str(r.verdict) not in FAILED:
                by_n.setdefault(r.n, []).append(f"`{r.method}`")
        if by_n:
            few.append(f"at {scale}, " + " and ".join(
                f"{n} seed{'s' if n != 1 else ''} for {', '.join(ms)}"
                for n, ms in sorted(by_n.items())))
    for scale in sorted({r.scale for r in rows} - set(results.comparisons)):
        few.append(f"at {scale}: no finished `{results.baseline}` run (no noise floor, no "
                   "verdicts)")
    if few:
        out.append(f"Fewer than {MIN_SEEDS} finite seeds, short of the seed protocol's "
                   f"{MIN_SEEDS} per configuration (arXiv 2605.20798 §3.3): " + "; ".join(few)
                   + ". Verdicts resting on so few seeds are provisional.")
    # (a stalled run stopped early by train.stop_stalled_after is in the data warnings)
    stopped = [r for r in rows if r.state == "done" and not r.diverged and not r.stalled
               and r.steps is not None and r.steps_planned is not None
               and r.steps < r.steps_planned]
    if stopped:
        out.append(f"{len(stopped)} finished run(s) stopped before their planned steps: "
                   + ", ".join(f"`{r.method}` seed {r.seed} at {r.scale} ({r.steps} of "
                               f"{r.steps_planned})" for r in stopped) + ".")
    unfinished = [r for r in rows if r.state != "done"]
    if unfinished:
        states = sorted({r.state for r in unfinished})
        out.append(f"{len(unfinished)} run(s) did not finish ("
                   + ", ".join(f"{s}: {sum(r.state == s for r in unfinished)}" for s in states)
                   + ") and are left out of every table.")
    falling = _still_falling(rows, results.baseline)
    if falling:
        out.append("The baseline's validation loss was still falling fast when training "
                   f"stopped (rule: by more than {STILL_FALLING:.0%} of its value between its "
                   "last two validation points): " + "; ".join(falling) + ". Training stopped "
                   "far from convergence; verdicts at this budget may not hold for full-length "
                   "runs.")
    out += _data_warnings(results)
    out += [f"{label} is left out of the verdicts: it was trained with other code than is "
            f"loaded now ({why})" for label, why in sorted(results.code_changed.items())]
    out += [f"`{method}` at {scale} is rate-dependent ({where}: Learning-rate profile): its "
            "verdict here holds at the recipe's rate, not for the method at every rate"
            for scale, per in sorted(results.rate_dependent.items())
            for method, where in sorted(per.items())]
    budget = _few_tokens(rows, results.baseline)
    if budget:
        out.append("The baseline trained on few tokens per parameter (rule: fewer than "
                   f"{MIN_TOKENS_PER_PARAM:g}; the seed study trains 1.2B parameters on 23B "
                   "tokens, about 19): " + "; ".join(budget) + ". Training stopped far from "
                   "convergence; verdicts at this budget may not hold for full-length runs.")
    return out


def _data_warnings(results: StudyResults) -> list[str]:
    """Runs that did not see the batches the protocol gives them, and runs that stalled.

    Data: with ``data_order`` ``fixed`` every finished, non-diverged run at a scale with the
    same number of steps must have seen one batch sequence (one ``batches_sha256``); with
    ``per_seed``, those of one init seed must. Runs without a recorded hash are skipped.
    Stalls: runs with status ``stalled`` (``modbench.runtime.stall``; for a summary written
    before the rule existed, judged when the results were read), and completed runs whose final
    validation loss is not below their initial one (the rule needs validations over a long
    enough stretch of training to judge; such a run learned nothing either way)."""
    out = []
    groups: dict[tuple[Any, ...], list[RunRow]] = {}
    for r in results.rows:
        if r.state == "done" and not r.diverged and r.batches_sha256:
            key = (r.scale, r.steps) + ((r.seed,) if results.data_order == "per_seed" else ())
            groups.setdefault(key, []).append(r)
    mixed = []
    for key, runs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        hashes = sorted({r.batches_sha256 for r in runs if r.batches_sha256})
        if len(hashes) > 1:
            where = f"at {key[0]}, {key[1]} steps" + (f", seed {key[2]}" if len(key) > 2
                                                      else "")
            seqs = "; ".join(
                f"{h[:10]}… for " + ", ".join(f"`{r.method}` seed {r.seed}" for r in runs
                                             if r.batches_sha256 == h) for h in hashes)
            mixed.append(f"{where}: {len(hashes)} sequences ({seqs})")
    if mixed:
        rule = ("every run of a scale (data.order fixed)" if results.data_order != "per_seed"
                else "the runs of each init seed (data.order per_seed)")
        out.append("Runs that should have seen the same batches did not (summary."
                   f"batches_sha256 must agree for {rule}): " + "; ".join(mixed)
                   + ". Their differences mix the method's effect with a data difference; "
                   "check data.source, the data seeds and the probe settings of these runs.")
    stalled = [r for r in results.rows if r.state == "done" and r.stalled]
    if stalled:
        judged = sum(r.stall_rederived for r in stalled)
        out.append(f"{len(stalled)} finished run(s) stalled at the unigram level (status "
                   "stalled: from the step given to the end the validation loss stayed at what "
                   "token frequencies alone give, or above): " + ", ".join(
                       f"`{r.method}` seed {r.seed} at {r.scale} (from step "
                       f"{_fmt(r.stalled_at_step)}; {_fmt(r.val_loss)}, unigram level "
                       f"{_fmt(r.unigram_loss)})" for r in stalled)
                   + ". They are failures like divergences, not values: a method with one gets "
                   "the verdict stalled."
                   + (f" {judged} of them were judged by this report from their metrics.jsonl "
                      "(summaries written before stall detection)." if judged else ""))
    idle = [r for r in results.rows if r.state == "done" and r.status == "completed"
            and r.val_loss is not None and r.initial_val_loss is not None
            and r.val_loss >= r.initial_val_loss]
    if idle:
        out.append(f"{len(idle)} finished run(s) did not learn (final validation loss not "
                   "below the initial one): " + ", ".join(
                       f"`{r.method}` seed {r.seed} at {r.scale} ({_fmt(r.initial_val_loss)} "
                       f"→ {_fmt(r.val_loss)})" for r in idle) + ".")
    return out


def _few_tokens(rows: list[RunRow], baseline: str) -> list[str]:
    out = []
    for scale in sorted({r.scale for r in rows}):
        ok = [r for r in rows if r.scale == scale and r.method == baseline and r.state == "done"
              and not r.diverged and r.tokens and r.params]
        ratios = [r.tokens / r.params for r in ok if r.tokens and r.params]
        if ratios and max(ratios) < MIN_TOKENS_PER_PARAM:
            out.append(f"at {scale}, {_span(ratios, lambda v: f'{v:.2g}')} tokens per parameter "
                       f"({_span([r.tokens for r in ok], _count)} tokens, "
                       f"{_span([r.params for r in ok], _count)} parameters)")
    return out


def _still_falling(rows: list[RunRow], baseline: str) -> list[str]:
    out = []
    for scale in sorted({r.scale for r in rows}):
        hits = []
        for r in rows:
            if (r.scale != scale or r.method != baseline or r.state != "done" or r.diverged
                    or r.run_dir is None):
                continue
            pts = curves(r.run_dir)["val_loss"]
            if len(pts) < 2:
                continue
            (s0, v0), (s1, v1) = pts[-2:]
            if v0 > 0 and (v0 - v1) / v0 > STILL_FALLING:
                hits.append((r.seed, s0, s1, (v0 - v1) / v0))
        if hits:
            drops = _span([h[3] for h in hits], lambda v: f"{v:.1%}")
            steps = ", ".join(sorted({f"{h[1]}→{h[2]}" for h in hits}))
            out.append(f"at {scale}, {len(hits)} of its runs fell {drops} over steps {steps}")
    return out


def _secondary(rows: list[RunRow], baseline: str, blocks: list[Block]) -> None:
    tasks = sorted({t for r in rows for t in r.tasks})
    blocks.append(Block("h2", "All metrics (mean over seeds)"))
    header = ["scale", "method", "runs", "val loss", *tasks]
    body = []
    for scale in sorted({r.scale for r in rows}):
        methods = sorted({r.method for r in rows if r.scale == scale},
                         key=lambda m: (m != baseline, m))
        for m in methods:
            rs = [r for r in rows if r.scale == scale and r.method == m and r.state == "done"]
            ok = [r for r in rs if not r.failed]  # diverged and stalled runs are not averaged

            def mean(vals: list[float | None]) -> float | None:
                v = [x for x in vals if x is not None]
                return sum(v) / len(v) if v else None

            body.append([scale, f"`{m}`", str(len(rs)), _fmt(mean([r.val_loss for r in ok])),
                         *[_fmt(mean([r.tasks.get(t) for r in ok]), 3) for t in tasks]])
    blocks.append(Block("table", header=header, rows=body))


def _cross_scale(rows: list[RunRow], metric: str, blocks: list[Block]) -> None:
    scales = sorted({r.scale for r in rows})
    if len(scales) < 2:
        return
    means: dict[str, dict[str, float | None]] = {}
    for s in scales:
        for m in sorted({r.method for r in rows if r.scale == s}):
            vals = [r.metric(metric) for r in rows if r.scale == s and r.method == m]
            fin = [v for v in vals if v is not None]
            means.setdefault(s, {})[m] = sum(fin) / len(fin) if fin and len(fin) == len(vals) \
                else None
    blocks.append(Block("h2", "Across scales (Table 3 view)"))
    methods = sorted({m for s in scales for m in means[s]})
    sign = -1.0 if higher_is_better(metric) else 1.0

    def rank(s: str, m: str) -> str:
        v = means[s].get(m)
        if v is None:
            return "failed/missing"
        order = sorted((sign * x, k) for k, x in means[s].items() if x is not None)
        return str([k for _, k in order].index(m) + 1)

    body = [[f"`{m}`", *[f"{_fmt(means[s].get(m))} (#{rank(s, m)})" for s in scales]]
            for m in methods]
    blocks.append(Block("table", header=["method", *scales], rows=body))
    for a, b in itertools.pairwise(scales):
        sp = spearman_across_scales(means[a], means[b])
        blocks.append(Block("p", f"Spearman ρ({a}, {b}) = {_fmt(sp.rho, 3)} (p = {_fmt(sp.p, 3)},"
                                 f" n = {sp.n} methods with a score at both scales)."))


def _divergence(rows: list[RunRow], blocks: list[Block]) -> None:
    """Table 6: every failed run, diverged (step: the first non-finite one) or stalled (step:
    the one it stayed at the unigram level from), with its last finite validation loss, the
    unigram level of its data and its last grad norms."""
    failed = [r for r in rows if r.state == "done" and r.failed]
    blocks.append(Block("h2", "Divergences and stalls (Table 6 view)"))
    if not failed:
        blocks.append(Block("p", "No run diverged or stalled."))
        return
    body = []
    for r in sorted(failed, key=lambda r: (r.scale, r.status or "", r.method, r.seed)):
        norms = [g["grad_norm"] for g in r.last_grad_norms if g.get("grad_norm") is not None]
        step = r.diverged_at_step if r.diverged else r.stalled_at_step
        body.append([r.scale, f"`{r.method}`", str(r.seed), str(r.status), _fmt(step),
                     _fmt(_last_finite_val(r)), _fmt(r.unigram_loss), _fmt(r.unigram_entropy),
                     _fmt(norms[-1] if norms else None, 3), _fmt(max(norms) if norms else None, 3),
                     " → ".join(_fmt(g, 2) for g in norms[-5:])])
    blocks.append(Block("table", header=[
        "scale", "method", "seed", "status", "step", "last finite val loss", "unigram level",
        "unigram entropy", "last finite grad norm", "max of last 10", "signature (last 5)"],
        rows=body))
    blocks.append(Block("p", "Unigram level: the validation loss of the training tokens' "
                             "frequencies alone (a model that ignores context); unigram "
                             "entropy: their entropy on the training split (nats per token). "
                             "A stalled run ends at the level or above it (docs/runs.md)."))


def _last_finite_val(r: RunRow) -> float | None:
    """A run's final validation loss, or for a diverged one its last finite validation
    point (metrics.jsonl)."""
    if r.val_loss is not None:
        return r.val_loss
    pts = _curves(r)["val_loss"]
    return pts[-1][1] if pts else None


def _figures(rows: list[RunRow], baseline: str, out: Path, blocks: list[Block]) -> None:
    blocks.append(Block("h2", "Figures"))
    for scale in sorted({r.scale for r in rows}):
        here = [r for r in rows if r.scale == scale and r.state == "done"]
        per_run = {f"{r.method}/s{r.seed}": _curves(r) for r in here}
        loss = {label: c["loss"] for label, c in per_run.items()}
        gn = {label: c["grad_norm"] for label, c in per_run.items()}
        # the unigram level (one data set per scale): where the stalled runs' curves meet
        levels = [r.unigram_loss for r in here if r.unigram_loss is not None]
        n_stalled = sum(r.status == "stalled" for r in here)
        level_label = "unigram level" + (f" ({n_stalled} stalled run{'s' * (n_stalled > 1)} "
                                         "sit here)" if n_stalled else "")
        p1 = curves_plot(loss, f"training loss — {scale}", "loss", out / f"loss_{scale}.png",
                         baseline=baseline, level=levels[0] if levels else None,
                         level_label=level_label)
        p2 = curves_plot(gn, f"gradient norm — {scale}", "grad norm", out / f"gradnorm_{scale}.png",
                         log_y=True, baseline=baseline)
        blocks += [Block("img", f"Training loss, {scale}", path=p1),
                   Block("img", f"Gradient norm, {scale}", path=p2)]
        probe_names = sorted({k.removeprefix("probe:") for c in per_run.values() for k in c
                              if k.startswith("probe:")})
        for name in probe_names:  # capability learning curves (train.eval_probes)
            series = {label: c.get(f"probe:{name}", []) for label, c in per_run.items()}
            pp = curves_plot(series, f"held-out {name} accuracy during training — {scale}",
                             "accuracy", out / f"probe_{name}_{scale}.png", baseline=baseline)
            blocks.append(Block("img", f"Held-out {name} accuracy at each validation "
                                       f"(train.eval_probes), {scale}", path=pp))
        downstream = "climb_avg" if any(r.climb_avg is not None for r in here) else "probe_avg"
        pts: dict[str, tuple[float, float]] = {}
        for m in sorted({r.method for r in here}):
            ok = [r for r in here if r.method == m and not r.diverged]
            xs = [r.val_loss for r in ok if r.val_loss is not None]
            ys = [v for v in (r.metric(downstream) for r in ok) if v is not None]
            if xs and ys:
                pts[m] = (sum(xs) / len(xs), sum(ys) / len(ys))
        if pts:
            p3 = scatter_plot(pts, "validation loss", downstream,
                              f"validation loss vs {downstream} — {scale}",
                              out / f"loss_vs_downstream_{scale}.png")
            blocks.append(Block("img", f"Validation loss against {downstream} (Figure 2 view)",
                                path=p3))
        tasks = sorted({t for r in here for t in r.tasks})
        base = [r for r in here if r.method == baseline and not r.diverged]
        methods = sorted({r.method for r in here} - {baseline})
        if tasks and base and methods:
            def tmean(rs: list[RunRow], t: str) -> float:
                v = [r.tasks[t] for r in rs if t in r.tasks]
                return sum(v) / len(v) if v else float("nan")

            vals = [[tmean([r for r in here if r.method == m and not r.diverged], t)
                     - tmean(base, t) for t in tasks] for m in methods]
            p4 = heatmap(methods, tasks, vals, f"per-task Δ vs {baseline} — {scale}",
                         out / f"task_delta_{scale}.png")
            blocks.append(Block("img", "Per-task Δ against the baseline (Figure 3 view)",
                                path=p4))


def _curves(row: RunRow) -> dict[str, list[tuple[int, float]]]:
    return curves(row.run_dir) if row.run_dir is not None else {k: [] for k in CURVES}


def _write_csv(rows: list[RunRow], path: Path) -> None:
    tasks = sorted({t for r in rows for t in r.tasks})
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["key", "scale", "method", "seed", "state", "status", "val_loss", "params",
                "steps", "steps_planned", "tokens", "diverged_at_step", "stalled_at_step",
                "unigram_loss", "climb_avg", *tasks])
    for r in rows:
        w.writerow([r.key, r.scale, r.method, r.seed, r.state, r.status, r.val_loss, r.params,
                    r.steps, r.steps_planned, r.tokens, r.diverged_at_step, r.stalled_at_step,
                    r.unigram_loss, r.climb_avg, *[r.tasks.get(t) for t in tasks]])
    atomic_write_text(path, buf.getvalue())
