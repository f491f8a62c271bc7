"""Opening a run's token data: the built-in corpus (prepared on first use) or a prepared
directory, checked against the run's vocabulary and sequence length."""

from __future__ import annotations

from pathlib import Path

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
