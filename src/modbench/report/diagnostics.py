"""``modbench diagnose``: a run's diagnostics (:mod:`modbench.eval.diagnostics`) written as
``diagnostics.json`` and PNG figures (docs/diagnostics.md)::

    OUT/diagnostics.json   every figure; nulls with their reasons under "null_reasons"
    OUT/stream.png         per sublayer: RMS, variance, max |x| and excess kurtosis of the
                           residual stream (and of the FFN hidden activations)
    OUT/layers.png         per layer: angular distance, skip delta-loss, gradient norm,
                           attention/FFN share of the update
    OUT/attention.png      per layer: attention entropy and mass on the first token
    OUT/weights.png        per layer and matrix: condition number and power-law alpha

``OUT`` defaults to ``RUN_DIR/diagnostics``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modbench.eval.diagnostics import DEFAULT_BATCHES, diagnose_run
from modbench.fsutil import atomic_write_text
from modbench.report.blocks import Block
from modbench.report.plots import depth_plot

DIAGNOSTICS_DIR = "diagnostics"  # RUN_DIR/diagnostics/, where a study keeps them too
DIAGNOSTICS_JSON = "diagnostics.json"
FIGURES = ("stream.png", "layers.png", "attention.png", "weights.png")
SUBLAYERS = ("attn", "ffn")


@dataclass
class Diagnosis:
    """What :func:`diagnose` wrote."""

    result: dict[str, Any]
    json_path: Path
    figures: list[Path]


def diagnose(run_dir: str | Path, *, batches: int = DEFAULT_BATCHES,
             out: str | Path | None = None, threads: int = 0,
             progress: bool = True, figures: bool = True) -> Diagnosis:
    """Diagnose a trained run on ``batches`` validation batches; write ``diagnostics.json``
    and (``figures``) the figures to ``out`` (default ``RUN_DIR/diagnostics``). ``threads``:
    see :func:`modbench.eval.diagnostics.diagnose_run`."""
    result = diagnose_run(run_dir, batches=batches, threads=threads, progress=progress)
    folder = Path(out) if out is not None else Path(run_dir) / DIAGNOSTICS_DIR
    path = folder / DIAGNOSTICS_JSON
    atomic_write_text(path, json.dumps(result, indent=1, allow_nan=False) + "\n")
    return Diagnosis(result, path, diagnostics_figures(result, folder) if figures else [])


def diagnostics_figures(result: dict[str, Any], folder: Path) -> list[Path]:
    """The four PNG figures of a diagnostics result (:data:`FIGURES`), into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    layers = result["layers"]
    n = len(layers)
    title = f"{result.get('method', '?')} — {result.get('preset', '?')}, step {result.get('step')}"
    subs = [layer[s] for layer in layers for s in SUBLAYERS]
    final = result["final"]
    sub_ticks = [f"{i}.{s}" for i in range(n) for s in SUBLAYERS] + ["final"]

    def stream(key: str) -> list[float | None]:
        return [s[key] for s in subs] + [final[key]]

    def hidden(key: str) -> list[float | None]:
        return [s.get(key) for s in subs] + [None]

    paths = [depth_plot([
        ("RMS", {"stream": stream("rms")}, True),
        ("variance", {"stream": stream("variance")}, True),
        ("max |x|", {"stream": stream("max_abs"), "FFN hidden": hidden("hidden_max_abs")},
         True),
        ("excess kurtosis", {"stream": stream("excess_kurtosis"),
                             "FFN hidden": hidden("hidden_excess_kurtosis")}, False),
    ], sub_ticks, f"residual stream by sublayer input — {title}", folder / FIGURES[0])]

    ticks = [str(i) for i in range(n)]

    def per_layer(key: str) -> list[float | None]:
        return [layer[key] for layer in layers]

    def per_sub(sub: str, key: str) -> list[float | None]:
        return [layer[sub][key] for layer in layers]

    paths.append(depth_plot([
        ("angular distance", {"block": per_layer("angular_distance"),
                              "attn": per_sub("attn", "angular_distance"),
                              "ffn": per_sub("ffn", "angular_distance")}, False),
        ("Δ loss, layer skipped", {"skip": per_layer("skip_delta_loss")}, False),
        ("gradient norm", {"grad": per_layer("grad_norm")}, True),
        ("share of the update", {"attn": per_sub("attn", "update_share"),
                                 "ffn": per_sub("ffn", "update_share")}, False),
    ], ticks, f"layers — {title}", folder / FIGURES[1]))
    paths.append(depth_plot([
        ("attention entropy (nats)", {"entropy": per_sub("attn", "attn_entropy")}, False),
        ("mass on first token", {"sink": per_sub("attn", "attn_sink")}, False),
    ], ticks, f"attention — {title}", folder / FIGURES[2]))
    cond: dict[str, list[float | None]] = {}
    alpha: dict[str, list[float | None]] = {}
    for w in result["weights"]:
        if w["layer"] is None:
            continue
        kind = w["name"].split(".", 2)[2].removesuffix(".weight")
        cond.setdefault(kind, [None] * n)[w["layer"]] = w["condition_number"]
        alpha.setdefault(kind, [None] * n)[w["layer"]] = w["alpha"]
    paths.append(depth_plot([
        ("condition number", cond, True),
        ("power-law α", alpha, False),
    ], ticks, f"weight matrices by layer — {title}", folder / FIGURES[3]))
    return paths


