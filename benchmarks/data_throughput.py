"""Data throughput: tokenizing a corpus with ``prepare`` (1 vs N worker processes) and reading
prepared shards back through ``TokenDataset.train_batch`` (the training loop's data path).

The corpus is the built-in one (Python's own documentation text) repeated to ``--mb``
megabytes and written as C4-style ``c4-train.0000X-of-01024.json.gz`` shards; the tokenizer is
the built-in byte-level BPE (``--vocab``). ``TOKENIZERS_PARALLELISM=false`` is set so one
worker is one core. Rounds are interleaved (1, N, 1, N, ...) and medians reported, so the
ratios come from one run on the same machine state.

Usage::

    python benchmarks/data_throughput.py                  # 16 MB, workers 1 and 2, 3 rounds
    python benchmarks/data_throughput.py --mb 64 --workers 1,2,4 --rounds 2 --json
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers loads: 1 worker = 1 core

import argparse
import gzip
import json
import multiprocessing as mp
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from modbench.data import builtin_documents, builtin_tokenizer, open_dataset
from modbench.data.parallel import Encoder, EncoderSpec
from modbench.data.prepare import PrepareSettings, prepare_dataset, token_dtype
from modbench.data.sources import open_source
from modbench.data.tokenizer import find_eos_id, tokenizer_json


def write_corpus(root: Path, megabytes: float, files: int) -> list[str]:
    """C4-style shards holding ``megabytes`` of text; returns the documents."""
    base = builtin_documents()
    target = int(megabytes * 1e6)
    docs: list[str] = []
    chars = 0
    rep = 0
    while chars < target:
        for d in base:
            text = d if rep == 0 else f"[{rep}] {d}"  # not byte-identical copies
            docs.append(text)
            chars += len(text)
            if chars >= target:
                break
        rep += 1
    (root / "en").mkdir(parents=True)
    per = -(-len(docs) // files)
    for f in range(files):
        with gzip.open(root / "en" / f"c4-train.{f:05d}-of-01024.json.gz", "wt",
                       encoding="utf-8") as fh:
            for i, text in enumerate(docs[f * per : (f + 1) * per]):
                fh.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                                     "url": f"https://example.com/{f}/{i}"}) + "\n")
    return docs


def encoder_only(tok: object, docs: list[str]) -> tuple[float, int]:
    """Tokens/s of the worker's encode step alone, in this process (no reading, no writing)."""
    spec = EncoderSpec(tokenizer_json(tok).decode(), find_eos_id(tok),  # type: ignore[arg-type]
                       token_dtype(tok.get_vocab_size()).str, 0.0)  # type: ignore[attr-defined]
    enc = Encoder(spec)
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(docs), 512):
        n += int(enc(docs[i : i + 512]).ids.size)  # type: ignore[arg-type]
    return n / (time.perf_counter() - t0), n


def _spin(n: int) -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t0


def parallelism(workers: int, n: int = 10_000_000) -> float:
    """How many cores ``workers`` processes actually get right now: a fixed CPU-bound spin,
    alone and ``workers`` at once (``workers`` x alone / together). On a shared machine this
    says what speedup to expect at best."""
    alone = _spin(n)
    with mp.get_context("fork").Pool(workers) as pool:
        t0 = time.perf_counter()
        pool.map(_spin, [n] * workers)
        together = time.perf_counter() - t0
    return workers * alone / together


def source_only(root: Path) -> float:
    """Seconds the main process spends reading the source alone (gunzip + JSON, no tokens)."""
    src = open_source(root)
    t0 = time.perf_counter()
    for _ in src.iter_positioned(list(range(len(src.file_names())))):
        pass
    return time.perf_counter() - t0


