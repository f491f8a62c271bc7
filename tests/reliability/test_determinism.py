"""Determinism on the CPU: the same config and seeds, trained twice in separate processes,
give identical metrics.jsonl (less tokens/s), summaries (less timing) and final checkpoints
(weights and optimizer state, bit for bit); and runs on one data order record one batch
hash whatever the method or init seed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.reliability.checks import run_child, run_differences, strip_summary
from tests.reliability.conftest import long_points, long_variant
from tests.reliability.harness import train_child

from modbench.config import resolve

CONFIGS: dict[str, tuple[str, int, list[str]]] = {
    "baseline/probe rows": ("baseline", 0, ["data.probe_mix=0.25", "data.probe_loss=answers",
                                            "train.eval_every=5"]),
    "ngpt/accumulation": ("ngpt", 3, ["train.micro_batch_size=2", "train.eval_every=0"]),
    "post_ln+qknorm/eval probes": ("post_ln+qknorm", 1, ["train.eval_probes=2",
                                                         "train.eval_every=10"]),
    "hyper_connections": ("hyper_connections", 2, []),
}


def twice(ctx: Any, tmp: Path, names: list[str], repeats: int) -> dict[str, Any]:
    identical = 0
    problems = []
    for name in names:
        method, seed, overrides = CONFIGS[name]
        cfg = resolve("tiny", method=method, seed=seed, steps=20,
                      overrides=["train.threads=1", *overrides]).to_dict()
        folders = []
        for i in range(repeats):
            folder = tmp / f"{name.replace('/', '_')}-{i}"
            assert run_child(ctx, train_child, (cfg, str(folder), False, None, None)) == 0
            folders.append(folder)
        for other in folders[1:]:
            diffs = run_differences(folders[0], other)
            identical += not diffs
            problems += [f"{name}: {d}" for d in diffs]
    return {"configs": len(names), "repeats": repeats,
            "pairs": len(names) * (repeats - 1), "identical": identical, "failures": problems}


def test_same_config_same_seed_same_run(forkserver: Any, tmp_path: Path, record: Any) -> None:
    t0 = time.perf_counter()
    res = twice(forkserver, tmp_path, list(CONFIGS), repeats=2)
    record({"seconds": round(time.perf_counter() - t0, 1), **res})
    assert not res["failures"], res["failures"]
    # one data order, one batch hash: every method and init seed without probe rows
    hashes = {strip_summary(tmp_path / f"{n.replace('/', '_')}-0")["batches_sha256"]
              for n in ("ngpt/accumulation", "post_ln+qknorm/eval probes",
                        "hyper_connections")}
    assert len(hashes) == 1


@long_variant
def test_same_config_same_seed_same_run_long(forkserver: Any, tmp_path: Path,
                                            record: Any) -> None:
    res = twice(forkserver, tmp_path, list(CONFIGS), repeats=max(2, long_points() // 25))
    record(res)
    assert not res["failures"], res["failures"]
