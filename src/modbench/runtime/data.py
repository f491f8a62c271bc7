"""Opening a run's token data: the built-in corpus (prepared on first use) or a prepared
directory, checked against the run's vocabulary and sequence length; and reading its training
batches ahead of the step (:class:`Prefetcher`)."""

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


def open_data(cfg: RunConfig, progress: bool = True) -> TokenDataset | ProbeMixDataset:
    """Open (preparing the built-in corpus if needed) and check the token data of ``cfg``;
    with ``data.probe_mix`` the training batches carry probe rows (:class:`ProbeMixDataset`)."""
    if cfg.data.source == "builtin":
        path = builtin_dataset(cfg.model.vocab_size, cfg.train.seq_len, progress=progress)
    else:
        path = Path(cfg.data.source)
        if not path.exists():
            raise ModbenchError(
                f"data source {path} does not exist; prepare it with `modbench data prepare` "
                "or use data.source=builtin"
            )
    ds = open_dataset(path, verify=cfg.data.verify)
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


class Prefetcher:
    """The training batches of ``steps``, read ahead by a background thread while the step
    before trains, so reading (and, on CUDA, pinning for an asynchronous copy) never stalls
    the device. A batch depends only on its step and the data seed, so the batches are the
    ones :meth:`train_batch_and_mask` gives, in the same order; an error reading one (a
    damaged shard) is raised by :meth:`get` for that step. Use as a context manager."""

    def __init__(self, data: TokenDataset | ProbeMixDataset, steps: range, batch_size: int,
                 data_seed: int, *, pin: bool = False, depth: int = 2) -> None:
        self.steps = iter(steps)
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()

        def work() -> None:
            for step in steps:
                try:
                    batch, mask = data.train_batch_and_mask(step, batch_size, data_seed)
                    if pin:
                        batch = batch.pin_memory()
                        mask = mask.pin_memory() if mask is not None else None
                    item: Any = (batch, mask)
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
