"""Fixed-seed training curves of a few methods, recorded so that a refactor of the trainer,
the model or the data path can be checked against numbers taken before it.

``golden_curves.json`` beside this file holds, per case, every ``metrics.jsonl`` record (less
``tokens_per_s``), the summary's losses and probes, and two fingerprints of the final weights.
Re-record it only for a change that is *meant* to alter numerics, and say so in the commit::

    python -m tests.train.golden            # rewrite tests/train/golden_curves.json
    python -m tests.train.golden --out F    # write elsewhere (to diff against the recorded)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from modbench.config import resolve

GOLDEN = Path(__file__).with_name("golden_curves.json")

# name -> (method, steps, overrides): each exercises a different part of the loop
CASES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "baseline_probes": ("baseline", 10, ("train.eval_every=5", "train.eval_probes=8")),
    "post_ln_qknorm_micro": ("post_ln+qknorm", 8, ("train.micro_batch_size=4",
                                                   "train.checkpoint_every=4",
                                                   "train.eval_every=4")),
    "ngpt_callback": ("ngpt", 8, ()),
    "powernorm_step_callback": ("powernorm", 8, ()),
    "hyper_connections": ("hyper_connections", 6, ()),
    "deepnorm_layernorm": ("deepnorm+layernorm", 6, ()),
    "comt_wrappers": ("comt", 6, ()),
    "softpick_explicit": ("softpick", 6, ()),
    "attnres_stream": ("attnres", 6, ()),
    "tokenformer": ("tokenformer", 6, ()),
    "probe_answers": ("baseline", 8, ("data.probe_mix=0.5", "data.probe_loss=answers",
                                      "train.eval_every=4")),
    "seed3_untied_adam": ("baseline", 6, ("model.tie_embeddings=false", "recipe.name=c4-mixln",
                                          "recipe.optimizer=adam", "recipe.grad_clip=0")),
}


def measure(name: str, folder: Path) -> dict[str, Any]:
    """Train case ``name`` into ``folder`` and return what the golden file keeps of it."""
    from modbench.train.trainer import train

    method, steps, overrides = CASES[name]
    seed = 3 if name.startswith("seed3") else 0
    cfg = resolve("tiny", method=method, seed=seed, steps=steps, overrides=list(overrides))
    summary = train(cfg, folder, progress=False)
    records = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec.pop("tokens_per_s", None)
        records.append(rec)
    weights = torch.load(folder / "checkpoints" / "last.pt", map_location="cpu",
                         weights_only=True)["model"]
    tensors = [w.double() for w in weights.values() if w.is_floating_point()]
    return {
        "records": records,
        "summary": {k: summary.get(k) for k in ("status", "steps", "tokens", "params",
                                                "initial_val_loss", "final_val_loss",
                                                "final_probes")},
        "weights_sum": float(sum(t.sum() for t in tensors)),
        "weights_sq": float(sum(t.square().sum() for t in tensors)),
    }


def record(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = {name: measure(name, Path(tmp) / name) for name in CASES}
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GOLDEN)
    record(parser.parse_args().out)
