"""Bad data is refused before training starts: one `error:` line, exit code 2, and nothing
written (no run folder; on a resume, the run folder byte for byte as it was).

Each case damages a copy of a small prepared dataset (the tiny preset's vocabulary 512 and
rows of 64 tokens) in one way.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.helpers import tiny

from modbench.cli import run_cli
from modbench.data import PrepareSettings, prepare_dataset, train_bpe
from modbench.runtime.callback import Callback

WORDS = ("the", "model", "reads", "a", "sequence", "of", "tokens", "and", "predicts", "the",
         "next", "one", "while", "every", "other", "choice", "stays", "fixed", "so", "that",
         "one", "modification", "is", "measured", "with", "seeds", "and", "data", "order",
         "attention", "heads", "residual", "stream", "normalization", "layer", "learning",
         "rate")


def corpus(n: int = 240, seed: int = 0, words: tuple[str, ...] | list[str] = WORDS) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"Document {i}: " + " ".join(rng.choice(list(words), size=int(rng.integers(20, 90))))
            for i in range(n)]


def prepare(out: Path, docs: list[str], tokenizer: Any = "builtin", vocab: int | None = 512,
            val_fraction: float = 0.2) -> Path:
    prepare_dataset(
        docs, tokenizer, out,
        PrepareSettings(seq_len=64, vocab_size=vocab, val_fraction=val_fraction, progress=False),
    )
    return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The undamaged datasets the cases copy."""
    root = tmp_path_factory.mktemp("bad-data")
    other_tok = train_bpe(corpus(300, seed=9, words=[w[::-1] for w in WORDS]), 512)
    return {
        "good": prepare(root / "good", corpus()),
        "other-vocab": prepare(root / "other-vocab", corpus(), vocab=600),
        "other-tokenizer": prepare(root / "other-tokenizer", corpus(), tokenizer=other_tok,
                                   vocab=None),
        "changed": prepare(root / "changed", corpus(seed=1)),
    }


def _meta(d: Path) -> dict[str, Any]:
    return json.loads((d / "metadata.json").read_text())


def _write_meta(d: Path, meta: dict[str, Any]) -> None:
    (d / "metadata.json").write_text(json.dumps(meta, indent=2))


def _shard(d: Path) -> Path:
    return d / _meta(d)["splits"]["train"]["shards"][0]["file"]


def _set_ids(d: Path, value: int, where: int = 1000) -> None:
    """Put token id ``value`` into the first train shard and update its checksum, so only
    the ids are wrong."""
    shard = _shard(d)
    ids = np.fromfile(shard, dtype="<u2")
    ids[where] = value
    ids.tofile(shard)
    meta = _meta(d)
    meta["splits"]["train"]["shards"][0]["sha256"] = hashlib.sha256(
        shard.read_bytes()).hexdigest()
    _write_meta(d, meta)


def truncate(d: Path, ds: dict[str, Path]) -> str:
    shard = _shard(d)
    shard.write_bytes(shard.read_bytes()[:-7])
    return "bytes, expected"


def truncate_to_whole_rows(d: Path, ds: dict[str, Path]) -> str:
    shard = _shard(d)
    shard.write_bytes(shard.read_bytes()[: 64 * 2 * 3])
    return "bytes, expected"


def flip_a_byte(d: Path, ds: dict[str, Path]) -> str:
    shard = _shard(d)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    return "fails its sha256 checksum"


def swap_shards(d: Path, ds: dict[str, Path]) -> str:
    """Train and validation shards of equal size exchanged: sizes agree, checksums do not."""
    meta = _meta(d)
    t, v = meta["splits"]["train"]["shards"][0], meta["splits"]["val"]["shards"][0]
    data = (d / t["file"]).read_bytes()[: t["sequences"] * 128]
    (d / v["file"]).write_bytes(data[: v["sequences"] * 128])
    return "fails its sha256 checksum"


def id_at_vocab(d: Path, ds: dict[str, Path]) -> str:
    _set_ids(d, 512)
    return "holds token id 512, outside the vocabulary of 512"


def id_far_beyond_vocab(d: Path, ds: dict[str, Path]) -> str:
    _set_ids(d, 65535, where=5)
    return "holds token id 65535"


def relabelled_vocab(d: Path, ds: dict[str, Path]) -> str:
    """Shards of a 600-token tokenizer, metadata edited to claim 512 (checksums intact)."""
    shutil.rmtree(d)
    shutil.copytree(ds["other-vocab"], d)
    meta = _meta(d)
    meta["tokenizer"]["vocab_size"] = 512
    _write_meta(d, meta)
    return "outside the vocabulary of 512"


def manifest_of_another_vocab(d: Path, ds: dict[str, Path]) -> str:
    """metadata.json of the same corpus prepared with the 600-token tokenizer."""
    shutil.copy(ds["other-vocab"] / "metadata.json", d / "metadata.json")
    return "error: "


def tokenizer_of_another_corpus(d: Path, ds: dict[str, Path]) -> str:
    """tokenizer.json replaced by another tokenizer of the same size."""
    shutil.copy(ds["other-tokenizer"] / "tokenizer.json", d / "tokenizer.json")
    return "is not the tokenizer"


def manifest_names_another_tokenizer(d: Path, ds: dict[str, Path]) -> str:
    """metadata.json's tokenizer record taken from another tokenizer's dataset."""
    meta = _meta(d)
    meta["tokenizer"] = _meta(ds["other-tokenizer"])["tokenizer"]
    meta["tokenizer"]["vocab_size"] = 512
    _write_meta(d, meta)
    return "is not the tokenizer"


def manifest_of_another_tokenizer(d: Path, ds: dict[str, Path]) -> str:
    """The whole metadata.json of the corpus prepared with another tokenizer."""
    shutil.copy(ds["other-tokenizer"] / "metadata.json", d / "metadata.json")
    return "error: "