# ------------------------------------------------------------------- in a study report

#: The per-run figures of the report's diagnostics tables: (key, column header, digits).
#: Each is one number per diagnosed run (:func:`run_figures`), averaged over seeds.
LAYER_COLUMNS = (
    ("validation_loss", "loss (diag. batches)", 5),
    ("variance_growth", "variance, last block / block 1", 3),
    ("skip_mean", "skip Δloss, mean", 3),
    ("skip_min", "skip Δloss, min", 3),
    ("grad_first_last", "grad norm, first/last layer", 3),
    ("max_abs", "max abs(x)", 3),
    ("max_kurtosis", "max excess kurtosis", 3),
    ("attn_sink", "attention sink", 3),
)
MIN_MATRIX_SIDE = 8  # the power-law fit's minimum number of eigenvalues, too
WEIGHT_COLUMNS = (
    ("condition_median", "condition number, median", 3),
    ("alpha_median", "power-law α, median", 3),
    ("w4_per_channel", "Δloss W4 per channel", 3),
    ("w4_group", "Δloss W4 group", 3),
    ("a8_per_token", "Δloss A8 per token", 3),
)


def read_diagnostics(run_dir: Path | None) -> dict[str, Any] | None:
    """A run's ``diagnostics/diagnostics.json``, or None where it has none (or an unreadable
    one)."""
    if run_dir is None:
        return None
    path = Path(run_dir) / DIAGNOSTICS_DIR / DIAGNOSTICS_JSON
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("layers"), list) else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _mean(values: list[Any]) -> float | None:
    vals = [x for x in (_num(v) for v in values) if x is not None]
    return sum(vals) / len(vals) if vals else None


def _ratio(a: Any, b: Any) -> float | None:
    x, y = _num(a), _num(b)
    return x / y if x is not None and y is not None and y != 0 else None


def _extreme(values: list[Any], pick: Any) -> float | None:
    vals = [x for x in (_num(v) for v in values) if x is not None]
    return pick(vals) if vals else None


def run_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """One run's diagnostics reduced to the table's numbers (None where the figures are
    null): the variance of the stream entering the last block over that entering block 1
    (block 0 reads the embedding, whose scale is the initialisation's); the mean and smallest
    skip Δloss over the layers; the gradient norm of the first block over the last's; the
    largest |x| and excess kurtosis of the stream (every sublayer's input and the output); the
    mean attention mass on the first token; the median condition number and power-law α of
    the block matrices with at least :data:`MIN_MATRIX_SIDE` rows and columns (a method's
    small side matrices, such as CoMT's width-2 modulators, left out); the loss increase under
    each quantization."""
    layers = result["layers"]
    subs = [layer[s] for layer in layers for s in SUBLAYERS] + [result.get("final") or {}]
    block_w = [w for w in result.get("weights", []) if w.get("layer") is not None
               and min(w.get("shape") or [0]) >= MIN_MATRIX_SIDE]
    quant = result.get("quantization") or {}
    skips = [layer.get("skip_delta_loss") for layer in layers]
    return {
        "validation_loss": _num(result.get("validation_loss")),
        "variance_growth": (_ratio(layers[-1]["attn"].get("variance"),
                                   layers[1]["attn"].get("variance")) if len(layers) > 1
                            else None),
        "skip_mean": _mean(skips),
        "skip_min": _extreme(skips, min),
        "grad_first_last": _ratio(layers[0].get("grad_norm"), layers[-1].get("grad_norm")),
        "max_abs": _extreme([s.get("max_abs") for s in subs], max),
        "max_kurtosis": _extreme([s.get("excess_kurtosis") for s in subs], max),
        "attn_sink": _mean([layer["attn"].get("attn_sink") for layer in layers]),
        "condition_median": _median([w.get("condition_number") for w in block_w]),
        "alpha_median": _median([w.get("alpha") for w in block_w]),
        **{k: _num((quant.get(k) or {}).get("delta"))
           for k in ("w4_per_channel", "w4_group", "a8_per_token")},
    }


