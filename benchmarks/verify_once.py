"""Opening a prepared dataset with ``verify``: every file hashed (no ``verified.json``, as every
run start was before issue 46 item 6) vs accepted from the record (files unchanged since they
were verified), side by side in one run.

The corpus is synthetic: ``--mb`` megabytes of random uint16 token ids in ``--shards`` shards
under a real ``metadata.json`` and ``tokenizer.json``, dated an hour back (a file written in
the last seconds is not recorded). The shards sit in the page cache after the first read, so
the full hash here is bounded by sha256 and the token-id scan, not by the disk: on a cold
parallel file system it is slower still, and the ratio larger.

Usage::

    python benchmarks/verify_once.py                    # 300 MB, 12 shards, 5 rounds
    python benchmarks/verify_once.py --mb 1000 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from _timing import interleaved_medians  # benchmarks/_timing.py

from modbench.data import open_dataset, train_bpe
from modbench.data.prepare import FORMAT, FORMAT_VERSION
from modbench.data.verify_record import RECORD_FILE

SEQ_LEN = 1024
VOCAB = 512


def write_corpus(root: Path, megabytes: float, shards: int) -> None:
    """Random token shards (all but one train, one val), a small BPE tokenizer, the manifest."""
    tok = train_bpe([f"document {i} with a few words in it" for i in range(200)], VOCAB)
    tok.save(str(root / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    rows = max(1, int(megabytes * 1e6 / shards / (2 * SEQ_LEN)))
    rng = np.random.default_rng(0)
    splits: dict[str, dict[str, object]] = {}
    for split, count in (("train", shards - 1), ("val", 1)):
        entries = []
        for k in range(count):
            ids = rng.integers(0, vocab, size=(rows, SEQ_LEN), dtype=np.uint16)
            name = f"{split}_{k:05d}.bin"
            (root / name).write_bytes(ids.astype("<u2").tobytes())
            entries.append({"file": name, "sequences": rows,
                            "sha256": hashlib.sha256(ids.astype("<u2").tobytes()).hexdigest()})
        splits[split] = {"sequences": rows * count, "shards": entries}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "seq_len": SEQ_LEN,
            "dtype": "uint16", "source": "synthetic",
            "tokenizer": {"spec": "synthetic", "vocab_size": vocab, "eos_id": 0,
                          "sha256": hashlib.sha256(
                              (root / "tokenizer.json").read_bytes()).hexdigest()},
            "splits": splits}
    (root / "metadata.json").write_text(json.dumps(meta))
    hour_ago = time.time_ns() - 3600 * 10**9
    for f in root.iterdir():
        os.utime(f, ns=(hour_ago, hour_ago))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=300.0, help="megabytes of shards")
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="modbench-verify-once-"))
    try:
        write_corpus(root, args.mb, args.shards)
        size = sum(f.stat().st_size for f in root.glob("*.bin"))
        record = root / RECORD_FILE

        def full() -> None:  # no record: every file read and hashed, then recorded
            record.unlink(missing_ok=True)
            open_dataset(root)

        def recorded() -> None:  # the record (every open rewrites it): files accepted unread
            open_dataset(root)

        open_dataset(root)
        assert record.is_file(), "the first open wrote no record"
        secs = interleaved_medians({"full hash": full, "with record": recorded}, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"mb": size / 1e6, "shards": args.shards, "rounds": args.rounds,
           "full_s": secs["full hash"], "record_s": secs["with record"],
           "ratio": secs["full hash"] / secs["with record"],
           "full_gb_per_s": size / 1e9 / secs["full hash"],
           "machine": f"{platform.machine()} {os.cpu_count()} cpus, python "
                      f"{platform.python_version()}"}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['mb']:.0f} MB in {args.shards} shards, {args.rounds} rounds, medians "
          f"({out['machine']})")
    print(f"  full hash    {out['full_s'] * 1000:9.1f} ms  ({out['full_gb_per_s']:.2f} GB/s)")
    print(f"  with record  {out['record_s'] * 1000:9.1f} ms")
    print(f"  ratio        {out['ratio']:9.0f}x")


if __name__ == "__main__":
    main()
