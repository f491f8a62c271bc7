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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modbench.eval.diagnostics import DEFAULT_BATCHES, diagnose_run
from modbench.fsutil import atomic_write_text
from modbench.report.plots import depth_plot

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
             progress: bool = True) -> Diagnosis:
    """Diagnose a trained run on ``batches`` validation batches; write ``diagnostics.json``
    and the figures to ``out`` (default ``RUN_DIR/diagnostics``). ``threads``: see
    :func:`modbench.eval.diagnostics.diagnose_run`."""
    result = diagnose_run(run_dir, batches=batches, threads=threads, progress=progress)
    folder = Path(out) if out is not None else Path(run_dir) / "diagnostics"
    path = folder / DIAGNOSTICS_JSON
    atomic_write_text(path, json.dumps(result, indent=1, allow_nan=False) + "\n")
    return Diagnosis(result, path, diagnostics_figures(result, folder))


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


__all__ = ["DIAGNOSTICS_JSON", "FIGURES", "Diagnosis", "diagnose", "diagnostics_figures"]