def _sig(v: float | None, digits: int) -> str:
    """A table cell: ``digits`` significant digits (small Δloss values keep theirs)."""
    return "–" if v is None else f"{v:.{digits}g}"


def _median(values: list[Any]) -> float | None:
    vals = sorted(x for x in (_num(v) for v in values) if x is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def depth_profiles(result: dict[str, Any]) -> dict[str, list[float | None]]:
    """Per layer: the variance of the stream entering the block, the skip Δloss and the
    gradient norm."""
    layers = result["layers"]
    return {"variance": [_num(layer["attn"].get("variance")) for layer in layers],
            "skip_delta_loss": [_num(layer.get("skip_delta_loss")) for layer in layers],
            "grad_norm": [_num(layer.get("grad_norm")) for layer in layers]}


def training_profiles(records: list[dict[str, Any]]) -> dict[str, list[float | None]] | None:
    """From a run's ``metrics.jsonl`` records with ``layers`` (``train.log_layers``): per
    layer, the median gradient norm over the logged steps and the activation RMS at the last
    one; None without such records."""
    logged = [r["layers"] for r in records
              if r.get("kind") == "train" and isinstance(r.get("layers"), dict)]
    if not logged:
        return None
    n = len(logged[-1].get("grad_norm") or [])
    grads = [_median([(x.get("grad_norm") or [None] * n)[i] for x in logged]) for i in range(n)]
    return {"grad_norm": grads, "act_rms": [_num(v) for v in logged[-1].get("act_rms") or []]}


def _mean_profile(profiles: list[list[float | None]]) -> list[float | None]:
    n = max((len(p) for p in profiles), default=0)
    return [_mean([p[i] if i < len(p) else None for p in profiles]) for i in range(n)]


def _scale_intro(scale: str, here: list[Any], per: dict[str, list[dict[str, Any]]]) -> Block:
    """What was diagnosed at ``scale`` (runs, validation batches) and what the columns mean."""
    batches = sorted({d["batches"] for ds in per.values() for d in ds
                      if isinstance(d.get("batches"), int)})
    n_runs = sum(len(ds) for ds in per.values())
    return Block("p", f"**{scale}**: `modbench diagnose` on {n_runs} of "
                      f"{len(here)} finished runs that did not diverge "
                      f"({'/'.join(str(b) for b in batches)} validation "
                      f"batch{'es' if batches != [1] else ''} each); every "
                      "number is the mean over the seeds "
                      "diagnosed. Skip Δloss: the validation loss with the "
                      "layer replaced by the identity minus the model's; "
                      "variance: of the residual stream entering a block; "
                      "Δloss W4 / A8: the loss increase under 4-bit "
                      "round-to-nearest weights (per output channel, or per "
                      "group of 128 inputs) and 8-bit per-token activations "
                      "(quantization robustness).")


def _method_tables(per: dict[str, list[dict[str, Any]]]) -> list[Block]:
    """The per-layer and the weight figures, one row per method (mean over its seeds)."""
    figs = {m: [run_figures(d) for d in ds] for m, ds in per.items()}
    blocks = []
    for cols in (LAYER_COLUMNS, WEIGHT_COLUMNS):
        body = [[f"`{m}`", str(len(fs)), *[_sig(_mean([f[k] for f in fs]), dig)
                                           for k, _, dig in cols]]
                for m, fs in figs.items() if fs]
        blocks.append(Block("table", header=["method", "seeds",
                                             *[h for _, h, _ in cols]], rows=body))
    return blocks


def _depth_plot_block(per: dict[str, list[dict[str, Any]]], scale: str, out: Path) -> Block:
    """The depth profiles of `modbench diagnose`, one line per method (mean over seeds)."""
    profiles = {m: [depth_profiles(d) for d in ds] for m, ds in per.items() if ds}

    def series(key: str) -> dict[str, list[float | None]]:
        return {m: _mean_profile([p[key] for p in ps]) for m, ps in profiles.items()}

    n_layers = max(len(v) for ps in profiles.values() for p in ps for v in p.values())
    path = depth_plot([
        ("variance entering the block", series("variance"), True),
        ("Δ loss, layer skipped", series("skip_delta_loss"), False),
        ("gradient norm", series("grad_norm"), True),
    ], [str(i) for i in range(n_layers)], f"depth profiles (mean over seeds) — {scale}",
        out / f"depth_profiles_{scale}.png", xlabel="layer")
    return Block("img", f"Depth profiles from `modbench diagnose`, {scale}: one "
                        "line per method", path=path)


def _training_plot_block(trained: dict[str, list[dict[str, Any]]], scale: str,
                         out: Path) -> Block:
    """Per-layer gradient norm and activation RMS logged during training, one line per
    method (mean over seeds)."""
    n_layers = max(len(p["grad_norm"]) for ps in trained.values() for p in ps)
    path = depth_plot([
        ("gradient norm (median over logged steps)",
         {m: _mean_profile([p["grad_norm"] for p in ps]) for m, ps in trained.items()},
         True),
        ("activation RMS (last logged step)",
         {m: _mean_profile([p["act_rms"] for p in ps]) for m, ps in trained.items()},
         True),
    ], [str(i) for i in range(n_layers)],
        f"layers during training (train.log_layers, mean over seeds) — {scale}",
        out / f"training_layers_{scale}.png", xlabel="layer")
    return Block("img", f"Per-layer gradient norm and activation RMS during "
                        f"training (train.log_layers), {scale}", path=path)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def study_diagnostics(rows: list[Any], baseline: str, out: Path) -> list[Block]:
    """The report's diagnostics section (report blocks; none when no run has diagnostics or
    per-layer logs): per scale, the per-method tables (mean over the seeds diagnosed), the
    depth profiles (one line per method, x axis the layer), and the per-layer training logs;
    and ``diagnostics.csv`` (one row per diagnosed run). ``rows``: the study's
    :class:`~modbench.analysis.results.RunRow` s; only finished runs that did not diverge."""
    from modbench.runtime.runfolder import read_metrics

    ok = [r for r in rows if r.state == "done" and r.status != "diverged"
          and r.run_dir is not None]
    diag = {r.key: d for r in ok if (d := read_diagnostics(r.run_dir)) is not None}
    logs = {r.key: t for r in ok if (t := training_profiles(read_metrics(r.run_dir)))}
    if not diag and not logs:
        return []
    blocks = [Block("h2", "Diagnostics (docs/diagnostics.md)")]
    csv_rows = []
    for scale in sorted({r.scale for r in ok}):
        here = [r for r in ok if r.scale == scale]
        methods = sorted({r.method for r in here}, key=lambda m: (m != baseline, m))
        per: dict[str, list[dict[str, Any]]] = {
            m: [diag[r.key] for r in here if r.method == m and r.key in diag] for m in methods}
        if diag.keys() & {r.key for r in here}:
            blocks.append(_scale_intro(scale, here, per))
            blocks += _method_tables(per)
            csv_rows += [{"scale": scale, "method": r.method, "seed": r.seed,
                          **run_figures(diag[r.key])} for r in here if r.key in diag]
            blocks.append(_depth_plot_block(per, scale, out))
        trained = {m: [logs[r.key] for r in here if r.method == m and r.key in logs]
                   for m in methods}
        trained = {m: ps for m, ps in trained.items() if ps}
        if trained:
            blocks.append(_training_plot_block(trained, scale, out))
    if csv_rows:
        _write_csv(out / "diagnostics.csv", csv_rows)
    return blocks


__all__ = ["DIAGNOSTICS_DIR", "DIAGNOSTICS_JSON", "FIGURES", "Diagnosis", "depth_profiles",
           "diagnose", "diagnostics_figures", "read_diagnostics", "run_figures",
           "study_diagnostics", "training_profiles"]
