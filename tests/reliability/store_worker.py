"""A worker process on a shared results store (test_store_concurrency.py starts many).

    python tests/reliability/store_worker.py ROOT KEYS_JSON OUT_JSON SEED [--die-holding N]

Waits for the parent's ``go`` file next to KEYS_JSON (``go-die`` for a worker that is to
die: those go first, so that each surely claims something before it dies), then loops over
the keys in its own random order: claims what it can, does the "work" (a marker file per
claim, then summary.json written atomically), records it with ``Store.finish``.
When nothing is left to claim but runs are unfinished it releases the claims of dead
workers (``Store.release_dead``) and tries again. With ``--die-holding N`` it SIGKILLs
itself right after its N-th successful claim, holding that claim. It writes the keys it
finished to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from modbench.fsutil import atomic_write_text
from modbench.study.store import Store


def main(argv: list[str]) -> int:
    root, keys_file, out_file, seed = argv[:4]
    die_at = int(argv[5]) if len(argv) > 5 and argv[4] == "--die-holding" else 0
    keys = json.loads(Path(keys_file).read_text())
    store = Store(root)
    # start together: say ready, wait for the parent's go
    ready = Path(out_file).with_suffix(".ready")
    ready.touch()
    go = Path(keys_file).with_name("go-die" if die_at else "go")
    while not go.exists():
        time.sleep(0.005)
    order = list(keys)
    random.Random(int(seed)).shuffle(order)
    mine: list[str] = []
    claims = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        progressed = False
        for key in order:
            if store.state(key) == "done" or not store.claim(key):
                continue
            claims += 1
            run = store.run_dir(key)
            run.mkdir(parents=True, exist_ok=True)
            (run / f"claimed-by-{os.getpid()}").touch()
            if claims == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            summary = {"status": "completed", "worker": os.getpid(), "key": key}
            atomic_write_text(run / "summary.json", json.dumps(summary))
            store.finish(key, summary, None)
            mine.append(key)
            progressed = True
        if all(store.state(k) == "done" for k in keys):
            break
        if not progressed:
            store.release_dead()
            time.sleep(0.01)
    Path(out_file).write_text(json.dumps(mine))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
