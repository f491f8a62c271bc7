"""Reading prepared datasets: validation, memory-mapped shards, deterministic batches."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from modbench.data._fs import sha256_file
from modbench.data.prepare import FORMAT, FORMAT_VERSION, METADATA_FILE, SPLITS, TOKENIZER_FILE
from modbench.data.verify_record import VerifyRecord
from modbench.errors import ModbenchError

_PREPARE_HINT = "re-run `modbench data prepare`"
_PERM_CACHE_SIZE = 2


def _shard_error(path: Path, problem: str) -> ModbenchError:
    return ModbenchError(f"shard {path} {problem}; the dataset is damaged, {_PREPARE_HINT}")


def _bad_meta(path: Path, problem: str) -> ModbenchError:
    return ModbenchError(f"{path / METADATA_FILE} {problem}; {_PREPARE_HINT} to rebuild it")


def _load_metadata(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ModbenchError(
            f"dataset directory {path} does not exist; create it with "
            f"`modbench data prepare --source ... --out {path}`"
        )
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        raise ModbenchError(
            f"{meta_path} is missing, so {path} is not a prepared dataset; {_PREPARE_HINT}"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad_meta(path, f"is corrupt ({type(exc).__name__})") from exc
    if not isinstance(meta, dict):
        raise _bad_meta(path, "is not a JSON object")
    if meta.get("format") != FORMAT:
        raise _bad_meta(path, f"has format {meta.get('format')!r}, expected {FORMAT!r}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ModbenchError(
            f"{path} uses dataset format version {version!r} but this modbench reads version "
            f"{FORMAT_VERSION}; {_PREPARE_HINT} with this version"
        )
    try:
        seq_len = meta["seq_len"]
        tok = meta["tokenizer"]
        ok = (
            isinstance(seq_len, int)
            and seq_len >= 2
            and meta["dtype"] in ("uint16", "uint32")
            and isinstance(tok["vocab_size"], int)
            and isinstance(tok["eos_id"], int)
            and 0 <= tok["eos_id"] < tok["vocab_size"]
        )
        padded = tok.get("model_vocab_size", tok["vocab_size"])
        ok = ok and isinstance(padded, int) and padded >= tok["vocab_size"]
        for split in SPLITS:
            info = meta["splits"][split]
            ok = ok and isinstance(info["sequences"], int)
            total = 0
            for shard in info["shards"]:
                ok = ok and isinstance(shard["file"], str) and "/" not in shard["file"]
                ok = ok and isinstance(shard["sequences"], int) and shard["sequences"] > 0
                ok = ok and isinstance(shard["sha256"], str)
                total += shard["sequences"]
            ok = ok and total == info["sequences"]
    except (KeyError, TypeError) as exc:
        raise _bad_meta(path, f"is incomplete (missing or malformed {exc})") from exc
    if not ok:
        raise _bad_meta(path, "has inconsistent fields")
    return meta


class TokenDataset:
    """A prepared dataset: ``metadata.json`` + memory-mapped ``{split}_NNNNN.bin`` shards.

    Opening checks that the metadata parses, that every shard exists with the right byte size
    and, when ``verify`` is true, that every shard's sha256 matches (reading every byte: the
    processes of a group on one node leave it to one of them, ``modbench.runtime.data``).
    A file that passed is recorded in ``verified.json`` (:mod:`modbench.data.verify_record`)
    and later opens accept it unread while its size, mtime, ctime and inode are unchanged, so
    a corpus is hashed once, not at every run's start; a file whose bytes changed is hashed
    again and refused if damaged. That trusts the file system's metadata (a file altered with
    its timestamps restored, or corrupted beneath the file system, passes): :meth:`verify`
    (``modbench data verify``) hashes every file whatever the record says.
    """

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.path = Path(path).expanduser()
        self.meta: dict[str, Any] = _load_metadata(self.path)
        self.seq_len: int = int(self.meta["seq_len"])
        self.vocab_size: int = int(self.meta["tokenizer"]["vocab_size"])
        self.eos_id: int = int(self.meta["tokenizer"]["eos_id"])
        self.model_vocab_size: int = int(
            self.meta["tokenizer"].get("model_vocab_size", self.vocab_size)
        )
        self.dtype = np.dtype("<u2") if self.meta["dtype"] == "uint16" else np.dtype("<u4")
        self._shards: dict[str, list[np.memmap[Any, Any]]] = {}
        self._offsets: dict[str, np.ndarray] = {}
        # the validation batches already read, by (rows, batch size): every evaluation of a
        # run reads the same ones (a few hundred KB; val_batches)
        self._val_cache: dict[tuple[int, int], list[torch.Tensor]] = {}
        record = VerifyRecord(self.path, self.fingerprint()) if verify else None
        for split in SPLITS:
            maps: list[np.memmap[Any, Any]] = []
            counts = [0]
            for shard in self.meta["splits"][split]["shards"]:
                maps.append(self._open_shard(shard, record))
                counts.append(counts[-1] + int(shard["sequences"]))
            self._shards[split] = maps
            self._offsets[split] = np.asarray(counts, dtype=np.int64)
        if record is not None:
            self._check_tokenizer(record, trust=True)
            record.save()
        self._perm_cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    # ------------------------------------------------------------------ opening / checking
    def _open_shard(self, shard: dict[str, Any],
                    record: VerifyRecord | None) -> np.memmap[Any, Any]:
        file = self.path / shard["file"]
        if not file.is_file():
            raise _shard_error(file, "is missing")
        rows = int(shard["sequences"])
        expected = rows * self.seq_len * self.dtype.itemsize
        size = file.stat().st_size
        if size != expected:
            raise _shard_error(file, f"has {size} bytes, expected {expected}")
        if record is not None:
            self._check_shard(file, shard["sha256"], record, trust=True)
        return np.memmap(file, dtype=self.dtype, mode="r", shape=(rows, self.seq_len))

    def _check_shard(self, file: Path, sha256: str, record: VerifyRecord, *,
                     trust: bool) -> None:
        """The shard's checksum, and that every token id is inside the vocabulary (a shard
        rewritten with its checksum updated, or written by a bigger tokenizer, would
        otherwise index past the embedding mid-training). ``trust``: a shard ``record`` says
        is unchanged since it passed both (under this manifest) is not read."""
        if trust and record.trusted(file.name, sha256):
            return
        with record.hashing(file.name, sha256):
            digest, top = _digest_and_max(file, self.dtype)
            if digest != sha256:
                raise _shard_error(file, "fails its sha256 checksum")
            if top >= self.vocab_size:
                raise _shard_error(file, f"holds token id {top}, outside the vocabulary of "
                                         f"{self.vocab_size} tokens metadata.json records")

    def _check_tokenizer(self, record: VerifyRecord, *, trust: bool) -> None:
        """``tokenizer.json`` is the tokenizer ``metadata.json`` records (its sha256; not
        read when ``trust`` and ``record`` says it is unchanged since it passed)."""
        name = self.meta["tokenizer"].get("file", TOKENIZER_FILE)
        tok_file = self.path / name
        if not tok_file.is_file():
            raise ModbenchError(f"{tok_file} is missing; {_PREPARE_HINT}")
        want = self.meta["tokenizer"].get("sha256")
        if trust and isinstance(want, str) and record.trusted(name, want):
            return
        with record.hashing(name, str(want)):
            if sha256_file(tok_file) != want:
                raise ModbenchError(
                    f"{tok_file} is not the tokenizer {self.path / METADATA_FILE} records (its "
                    f"sha256 differs): the manifest and the tokenizer come from different "
                    f"preparations; {_PREPARE_HINT}"
                )

    def verify(self) -> list[str]:
        """Re-check every shard's sha256 and the tokenizer file, reading every byte whatever
        ``verified.json`` says (the full check, ``modbench data verify``: it also catches
        what the record cannot, a file changed with its timestamps restored); record the
        files that pass; return the files checked."""
        record = VerifyRecord(self.path, self.fingerprint())
        checked: list[str] = []
        for split in SPLITS:
            for shard in self.meta["splits"][split]["shards"]:
                file = self.path / shard["file"]
                if not file.is_file():
                    raise _shard_error(file, "is missing")
                self._check_shard(file, shard["sha256"], record, trust=False)
                checked.append(shard["file"])
        self._check_tokenizer(record, trust=False)
        checked.append(self.meta["tokenizer"].get("file", TOKENIZER_FILE))
        record.save()
        return checked

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the dataset was prepared with (its copied ``tokenizer.json``)."""
        tok_file = self.path / self.meta["tokenizer"].get("file", TOKENIZER_FILE)
        if not tok_file.is_file():
            raise ModbenchError(f"{tok_file} is missing; {_PREPARE_HINT}")
        try:
            return Tokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise ModbenchError(f"{tok_file} is corrupt; {_PREPARE_HINT}") from exc

    def fingerprint(self) -> str:
        """sha256 of what decides the tokens a run reads: the packing (seq_len, dtype), the
        tokenizer's record and every shard's name, size and checksum. Two directories with the
        same fingerprint give the same batches; a run refuses to resume on another."""
        keep = {k: self.meta[k] for k in ("seq_len", "dtype", "tokenizer", "splits")}
        blob = json.dumps(keep, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise unless the model's vocabulary size equals the data's (the tokenizer's, or the
        padded ``model_vocab_size`` the preparation recorded, e.g. 65,664 for 65,536 ids)."""
        if int(model_vocab_size) not in (self.vocab_size, self.model_vocab_size):
            padded = (f" (or {self.model_vocab_size}, padded)"
                      if self.model_vocab_size != self.vocab_size else "")
            raise ModbenchError(
                f"the data in {self.path} has vocab size {self.vocab_size}{padded} but the model "
                f"has {model_vocab_size}; use --set model.vocab_size={self.vocab_size}, or "
                f"re-prepare the data with a tokenizer of {model_vocab_size} tokens"
            )

    def num_sequences(self, split: str) -> int:
        """Number of ``seq_len`` rows in ``split`` ("train" or "val")."""
        return int(self._offsets[self._check_split(split)][-1])

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.path)!r}, seq_len={self.seq_len}, "
            f"vocab_size={self.vocab_size}, train={self.num_sequences('train')}, "
            f"val={self.num_sequences('val')})"
        )

    def _check_split(self, split: str) -> str:
        if split not in SPLITS:
            raise ModbenchError(f"unknown split {split!r}; use 'train' or 'val'")
        return split

    def require_rows(self, split: str) -> int:
        """The number of rows of ``split``; an error saying what to do when it has none."""
        n = self.num_sequences(split)
        if n == 0:
            docs = self.meta.get("documents", {}).get(split, "?")
            raise ModbenchError(
                f"the {split} split of {self.path} has no sequences ({docs} documents, fewer "
                f"tokens than seq_len={self.seq_len}); use more data, a smaller --seq-len"
                + (" or a larger --val-fraction" if split == "val" else "")
            )
        return n

    # ------------------------------------------------------------------ reading rows
    def _rows(self, split: str, indices: np.ndarray,
              out: np.ndarray | None = None) -> np.ndarray:
        """Gather rows by global index (any order, repeats allowed) as an int64 array (into
        ``out``, an int64 array of ``(len(indices), seq_len)``, when given)."""
        if out is None:
            out = np.empty((indices.size, self.seq_len), dtype=np.int64)
        offsets = self._offsets[split]
        shard_of = np.searchsorted(offsets, indices, side="right") - 1
        for s in np.unique(shard_of):
            sel = np.nonzero(shard_of == s)[0]
            local = indices[sel] - offsets[s]
            out[sel] = self._shards[split][int(s)][local]
        return out

    def _permutation(self, data_seed: int, epoch: int, n: int) -> np.ndarray:
        key = (data_seed, epoch)
        perm = self._perm_cache.get(key)
        if perm is None:
            perm = np.random.default_rng([data_seed, epoch]).permutation(n)
            self._perm_cache[key] = perm
            while len(self._perm_cache) > _PERM_CACHE_SIZE:
                self._perm_cache.popitem(last=False)
        else:
            self._perm_cache.move_to_end(key)
        return perm

    def train_indices(self, step: int, batch_size: int, data_seed: int) -> np.ndarray:
        """Row indices of training batch ``step`` (see :meth:`train_batch`)."""
        for name, value, low in (
            ("step", step, 0),
            ("batch_size", batch_size, 1),
            ("data_seed", data_seed, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ModbenchError(f"{name} must be an integer >= {low}, got {value!r}")
        n = self.require_rows("train")
        first = int(step) * int(batch_size)
        sample = np.arange(first, first + int(batch_size), dtype=np.int64)
        epochs = sample // n
        positions = sample % n
        indices = np.empty(batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            indices[sel] = self._permutation(int(data_seed), int(epoch), n)[positions[sel]]
        return indices

    def train_batch(self, step: int, batch_size: int, data_seed: int) -> torch.Tensor:
        """Training batch ``step`` as a ``(batch_size, seq_len)`` int64 tensor.

        A pure function of ``(data_seed, step, batch_size)``: the training rows form an
        infinite stream whose epoch ``e`` is ``np.random.default_rng([data_seed, e])
        .permutation(N_train)``, and batch ``step`` is samples ``[step*B, (step+1)*B)`` of that
        stream. Any step can be requested directly (resume) at the cost of one permutation.
        """
        rows = self._rows("train", self.train_indices(step, batch_size, data_seed))
        return torch.from_numpy(rows)

    def train_rows_into(self, out: torch.Tensor, step: int, batch_size: int, data_seed: int,
                        rows: tuple[int, int]) -> None:
        """Write rows ``[lo, hi)`` of training batch ``step`` (:meth:`train_batch`) into
        ``out`` (an int64 CPU tensor of ``(hi - lo, seq_len)``, e.g. pinned memory), reading
        only those rows: a process of a group reads its own slice of the global batch."""
        lo, hi = rows
        if not 0 <= lo <= hi <= batch_size or tuple(out.shape) != (hi - lo, self.seq_len):
            raise ValueError(f"rows {rows} of a batch of {batch_size} do not fit a tensor of "
                             f"shape {tuple(out.shape)}")
        indices = self.train_indices(step, batch_size, data_seed)[lo:hi]
        self._rows("train", indices, out.numpy())

    def train_batch_and_mask(self, step: int, batch_size: int,
                             data_seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`train_batch` and the mask of the predictions that enter the loss: ``None``,
        all of them (text rows count in full; ``modbench.data.mix`` masks probe rows)."""
        return self.train_batch(step, batch_size, data_seed), None

    def val_batches(self, max_sequences: int | None, batch_size: int) -> Iterator[torch.Tensor]:
        """The first ``max_sequences`` validation rows (all when None), in stored order.

        Yields ``(b, seq_len)`` int64 tensors with ``b == batch_size`` except possibly the last.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ModbenchError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        n = self.require_rows("val")
        if max_sequences is not None:
            if max_sequences < 1:
                raise ModbenchError(f"max_sequences must be >= 1 or None, got {max_sequences!r}")
            n = min(n, int(max_sequences))
        return self._val_iter(n, batch_size)

    def _val_iter(self, n: int, batch_size: int) -> Iterator[torch.Tensor]:
        """The batches, read once per (rows, batch size) and kept: a run validates on the same
        rows at every evaluation. Each is handed out as a fresh copy, so a caller's in-place
        change of its batch cannot reach the next evaluation's."""
        key = (n, batch_size)
        if key not in self._val_cache:
            batches = []
            for start in range(0, n, batch_size):
                idx = np.arange(start, min(start + batch_size, n), dtype=np.int64)
                batches.append(torch.from_numpy(self._rows("val", idx)))
            self._val_cache[key] = batches
        for batch in self._val_cache[key]:
            yield batch.clone()

    def summary(self) -> str:
        """A human-readable multi-line summary of the metadata."""
        m = self.meta
        tok = m["tokenizer"]
        lines = [
            f"dataset     {self.path}",
            f"source      {m.get('source')}",
            f"tokenizer   {tok.get('spec')} (vocab {tok['vocab_size']}"
            + (f", model vocab {self.model_vocab_size}"
               if self.model_vocab_size != self.vocab_size else "")
            + f", eos id {tok['eos_id']}, sha256 {str(tok.get('sha256', ''))[:12]})",
            f"seq_len     {self.seq_len} ({m['dtype']})",
            f"tokens      {m.get('tokens')} tokenized, {m.get('tokens_discarded')} discarded "
            "(packing tails, budget)",
        ]
        if m.get("recipe") or m.get("max_tokens"):
            lines.insert(2, f"recipe      {m.get('recipe')} (budget {m.get('max_tokens')}, "
                            f"reached: {m.get('budget_reached')}, revision {m.get('revision')})")
        for split in SPLITS:
            info = m["splits"][split]
            lines.append(
                f"{split:<11} {m.get('documents', {}).get(split, '?')} documents, "
                f"{info['sequences']} sequences ({info['sequences'] * self.seq_len} tokens) "
                f"in {len(info['shards'])} shard(s)"
            )
        return "\n".join(lines)


_CHUNK = 1 << 23  # bytes read at a time when checking a shard (a multiple of 4)


def _digest_and_max(path: Path, dtype: np.dtype[Any]) -> tuple[str, int]:
    """The file's sha256 and its largest token id, in one pass."""
    h = hashlib.sha256()
    top = -1
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype, count=len(chunk) // dtype.itemsize)
            if ids.size:
                top = max(top, int(ids.max()))
    return h.hexdigest(), top


def open_dataset(path: str | Path, verify: bool = True) -> TokenDataset:
    """Open a prepared dataset directory (see :class:`TokenDataset`)."""
    return TokenDataset(path, verify=verify)
