"""Opening a run's token data: the built-in corpus (prepared on first use) or a prepared
directory, checked against the run's vocabulary and sequence length; and reading its training
batches ahead of the step (:class:`Prefetcher`).

**A group of processes** (:func:`open_data_in_group`) checks the data once per node: rank 0
prepares the built-in corpus, then the process of ``LOCAL_RANK`` 0 on each node opens the data
with its checksums verified (``data.verify``: every shard read and hashed) while the node's
other processes open it without hashing (metadata, shard sizes, vocabulary and packing are
still checked); then every process learns every other's outcome in one collective, so a
damaged shard found on one node is refused in the same one line on every process instead of
leaving the others waiting at a barrier. A file that passed is recorded with its size,
mtime, ctime and inode (``verified.json``, :mod:`modbench.data.verify_record`), so a later
start or requeue hashes only the files changed since (a damaged one is still refused); the
full check, whatever the record says, is ``modbench data verify``.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import torch

from modbench.config import RunConfig
from modbench.data import builtin_dataset, open_dataset
from modbench.data.dataset import TokenDataset
from modbench.data.mix import ProbeMixDataset
from modbench.errors import ModbenchError


def open_data(cfg: RunConfig, progress: bool = True, *,
              verify: bool | None = None) -> TokenDataset | ProbeMixDataset:
    """Open (preparing the built-in corpus if needed) and check the token data of ``cfg``;
    with ``data.probe_mix`` the training batches carry probe rows (:class:`ProbeMixDataset`).
    ``verify``: hash every shard (None: ``data.verify``)."""
    if cfg.data.source == "builtin":
        path = builtin_dataset(cfg.model.vocab_size, cfg.train.seq_len, progress=progress)
    else:
        path = Path(cfg.data.source)
        if not path.exists():
            raise ModbenchError(
                f"data source {path} does not exist; prepare it with `modbench data prepare` "
                "or use data.source=builtin"
            )
    ds = open_dataset(path, verify=cfg.data.verify if verify is None else verify)
    ds.check_vocab(cfg.model.vocab_size)
    if ds.seq_len != cfg.train.seq_len:
        raise ModbenchError(
            f"data at {path} is packed in rows of {ds.seq_len} tokens but train.seq_len is "
            f"{cfg.train.seq_len}; use --set train.seq_len={ds.seq_len} or re-prepare the data"
        )
    for split in ("train", "val"):  # an empty split fails now, not mid-run
        ds.require_rows(split)
    if cfg.data.probe_mix:
        return ProbeMixDataset(ds, cfg.data.probe_mix, cfg.data.probe_loss)
    return ds


def open_data_in_group(cfg: RunConfig, progress: bool, *, rank: int, local_rank: int,
                       size: int) -> TokenDataset | ProbeMixDataset:
    """:func:`open_data` in a group of ``size`` processes (torch.distributed initialised):
    see the module docstring. Every process raises the same :class:`ModbenchError` when any
    of them could not open the data."""
    if size < 2:
        return open_data(cfg, progress)
    import torch.distributed as dist

    def agree(error: str | None) -> None:
        """Every process's error, exchanged; the first one raised on every process."""
        errors: list[str | None] = [None] * size
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise ModbenchError(first)

    def attempt(fn: Any) -> tuple[Any, str | None]:
        try:
            return fn(), None
        except ModbenchError as e:
            return None, " ".join(str(e).split())
        except Exception as e:  # an unreadable file: still one line, on every process
            return None, (f"process {rank} of {size} could not open the data ("
                          f"{type(e).__name__}: {' '.join(str(e).split())[:200]}); check "
                          f"data.source")

    if cfg.data.source == "builtin":  # prepared once, by rank 0, before anyone opens it
        agree(attempt(lambda: builtin_dataset(cfg.model.vocab_size, cfg.train.seq_len,
                                              progress=progress))[1] if rank == 0 else None)
    verify = cfg.data.verify and local_rank == 0  # the node's one check of every checksum
    data, error = attempt(lambda: open_data(cfg, progress, verify=verify))
    agree(error)
    return data  # type: ignore[no-any-return]


class Prefetcher:
    """The training batches of ``steps``, read ahead by a background thread while the step
    before trains, so reading (and, on CUDA, pinning for an asynchronous copy) never stalls
    the device. A batch depends only on its step and the data seed, so the batches are the
    ones :meth:`train_batch_and_mask` gives, in the same order; an error reading one (a
    damaged shard) is raised by :meth:`get` for that step. Use as a context manager.

    ``pin``: token rows are read straight into pinned memory. ``rows``: only rows
    ``[lo, hi)`` of each batch are read (a process of a group other than rank 0, which
    reads the whole batch for the batch hash); the batch keeps its shape, the other rows
    zero. A probe mix (``data.probe_mix``) is read whole."""

    def __init__(self, data: TokenDataset | ProbeMixDataset, steps: range, batch_size: int,
                 data_seed: int, *, pin: bool = False, depth: int = 2,
                 rows: tuple[int, int] | None = None) -> None:
        self.steps = iter(steps)
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # a process of a group that needs only its rows [lo, hi) of the global batch reads
        # only those (plain token data; a probe mix and its loss mask are made whole)
        sliced = rows is not None and isinstance(data, TokenDataset)

        def read(step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            if sliced:
                assert rows is not None and isinstance(data, TokenDataset)
                # the batch's shape, this process's rows filled, the others zero (nothing
                # here reads them); read straight into pinned memory on CUDA
                batch = torch.zeros(batch_size, data.seq_len, dtype=torch.int64,
                                    pin_memory=pin)
                data.train_rows_into(batch[rows[0]:rows[1]], step, batch_size, data_seed,
                                     rows)
                return batch, None
            if pin and isinstance(data, TokenDataset):  # the whole batch, straight in
                batch = torch.empty(batch_size, data.seq_len, dtype=torch.int64,
                                    pin_memory=True)
                data.train_rows_into(batch, step, batch_size, data_seed, (0, batch_size))
                return batch, None
            batch, mask = data.train_batch_and_mask(step, batch_size, data_seed)
            if pin:
                batch = batch.pin_memory()
                mask = mask.pin_memory() if mask is not None else None
            return batch, mask

        def work() -> None:
            for step in steps:
                try:
                    item: Any = read(step)
                except BaseException as e:  # handed to the training thread
                    item = e
                while not self._stop.is_set():
                    try:
                        self._queue.put((step, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set() or isinstance(item, BaseException):
                    return

        self._thread = threading.Thread(target=work, name="modbench-batches", daemon=True)
        self._thread.start()

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Batch ``step`` (and its loss mask); steps must be asked for in order."""
        expected = next(self.steps)
        if step != expected:
            raise ValueError(f"prefetched batches come in order: asked for step {step}, "
                             f"next is {expected}")
        got, item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        assert got == step
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