def read_back(path: Path, batches: list[int], steps: int, rounds: int) -> list[dict[str, float]]:
    """``train_batch`` timed per batch size, rounds interleaved, medians."""
    ds = open_dataset(path, verify=False)
    rows = ds.num_sequences("train")
    ms: dict[int, list[float]] = {b: [] for b in batches}
    for b in batches:
        ds.train_batch(0, b, 0)  # page the shards in, draw epoch 0's permutation
    for _ in range(rounds):
        for b in batches:
            t0 = time.perf_counter()
            for step in range(steps):
                ds.train_batch(step, b, 0)
            ms[b].append(1000 * (time.perf_counter() - t0) / steps)
    return [{"batch": b, "rows": rows, "epochs": steps * b / rows,
             "ms_per_batch": statistics.median(ms[b]),
             "tokens_per_s": b * ds.seq_len / statistics.median(ms[b]) * 1000}
            for b in batches]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0, help="megabytes of text to tokenize")
    ap.add_argument("--files", type=int, default=8, help="json.gz shards to spread it over")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batches", default="8,64,512", help="rows per train_batch call")
    ap.add_argument("--steps", type=int, default=200, help="train_batch calls to time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="modbench-bench-"))
    try:
        tok = builtin_tokenizer(args.vocab)
        docs = write_corpus(tmp / "c4", args.mb, args.files)
        n_docs, n_chars = len(docs), sum(len(d) for d in docs)
        enc_tps, _ = encoder_only(tok, docs)
        read_s = source_only(tmp / "c4")
        times: dict[int, list[float]] = {w: [] for w in workers}
        cores: list[float] = []
        tokens = 0
        for r in range(args.rounds):
            cores.append(parallelism(max(workers)))
            for w in workers:
                out = tmp / f"out-{w}-{r}"
                t0 = time.perf_counter()
                meta = prepare_dataset(
                    tmp / "c4", tok, out,
                    PrepareSettings(seq_len=args.seq_len, val_fraction=0.0005, workers=w,
                                    progress=False),
                )
                times[w].append(time.perf_counter() - t0)
                tokens = meta["tokens"]
                if (w, r) != (workers[0], 0):
                    shutil.rmtree(out)
        keep = tmp / f"out-{workers[0]}-0"
        reads = read_back(keep, [int(b) for b in args.batches.split(",")], args.steps,
                          args.rounds)

        base = statistics.median(times[workers[0]])
        result = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
                       f"{platform.python_implementation()} {platform.python_version()}",
            "corpus": {"documents": n_docs, "characters": n_chars, "tokens": tokens,
                       "vocab": args.vocab, "seq_len": args.seq_len},
            "cores_available": statistics.median(cores),
            "encode_only_tokens_per_s": enc_tps,
            "read_source_only_tokens_per_s": None,
            "prepare": [{"workers": w, "median_s": statistics.median(t),
                         "tokens_per_s": tokens / statistics.median(t),
                         "tokens_per_s_per_worker": tokens / statistics.median(t) / w,
                         "speedup": base / statistics.median(t), "runs_s": t}
                        for w, t in times.items()],
            "read_back": reads,
        }
        result["read_source_only_tokens_per_s"] = tokens / read_s
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if args.json:
        print(json.dumps(result, indent=2))
        return
    c = result["corpus"]
    print(f"machine: {result['machine']}")
    print(f"corpus: {c['characters'] / 1e6:.1f} MB of text, {c['documents']:,} documents, "
          f"{c['tokens']:,} tokens (vocab {c['vocab']}, chars/token "
          f"{c['characters'] / c['tokens']:.2f})")
    print(f"cores {max(workers)} processes actually got (CPU spin, median): "
          f"{result['cores_available']:.2f}")
    print(f"encode step alone, 1 core: {result['encode_only_tokens_per_s']:,.0f} tokens/s")
    print(f"reading the source alone (main process: gunzip + JSON), 1 core: "
          f"{result['read_source_only_tokens_per_s']:,.0f} tokens/s")
    print("\n| workers | prepare (s, median) | tokens/s | tokens/s per worker | speedup |")
    print("|---:|---:|---:|---:|---:|")
    for p in result["prepare"]:
        print(f"| {p['workers']} | {p['median_s']:.2f} | {p['tokens_per_s']:,.0f} | "
              f"{p['tokens_per_s_per_worker']:,.0f} | {p['speedup']:.2f}x |")
    print(f"\nread-back (TokenDataset.train_batch, seq_len {c['seq_len']}, page cache warm):")
    print("\n| rows per batch | ms per batch | tokens/s |")
    print("|---:|---:|---:|")
    for r in result["read_back"]:
        print(f"| {r['batch']} | {r['ms_per_batch']:.3f} | {r['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
