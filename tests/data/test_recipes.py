"""The source papers' corpora (`prepare --recipe c4-llama|climbmix`, `train-tokenizer`), on
small local files in the real sources' layouts: C4's ``en/c4-train.0000X-of-01024.json.gz``
JSON lines (text, timestamp, url) and ClimbMix-style parquet shards (text, or nvidia's GPT-2
token ids). The LLaMA and GPT-2 tokenizers are stood in for by small BPEs trained here."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

import modbench.data.prepare as prep
from modbench.cli import run_cli
from modbench.data import is_validation_document, open_dataset, train_bpe
from modbench.data.cli import data_app
from modbench.data.corpora import prepare_recipe, recipe_options, train_recipe_tokenizer
from modbench.data.sources import SourceUnavailable, open_source
from modbench.errors import ModbenchError

runner = CliRunner()
SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "vo", "pe", "an", "el", "or", "ux",
             "qua", "zen", "thr", "ly", "ck", "é", "ß", "東", "🙂"]
SEQ = 32


def make_corpus(n: int, seed: int = 0) -> list[str]:
    """Pseudo-text with enough distinct words for a few hundred BPE merges; a few documents
    are empty or blank (they must be skipped and counted)."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, size=int(rng.integers(1, 4)))) for _ in range(600)]
    docs = []
    for i in range(n):
        if i % 97 == 13:
            docs.append("  \n" if i % 2 else "")
            continue
        k = int(rng.integers(3, 160))
        docs.append(f"Doc {i}: " + " ".join(rng.choice(words, size=k)) + ".")
    return docs


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return make_corpus(900)