def corrupt_manifest(d: Path, ds: dict[str, Path]) -> str:
    (d / "metadata.json").write_text('{"format": "modbench-tokens", "format_vers')
    return "is corrupt"


def missing_tokenizer(d: Path, ds: dict[str, Path]) -> str:
    (d / "tokenizer.json").unlink()
    return "tokenizer.json is missing"


def eos_outside_vocab(d: Path, ds: dict[str, Path]) -> str:
    meta = _meta(d)
    meta["tokenizer"]["eos_id"] = 4096
    _write_meta(d, meta)
    return "inconsistent fields"


def too_short_corpus(d: Path, ds: dict[str, Path]) -> str:
    """A corpus with fewer tokens than one row: prepared, but its splits are empty."""
    shutil.rmtree(d)
    prepare(d, ["A few words.", "And a few more words here."])
    return "has no sequences"


def no_validation_split(d: Path, ds: dict[str, Path]) -> str:
    shutil.rmtree(d)
    prepare(d, corpus(), val_fraction=0.0)
    return "val split"


def empty_shard_list(d: Path, ds: dict[str, Path]) -> str:
    meta = _meta(d)
    meta["splits"]["train"] = {**meta["splits"]["train"], "sequences": 0, "shards": []}
    _write_meta(d, meta)
    return "has no sequences"


DAMAGE: dict[str, Callable[[Path, dict[str, Path]], str]] = {
    "truncated shard": truncate,
    "shard cut to whole rows": truncate_to_whole_rows,
    "one bit flipped": flip_a_byte,
    "shards of equal size swapped": swap_shards,
    "token id = vocab, checksum updated": id_at_vocab,
    "token id 65535, checksum updated": id_far_beyond_vocab,
    "shards of a 600-token tokenizer relabelled 512": relabelled_vocab,
    "manifest of a 600-token tokenizer": manifest_of_another_vocab,
    "tokenizer.json of another tokenizer": tokenizer_of_another_corpus,
    "manifest naming another tokenizer": manifest_names_another_tokenizer,
    "manifest of another tokenizer": manifest_of_another_tokenizer,
    "truncated manifest": corrupt_manifest,
    "tokenizer.json missing": missing_tokenizer,
    "eos id outside the vocabulary": eos_outside_vocab,
    "corpus shorter than one row": too_short_corpus,
    "no validation rows": no_validation_split,
    "no training shards": empty_shard_list,
}

OUTCOMES: dict[str, dict[str, Any]] = {}


def one_line_error(capsys: pytest.CaptureFixture[str], code: int) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err
    return lines[0]


def train_argv(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--steps", "2", "--no-progress", "--out", str(out),
            "--set", f"data.source={data}", *extra]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_data_is_refused_before_training(damage: str, datasets: dict[str, Path],
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(datasets["good"], data)
    needle = DAMAGE[damage](data, datasets)
    out = tmp_path / "run"
    line = one_line_error(capsys, run_cli(train_argv(data, out)))
    assert needle in line, line
    assert not out.exists()
    OUTCOMES[damage] = {"refused": True, "message": line}


def test_the_undamaged_data_trains(datasets: dict[str, Path], tmp_path: Path) -> None:
    """The control: the datasets the cases damage are accepted as they are."""
    for name in ("good", "changed"):
        assert run_cli(train_argv(datasets[name], tmp_path / name)) == 0
        assert (tmp_path / name / "summary.json").is_file()


def test_an_empty_corpus_is_refused_by_prepare(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blank.txt").write_text("   \n\n")
    for source in (tmp_path / "src", tmp_path / "src" / "blank.txt"):
        out = tmp_path / "out"
        code = run_cli(["data", "prepare", "--source", str(source), "--vocab-size", "512",
                        "--out", str(out), "--no-progress"])
        assert "no documents" in one_line_error(capsys, code)
        assert not out.exists() and not list(tmp_path.glob(".out.*"))
    OUTCOMES["empty corpus (data prepare)"] = {"refused": True}


class Crash(Callback):
    def on_step_end(self, run: Any, step: int, record: dict[str, Any]) -> None:
        if step + 1 == 3:
            raise RuntimeError("killed")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("change", ["replaced by another corpus", "one shard truncated",
                                    "token ids rewritten, checksum updated"])
def test_data_changed_between_a_run_and_its_resume(change: str, datasets: dict[str, Path],
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from modbench.train.trainer import train

    data = tmp_path / "data"
    shutil.copytree(datasets["good"], data)
    run = tmp_path / "run"
    cfg = tiny("baseline", 0, 6, f"data.source={data}", "train.checkpoint_every=2")
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg, run, callbacks=[Crash()], progress=False)
    before = _snapshot(run)
    if change == "replaced by another corpus":
        shutil.rmtree(data)
        shutil.copytree(datasets["changed"], data)
        needle = "changed since the run started"
    elif change == "one shard truncated":
        needle = truncate(data, datasets)
    else:
        needle = id_at_vocab(data, datasets)
    code = run_cli(["train", "--out", str(run), "--resume", "--no-progress"])
    assert needle in one_line_error(capsys, code)
    assert _snapshot(run) == before  # nothing written, nothing truncated
    OUTCOMES[f"data {change} before --resume"] = {"refused": True}


def test_record_bad_data_figures(record: Any) -> None:
    """Runs last in this module: the cases tried and refused, for docs/reliability.md."""
    record({"cases": len(OUTCOMES), "refused": sum(o["refused"] for o in OUTCOMES.values()),
            "outcomes": OUTCOMES})
    assert len(OUTCOMES) == len(DAMAGE) + 4
