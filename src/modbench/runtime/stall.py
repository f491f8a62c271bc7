"""Stall detection: a run that finished with finite losses but never learned more than the
token frequencies of its data ends with status ``stalled`` (docs/runs.md, "Statuses").

The rule, applied once to a finished run's validation points (the trainer's at the end of
training; :func:`judge_run_folder` for a run folder written before the rule existed):

* the **unigram level** ``U`` is the validation loss of the training split's unigram
  distribution (:func:`modbench.data.unigram.unigram_level`): where a model that learned only
  how often each token occurs sits;
* a validation point is **at the unigram level** when its loss is at least ``U - margin``
  (``train.stall_margin`` nats; a loss *above* ``U`` counts too: a run that did not even learn
  the frequencies learned nothing either);
* only points after warm-up count (steps ``> recipe.warmup_for(train.steps)``);
* the run **stalled at step s** when, from the validation at step ``s`` to the final one,
  every point is at the unigram level; the stall spans at least ``train.stall_patience`` of
  the steps after warm-up and at least ``train.stall_min_steps`` steps
  (``steps - s >= max(patience * (steps - warmup), min_steps)``); and the loss fell by less
  than ``margin`` between step ``s`` and the end (it stopped improving). ``s`` is the earliest
  such step (``stalled_at_step``); no such step: the run is not stalled.

The decision is taken on the final validation, never mid-run: a run at the unigram level can
still leave it (Pre-LN on ``cpu-deep`` at lr 1e-3 sits near it from step 100 to 300, then
learns; LOG.md 2026-11-22), so training always runs to the end. Every model passes through
the unigram level early in training, so the span and flatness conditions are what keep short
healthy runs out (docs/runs.md has the measurements): a 30-step ``tiny`` run ends *above* the
unigram level but is still falling; a 120-step ``cpu-deep`` baseline ends *at* it, where it
has sat for its last 40 steps, too short a stretch to call a stall. A run with fewer than
``min_steps`` steps after warm-up is never judged, and the rule needs validations during
training (``train.eval_every`` > 0): with only the final one it sees no stretch and never
flags. ``margin`` 0 turns it off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from modbench.config import RunConfig, from_dict
from modbench.data.unigram import UnigramLevel, unigram_level
from modbench.errors import ModbenchError
from modbench.runtime.runfolder import CONFIG, read_metrics, val_points


def stalled_at(vals: Sequence[tuple[int, float | None]], level: float, *, steps: int,
               warmup: int, margin: float, patience: float, min_steps: int = 0) -> int | None:
    """The step from which a run that trained ``steps`` steps (``warmup`` of them warm-up)
    stayed stalled at the unigram ``level``, from its validation points ``(step, loss)`` in
    step order, or None (not stalled; see the module docstring). A missing (non-finite) loss
    is never at the level: such a run diverged, which is its status instead."""
    if margin <= 0 or not math.isfinite(level):
        return None
    pts = [(int(s), v) for s, v in vals if s > warmup]
    if not pts:
        return None
    trail: list[tuple[int, float]] = []  # the trailing points at the unigram level
    for s, v in reversed(pts):
        if v is None or not math.isfinite(v) or v < level - margin:
            break
        trail.append((s, v))
    trail.reverse()
    if not trail or trail[-1] != pts[-1]:
        return None
    end, final = steps, trail[-1][1]
    span = max(patience * (end - warmup), min_steps)
    for s, v in trail:
        if end - s >= span and v - final < margin:
            return s
    return None


@dataclass(frozen=True)
class StallCheck:
    """What the stall rule found for one run: the unigram level it used (None: it could not
    be computed) and the step the run stalled at (None: not stalled)."""

    level: UnigramLevel | None
    stalled_at: int | None


def check_stall(cfg: RunConfig, vals: Sequence[tuple[int, float | None]],
                level: UnigramLevel | None) -> StallCheck:
    """The stall rule for a finished run of ``cfg`` with these validation points."""
    tc = cfg.train
    at = None if level is None else stalled_at(
        vals, level.val_loss, steps=tc.steps, warmup=cfg.recipe.warmup_for(tc.steps),
        margin=tc.stall_margin, patience=tc.stall_patience, min_steps=tc.stall_min_steps)
    return StallCheck(level, at)


def summary_fields(check: StallCheck) -> dict[str, Any]:
    """The summary.json fields the rule writes (docs/runs.md)."""
    lv = check.level
    return {"stalled_at_step": check.stalled_at,
            "unigram_entropy": lv.entropy if lv is not None else None,
            "unigram_loss": lv.val_loss if lv is not None else None}


def judge_run_folder(run_dir: Path) -> StallCheck | None:
    """The stall rule applied afterwards to a finished run folder (its ``config.yaml``,
    ``metrics.jsonl`` and data), for summaries written before the rule existed; None when it
    cannot be applied (no config or validation points, or its data is no longer there).
    The config's stall keys, absent from such a config, take their defaults."""
    from modbench.runtime.data import open_data  # opens (and checks) the run's data

    try:
        tree = yaml.safe_load((Path(run_dir) / CONFIG).read_text())
        tree.pop("meta", None)
        cfg = from_dict(tree)
        cfg = replace(cfg, data=replace(cfg.data, verify=False))  # read, not re-checked
        vals = val_points(read_metrics(Path(run_dir)))
        if not vals:
            return None
        level = unigram_level(open_data(cfg, progress=False), cfg.train.eval_sequences)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError,
            ModbenchError):
        return None
    return check_stall(cfg, vals, level)


__all__ = ["StallCheck", "check_stall", "judge_run_folder", "stalled_at", "summary_fields"]