@pytest.fixture(scope="module")
def llama_standin(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """A LLaMA-shaped stand-in: sentencepiece-style BPE, <unk>/<s>/</s> at ids 0/1/2 (EOS is
    </s>), 500 tokens; saved as tokenizer.json."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    assert tok.get_vocab_size() == 500
    path = tmp_path_factory.mktemp("llama") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def gpt2_standin(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """Stands in for GPT-2, the tokenizer of nvidia's ClimbMix token ids (byte-level BPE)."""
    path = tmp_path_factory.mktemp("gpt2") / "tokenizer.json"
    train_bpe(corpus[::2], 700).save(str(path))
    return path


@pytest.fixture(scope="module")
def c4_dir(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    root = tmp_path_factory.mktemp("c4")
    (root / "en").mkdir()
    for f, part in enumerate(np.array_split(np.arange(len(corpus)), 5)):
        name = root / "en" / f"c4-train.{f:05d}-of-01024.json.gz"
        with gzip.open(name, "wt", encoding="utf-8") as fh:
            for i in part:
                fh.write(json.dumps({"text": corpus[i], "timestamp": "2019-04-25T12:57:54Z",
                                     "url": f"https://example.com/{i}"}) + "\n")
    return root


def climb_parts(corpus: list[str]) -> list[np.ndarray]:
    return np.array_split(np.arange(len(corpus)), 6)


@pytest.fixture(scope="module")
def climb_dir(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """Raw-text ClimbMix-style shards (the layout of the text mirrors)."""
    root = tmp_path_factory.mktemp("climbmix")
    for f, part in enumerate(climb_parts(corpus)):
        table = pa.table({"text": [corpus[i] for i in part],
                          "cluster_id": pa.array([i % 20 for i in part], pa.int64())})
        pq.write_table(table, root / f"shard_{f:05d}.parquet", row_group_size=40)
    return root


@pytest.fixture(scope="module")
def climb_ids_dir(tmp_path_factory: pytest.TempPathFactory, corpus: list[str],
                  gpt2_standin: Path) -> Path:
    """nvidia's layout: climbmix_small/shard_N.tokenized.parquet with GPT-2 token ids."""
    root = tmp_path_factory.mktemp("climbmix-ids")
    (root / "climbmix_small").mkdir()
    gpt2 = Tokenizer.from_file(str(gpt2_standin))
    for f, part in enumerate(climb_parts(corpus)):
        ids = [gpt2.encode(corpus[i], add_special_tokens=False).ids for i in part]
        table = pa.table({"cluster_id": pa.array([i % 20 for i in part], pa.int64()),
                          "tokens": pa.array(ids, pa.list_(pa.int64())),
                          "token_count": pa.array([len(x) for x in ids], pa.int64())})
        pq.write_table(table, root / "climbmix_small" / f"shard_{f}.tokenized.parquet")
    return root


def c4_prepare(out: Path, c4_dir: Path, tok: Path, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"source": c4_dir, "tokenizer": tok, "vocab_size": 500,
                            "seq_len": SEQ, "shard_sequences": 64, "progress": False,
                            "val_fraction": 0.05}
    return prepare_recipe("c4-llama", out, **{**args, **kw})


def climb_prepare(out: Path, climb_dir: Path, tok: Path, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"source": climb_dir, "tokenizer": tok, "vocab_size": 500,
                            "seq_len": SEQ, "shard_sequences": 64, "progress": False}
    return prepare_recipe("climbmix", out, **{**args, **kw})


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "metadata.json"}


def meta_of(out: Path) -> dict[str, Any]:
    meta = json.loads((out / "metadata.json").read_text())
    assert meta.pop("prepared_at").endswith("Z")  # the one field allowed to differ
    return meta


def stream(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "metadata.json").read_text())
    dtype = "<u2" if meta["dtype"] == "uint16" else "<u4"
    parts = [np.fromfile(out / s["file"], dtype) for s in meta["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def expected_streams(docs: list[str], tok: Tokenizer, eos: int, vf: float) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"train": [], "val": []}
    for d in docs:
        if d.strip():
            split = "val" if is_validation_document(d, vf) else "train"
            out[split] += [*tok.encode(d, add_special_tokens=False).ids, eos]
    return out


@pytest.fixture(scope="module")
def c4_reference(tmp_path_factory: pytest.TempPathFactory, c4_dir: Path,
                 llama_standin: Path) -> Path:
    out = tmp_path_factory.mktemp("ref") / "c4"
    c4_prepare(out, c4_dir, llama_standin, workers=1)
    return out


# ---------------------------------------------------------------------------- workers


def test_c4_one_and_four_workers_byte_identical(
    tmp_path: Path, c4_dir: Path, llama_standin: Path, c4_reference: Path, corpus: list[str]
) -> None:
    out = tmp_path / "c4-w4"
    result = runner.invoke(data_app, [
        "prepare", "--recipe", "c4-llama", "--source", str(c4_dir), "--tokenizer",
        str(llama_standin), "--vocab-size", "500", "--seq-len", str(SEQ), "--shard-sequences",
        "64", "--val-fraction", "0.05", "--workers", "4", "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert files_of(out) == files_of(c4_reference)
    assert meta_of(out) == meta_of(c4_reference)
    meta = meta_of(out)
    assert len(meta["splits"]["train"]["shards"]) > 3 and meta["splits"]["val"]["sequences"] > 0
    # and the bytes are the right ones: each split is its documents' tokens + EOS (</s>, id 2)
    tok = Tokenizer.from_file(str(llama_standin))
    want = expected_streams(corpus, tok, 2, meta["val_fraction"])
    for split in ("train", "val"):
        got = stream(out, split)
        assert got.size == len(want[split]) // SEQ * SEQ
        assert got.tolist() == want[split][: got.size]
    assert meta["documents_skipped_empty"] == sum(1 for d in corpus if not d.strip()) > 0


def test_c4_recipe_defaults_and_manifest(c4_reference: Path, c4_dir: Path,
                                         llama_standin: Path) -> None:
    meta = meta_of(c4_reference)
    assert meta["recipe"] == "c4-llama" and meta["source"] == str(c4_dir)
    assert meta["format"] == "modbench-tokens" and meta["format_version"] == 1
    assert meta["revision"] is None  # a local folder; hf: sources record the commit
    assert meta["max_tokens"] == 90_000 * 512 * 256 and meta["budget_reached"] is False
    assert meta["val_fraction"] == 0.05 and meta["text_field"] == "text"
    files = meta["source_files"]
    assert files["count"] == 5 and files["shuffle_seed"] is None and files["stopped_at"] is None
    assert files["read"] == [f"en/c4-train.{i:05d}-of-01024.json.gz" for i in range(5)]
    tok = meta["tokenizer"]
    assert tok["spec"] == str(llama_standin) and tok["vocab_size"] == 500
    assert tok["eos_id"] == 2 and "model_vocab_size" not in tok
    ds = open_dataset(c4_reference)  # checks every shard's sha256 and the tokenizer's
    assert ds.vocab_size == 500 and ds.dtype == np.dtype("<u2") and meta["dtype"] == "uint16"
    assert meta["tokens"] == sum(s["tokens"] + s["tokens_discarded"]
                                 for s in meta["splits"].values())


# ---------------------------------------------------------------------------- prefix


@pytest.fixture(scope="module")
def climb_runs(tmp_path_factory: pytest.TempPathFactory, climb_dir: Path,
               llama_standin: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("climb-runs")
    runs = {"small": (41 * SEQ + 7, 4), "large": (150 * SEQ, 1), "all": ("all", 2)}
    for name, (budget, workers) in runs.items():
        climb_prepare(root / name, climb_dir, llama_standin, max_tokens=budget,
                      workers=workers)
    return {name: root / name for name in runs}


def test_climbmix_smaller_budget_is_a_prefix(climb_runs: dict[str, Path]) -> None:
    small, large, full = (meta_of(climb_runs[k]) for k in ("small", "large", "all"))
    assert small["splits"]["train"]["sequences"] == 41  # exactly max_tokens // seq_len rows
    assert large["splits"]["train"]["sequences"] == 150
    assert small["budget_reached"] and large["budget_reached"]
    assert full["max_tokens"] is None and full["budget_reached"] is None
    assert full["splits"]["train"]["sequences"] > 150
    for split in ("train", "val"):
        a, b, c = (stream(climb_runs[k], split) for k in ("small", "large", "all"))
        assert a.size < b.size < c.size or split == "val"
        assert np.array_equal(a, b[: a.size]) and np.array_equal(b, c[: b.size])
    # the files were read in the seeded shuffle (seed 0), the smaller run's a prefix
    order = full["source_files"]["read"]
    assert sorted(order) == [f"shard_{i:05d}.parquet" for i in range(6)] != order
    assert full["source_files"]["shuffle_seed"] == 0
    assert order[: len(small["source_files"]["read"])] == small["source_files"]["read"]
    stop = small["source_files"]["stopped_at"]
    assert stop["file"] == small["source_files"]["read"][-1] and stop["documents"] > 0


def test_climbmix_token_ids_decoded(tmp_path: Path, climb_ids_dir: Path, gpt2_standin: Path,
                                    llama_standin: Path, climb_runs: dict[str, Path]) -> None:
    """nvidia's files hold GPT-2 ids: decoded with --source-tokenizer they give the same
    bytes as the text shards (byte-level BPE round-trips)."""
    out = tmp_path / "ids"
    with pytest.raises(ModbenchError, match=r"holds token ids.*--source-tokenizer"):
        climb_prepare(out, climb_ids_dir, llama_standin, max_tokens=150 * SEQ,
                      text_field="tokens")
    assert not out.exists() and not prep.partial_dir(out).exists()
    meta = climb_prepare(out, climb_ids_dir, llama_standin, max_tokens=150 * SEQ,
                         text_field="tokens", source_tokenizer=gpt2_standin, workers=2)
    assert meta["source_tokenizer"]["spec"] == str(gpt2_standin)
    for split in ("train", "val"):
        assert np.array_equal(stream(out, split), stream(climb_runs["large"], split))


# ---------------------------------------------------------------------------- resume


def test_resume_after_interrupt_equals_uninterrupted(
    tmp_path: Path, c4_dir: Path, llama_standin: Path, c4_reference: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prep, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint after every chunk
    monkeypatch.setattr(prep, "_ENCODE_BATCH_DOCS", 16)
    writes = {"n": 0}
    real = prep._SplitWriter._write_rows

    def interrupted(self: Any, rows: np.ndarray) -> None:
        writes["n"] += 1
        if writes["n"] == 30:
            raise KeyboardInterrupt
        real(self, rows)

    monkeypatch.setattr(prep._SplitWriter, "_write_rows", interrupted)
    out = tmp_path / "c4"
    with pytest.raises(KeyboardInterrupt):
        c4_prepare(out, c4_dir, llama_standin, workers=2)
    work = prep.partial_dir(out)
    assert not out.exists() and (work / "progress.json").is_file()
    state = json.loads((work / "progress.json").read_text())["state"]
    finished = state["splits"]["train"]["shards"]
    assert finished and state["position"] != [0, 0]
    kept = {s["file"]: (work / s["file"]).stat().st_mtime_ns for s in finished}

    # the same command continues: other settings are refused, the partial left alone
    monkeypatch.setattr(prep._SplitWriter, "_write_rows", real)
    with pytest.raises(ModbenchError, match=r"other settings \(seq_len: 32 then, 16 now\)"):
        c4_prepare(out, c4_dir, llama_standin, seq_len=16)
    assert (work / "progress.json").is_file()
    c4_prepare(out, c4_dir, llama_standin, workers=1)
    assert not work.exists()
    assert files_of(out) == files_of(c4_reference)
    assert meta_of(out) == meta_of(c4_reference)
    for name, mtime in kept.items():  # finished shards were verified and kept, not rewritten
        assert (out / name).stat().st_mtime_ns == mtime


_KILLED_CHILD = """
import os, signal, sys
import modbench.data.prepare as prep
from modbench.data.corpora import prepare_recipe
prep.CHECKPOINT_SECONDS, prep._ENCODE_BATCH_DOCS = 0.0, 8
real, n = prep._SplitWriter._write_rows, [0]
def write(self, rows):
    n[0] += 1
    if n[0] == 45:  # mid-write: half of this block is on disk, then the process dies
        if self._fh is not None:
            self._fh.write(rows[: len(rows) // 2].astype(self.dtype).tobytes())
            self._fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, rows)
prep._SplitWriter._write_rows = write
src, tok, out = sys.argv[1:]
prepare_recipe("c4-llama", out, source=src, tokenizer=tok, vocab_size=500, seq_len=32,
               shard_sequences=64, progress=False, workers=2, val_fraction=0.05)
"""


def test_resume_after_sigkill(tmp_path: Path, c4_dir: Path, llama_standin: Path,
                              c4_reference: Path) -> None:
    out = tmp_path / "c4"
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_CHILD), str(c4_dir), str(llama_standin),
         str(out)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert (prep.partial_dir(out) / "progress.json").is_file() and not out.exists()
    c4_prepare(out, c4_dir, llama_standin, workers=4)
    assert files_of(out) == files_of(c4_reference)
    assert meta_of(out) == meta_of(c4_reference)


def test_damaged_partial_refused(tmp_path: Path, c4_dir: Path, llama_standin: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "_ENCODE_BATCH_DOCS", 16)
    monkeypatch.setattr(prep, "CHECKPOINT_SECONDS", 0.0)
    real = prep._Run.consume
    calls = {"n": 0}

    def stop(self: Any, tag: Any, enc: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 40:
            raise ConnectionError("network went away")  # not a ModbenchError: resumable
        real(self, tag, enc)

    monkeypatch.setattr(prep._Run, "consume", stop)
    out = tmp_path / "c4"
    with pytest.raises(ConnectionError):
        c4_prepare(out, c4_dir, llama_standin)
    monkeypatch.setattr(prep._Run, "consume", real)
    work = prep.partial_dir(out)
    shard = work / "train_00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ModbenchError, match=r"damaged \(train_00000\.bin fails its sha256"):
        c4_prepare(out, c4_dir, llama_standin)
    assert (work / "progress.json").is_file()  # left for the user to look at and delete


# ---------------------------------------------------------------------------- dtype


def test_dtype_follows_vocabulary(tmp_path: Path) -> None:
    """uint32 shards for a vocabulary of 70,000 (ids above 65,535 survive), uint16 for 500."""
    big = wordlevel(70_000)
    rng = np.random.default_rng(1)
    docs = [" ".join(f"w{i}" for i in rng.integers(60_000, 70_000, size=50)) for _ in range(40)]
    meta = prepare_recipe(None, tmp_path / "big", source=docs, tokenizer=big, seq_len=SEQ,
                          val_fraction=0.0, progress=False, workers=2)
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 70_000
    got = stream(tmp_path / "big", "train")
    assert got.dtype == np.dtype("<u4") and got.max() > 65_535
    assert (tmp_path / "big" / "train_00000.bin").stat().st_size == got.size * 4
    want = [t for d in docs for t in [*big.encode(d).ids, 0]]
    assert got.tolist() == want[: got.size]
    ds = open_dataset(tmp_path / "big")
    assert int(ds.train_batch(0, 4, 0).max()) > 65_535
    small = prepare_recipe(None, tmp_path / "small", source=make_corpus(40), seq_len=SEQ,
                           tokenizer=train_bpe(make_corpus(40), 500), progress=False)
    assert small["dtype"] == "uint16"


def wordlevel(n: int) -> Tokenizer:
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_climbmix_records_the_padded_model_vocabulary(tmp_path: Path) -> None:
    """A 65,536-id tokenizer (the recipe's size) gives uint16 shards and records the seed's
    65,664-row model vocabulary, which `check_vocab` (so `modbench train`) accepts."""
    tok_file = tmp_path / "tok" / "tokenizer.json"
    tok_file.parent.mkdir()
    wordlevel(65536).save(str(tok_file))
    rng = np.random.default_rng(2)
    shards = tmp_path / "shards"
    shards.mkdir()
    docs = [" ".join(f"w{i}" for i in rng.integers(2, 65536, size=80)) for _ in range(60)]
    pq.write_table(pa.table({"text": docs}), shards / "shard_00000.parquet")
    meta = prepare_recipe("climbmix", tmp_path / "data", source=shards, tokenizer=tok_file,
                          seq_len=SEQ, max_tokens="all", progress=False)
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["vocab_size"] == 65536
    assert meta["tokenizer"]["model_vocab_size"] == 65664
    ds = open_dataset(tmp_path / "data")
    ds.check_vocab(65664)
    ds.check_vocab(65536)
    with pytest.raises(ModbenchError, match=r"vocab size 65536 \(or 65664, padded\)"):
        ds.check_vocab(65600)
    assert stream(tmp_path / "data", "train").max() > 60_000


# ---------------------------------------------------------------------------- tokenizer


def test_train_tokenizer_exact_size(tmp_path: Path, climb_dir: Path, corpus: list[str],
                                    climb_runs: dict[str, Path]) -> None:
    out = tmp_path / "tok"
    result = runner.invoke(data_app, [
        "train-tokenizer", "--recipe", "climbmix", "--source", str(climb_dir), "--vocab-size",
        "800", "--max-chars", "60K", "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 800 and tok.token_to_id("<|endoftext|>") == 0
    info = json.loads((out / "training.json").read_text())
    assert info["recipe"] == "climbmix" and info["vocab_size"] == 800
    assert info["shuffle_seed"] == 0 and info["val_fraction"] == 0.0005
    assert 60_000 <= info["chars"] < 60_000 + max(len(d) for d in corpus)
    read = meta_of(climb_runs["all"])["source_files"]["read"]
    assert info["files"] == read[: len(info["files"])]  # the order prepare reads them in
    # the tokenizer works with the recipe (a 800-token vocabulary: uint16)
    prepared = climb_prepare(tmp_path / "data", climb_dir, out, vocab_size=800,
                             max_tokens=40 * SEQ)
    assert prepared["tokenizer"]["sha256"] == info["sha256"]


def test_train_tokenizer_errors(tmp_path: Path, climb_dir: Path) -> None:
    out = tmp_path / "tok"
    with pytest.raises(ModbenchError, match=r"only support \d+ tokens, not 100000"):
        train_recipe_tokenizer(None, out, source=climb_dir, vocab_size=100_000,
                               max_chars="20K", progress=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ModbenchError, match="--vocab-size is required"):
        train_recipe_tokenizer(None, out, source=climb_dir)


# ---------------------------------------------------------------------------- training


def test_training_opens_the_result(tmp_path: Path, c4_dir: Path, llama_standin: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`modbench train` on a prepared folder; the tokenizer has 500 ids and the data records a
    padded model vocabulary of 512 (the tiny preset's), as climbmix records 65,664."""
    data = tmp_path / "c4-s64"
    meta = c4_prepare(data, c4_dir, llama_standin, seq_len=64, model_vocab_size=512)
    assert meta["tokenizer"]["model_vocab_size"] == 512
    code = run_cli(["train", "--preset", "tiny", "--steps", "2", "--no-progress",
                    "--set", f"data.source={data}", "--out", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and np.isfinite(summary["final_val_loss"])
    code = run_cli(["train", "--preset", "tiny", "--steps", "1", "--no-progress", "--set",
                    f"data.source={data}", "--set", "model.vocab_size=600",
                    "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert code == 2 and "vocab size 500 (or 512, padded) but the model has 600" in err


# ---------------------------------------------------------------------------- hf sources


def test_hf_streaming_equals_local(tmp_path: Path, climb_dir: Path, llama_standin: Path,
                                   climb_runs: dict[str, Path],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face path (`datasets`, streamed file by file; offline on local files)
    reads the same documents in the same seeded order as the local folder."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    out = tmp_path / "hf"
    meta = climb_prepare(out, "hf:parquet", llama_standin, max_tokens=150 * SEQ,  # type: ignore[arg-type]
                         data_files=str(climb_dir / "*.parquet"))
    assert meta["source"] == "hf:parquet" and meta["hf_split"] == "train"
    assert [Path(f).name for f in meta["source_files"]["read"]] == \
        meta_of(climb_runs["large"])["source_files"]["read"]
    assert files_of(out) == files_of(climb_runs["large"])


def test_hub_source_records_its_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub dataset's data files come back from `datasets` pinned to a commit, which becomes
    the manifest's `revision`; a read that fails on the network is resumable. (No network:
    `datasets`' resolver and reader are replaced by stand-ins.)"""
    datasets = pytest.importorskip("datasets")
    sha = "1588ec454efa1a09f29cd18ddd04fe05fc8653a2"
    files = [f"hf://datasets/allenai/c4@{sha}/en/c4-train.{i:05d}-of-01024.json.gz"
             for i in range(3)]

    class Builder:
        name = "json"
        config = type("Config", (), {"data_files": {"train": files, "validation": files[:1]}})

    seen: dict[str, Any] = {}

    def builder(path: str, name: str | None = None, **kw: Any) -> Builder:
        seen.update(path=path, name=name, **kw)
        return Builder()

    def offline(*args: Any, **kw: Any) -> None:
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    src = open_source("hf:allenai/c4:en", revision="main")
    assert seen == {"path": "allenai/c4", "name": "en", "data_files": None, "revision": "main"}
    assert src.revision == sha and src.file_names() == files
    assert src.description == "hf:allenai/c4:en"
    with pytest.raises(SourceUnavailable, match=r"no route to host.*run the same command again"):
        next(src.iter_file(1))
    with pytest.raises(ModbenchError, match=r"has no split 'test' \(it has train, validation\)"):
        open_source("hf:allenai/c4:en", split="test")


# ---------------------------------------------------------------------------- errors


def test_recipe_errors(tmp_path: Path, climb_dir: Path) -> None:
    with pytest.raises(ModbenchError, match=r"unknown recipe 'climbmx'.*did you mean 'climbmix'"):
        prepare_recipe("climbmx", tmp_path / "o")
    with pytest.raises(ModbenchError, match=r"climbmix recipe needs --tokenizer.*train-tokenizer"):
        prepare_recipe("climbmix", tmp_path / "o", source=climb_dir)
    with pytest.raises(ModbenchError, match="not a token count"):
        prepare_recipe("climbmix", tmp_path / "o", max_tokens="lots")
    with pytest.raises(ModbenchError, match="workers must be an integer >= 1"):
        prepare_recipe(None, tmp_path / "o", source=climb_dir, workers=0, vocab_size=512)
    result = runner.invoke(data_app, ["recipes"])
    assert result.exit_code == 0 and "c4-llama" in result.output and "climbmix" in result.output
    assert list(tmp_path.iterdir()) == []


def test_recipe_defaults() -> None:
    c4 = recipe_options("c4-llama", {})
    assert c4["source"] == "hf:allenai/c4:en" and c4["tokenizer"] == "hf:meta-llama/Llama-2-7b-hf"
    assert (c4["vocab_size"], c4["seq_len"], c4["text_field"]) == (32000, 256, "text")
    assert c4["max_tokens"] == 11_796_480_000 and "model_vocab_size" not in c4
    climb = recipe_options("climbmix", {"tokenizer": "t.json"})
    assert climb["source"] == "hf:nvidia/Nemotron-ClimbMix" and climb["text_field"] == "tokens"
    assert climb["source_tokenizer"] == "hf:openai-community/gpt2"
    assert (climb["vocab_size"], climb["model_vocab_size"]) == (65536, 65664)
    assert (climb["seq_len"], climb["max_tokens"], climb["shuffle_seed"]) == (1024, 23.28e9, 0)
    three_b = recipe_options("climbmix", {"max_tokens": "60.04B", "workers": 8})
    assert three_b["max_tokens"] == 60_040_000_000 and three_b["workers"] == 8
    # a source of your own drops the recipe's source-specific defaults, keeps the rest
    local = recipe_options("climbmix", {"source": "./shards", "vocab_size": 800})
    assert local["text_field"] == "text" and "source_tokenizer" not in local
    assert local["seq_len"] == 1024 and "model_vocab_size" not in local
    assert recipe_options("climbmix", {"max_tokens": "all"})["max_tokens"] is None


@pytest.mark.parametrize("cmd", [["prepare"], ["train-tokenizer"], ["recipes"]])
def test_help_has_examples(cmd: list[str]) -> None:
    result = runner.invoke(data_app, [*cmd, "--help"])
    assert result.exit_code == 0 and "Example: modbench data" in result.output
