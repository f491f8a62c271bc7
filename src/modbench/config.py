"""Typed configuration: presets, recipes, YAML files and dotted overrides, with strict keys.

A run is described by one :class:`RunConfig`. It is resolved in a fixed order:

1. the preset (model shape plus its default training shape and recipe),
2. the recipe (optimizer, schedule, precision), frozen across methods,
3. an optional YAML file (any subset of the nested keys),
4. command-line flags (``--method``, ``--seed``, ``--steps``, ...),
5. ``--set key=value`` dotted overrides (``--set model.d_model=128``),
6. the recipe exceptions declared by the chosen methods (recorded in ``recipe_exceptions``).

Unknown keys are errors that suggest the nearest valid key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from modbench.errors import ModbenchError, suggest

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
PARALLEL = ("ddp", "fsdp", "auto")  # train.parallel
FSDP_PARAM_DTYPES = ("auto", "bf16", "fp32")  # train.fsdp_param_dtype
COMPILE = ("auto", True, False, "blocks")  # train.compile
_EVERY_K = re.compile(r"every:[1-9][0-9]*")  # train.activation_checkpointing=every:K
TRACKERS = ("wandb", "tensorboard")  # train.trackers (modbench.train.trackers)

#: Settings of how a run executes, not of what it computes (beyond floating-point rounding),
#: each with the value a study's skip key hashes it as whatever it holds (``None``: left out
#: of the hash; otherwise the value runs had before the key existed or changed, so stores keep
#: their keys). A run may also resume under other values of these. Add a key here only if
#: changing it cannot change a run's results beyond rounding.
EXECUTION_KEYS: dict[str, object] = {
    "train.compile": False,
    "train.log_layers": None,
    "train.log_layers_every": None,
    "train.trackers": None,
    "train.dist_timeout": None,
    "train.dist_step_timeout": None,
    "train.max_restarts": None,
}


def _at_least(key: str, value: float, low: float, strict: bool = False) -> None:
    """Refuse ``value`` below ``low`` (or equal to it, ``strict``)."""
    if value < low or (strict and value == low):
        raise ModbenchError(f"{key} must be {'above' if strict else 'at least'} {low:g}, got "
                            f"{value}")


@dataclass
class ModelConfig:
    """Shape of the shared Llama-style decoder (and the method string that modifies it)."""

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 688
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    method: str = "baseline"
    # Attention head size d_h when it is not d_model / n_heads (None: d_model // n_heads).
    # The attention then works at width n_heads * d_h and projects back to d_model (used by
    # Pre-CRMSNorm, whose residual stream is d - 1 wide while the heads keep their size).
    attn_head_dim: int | None = None
    # The training sequence length where it differs from max_seq_len (None: the same). Not
    # set by hand: resolve() and the trainer copy it from train.seq_len. The constants the
    # sources tie to the training length (sigmoid's -log n, SSMax's 1 / log n) read
    # ``trained_seq_len``; a run folder from before this key reads max_seq_len, as it trained.
    train_seq_len: int | None = None

    @property
    def trained_seq_len(self) -> int:
        """The sequence length the model trains at (``train.seq_len``)."""
        return self.max_seq_len if self.train_seq_len is None else self.train_seq_len

    @property
    def head_dim(self) -> int:
        """The resolved head dimension d_h."""
        if self.attn_head_dim is not None:
            return self.attn_head_dim
        return self.d_model // self.n_heads

    def validate(self) -> None:
        # sizes first: the divisibility checks below divide by them
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                    "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ModbenchError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.attn_head_dim is not None and self.attn_head_dim <= 0:
            raise ModbenchError(
                f"model.attn_head_dim must be positive (or empty), got {self.attn_head_dim}"
            )
        if self.attn_head_dim is None and self.d_model % self.n_heads:
            raise ModbenchError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "choose sizes so that d_model = n_heads * head_dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModbenchError(
                f"model.n_heads={self.n_heads} is not a multiple of "
                f"model.n_kv_heads={self.n_kv_heads}; GQA needs whole groups"
            )
        if self.head_dim % 2:
            raise ModbenchError(
                f"head dimension {self.head_dim} is odd; RoPE needs an even head dimension"
            )
        for key in ("rope_theta", "norm_eps", "init_std"):
            _at_least(f"model.{key}", getattr(self, key), 0.0, strict=key == "rope_theta")
        if self.train_seq_len is not None and not 2 <= self.train_seq_len <= self.max_seq_len:
            raise ModbenchError(
                f"model.train_seq_len={self.train_seq_len} must be in [2, model.max_seq_len="
                f"{self.max_seq_len}]; leave it empty, it is copied from train.seq_len")


@dataclass
class RecipeConfig:
    """Optimizer and schedule, frozen across methods (a method may declare exceptions)."""

    name: str = "cpu"
    optimizer: str = "adamw"  # adamw | adam | muon (modbench.train.optim.MuonAdamW)
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices (ndim >= 2) only
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int | None = None  # None: warmup_frac * steps
    warmup_frac: float = 0.05
    schedule: str = "cosine"  # cosine | linear | constant (after warm-up)
    min_lr_ratio: float = 0.1  # the schedule ends at min_lr_ratio * lr
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    # optimizer=muon only: Muon on the hidden matrices (the rest keeps AdamW above); its lr is
    # muon_lr_ratio x the schedule's lr, then scaled per matrix by muon_adjust_lr
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw | original
    muon_lr_ratio: float = 1.0
    # optimizer=muon only: per-matrix learning rates within Muon's group (MuonAdamW docstring).
    # noise: each matrix's lr is scaled by sqrt(H_max / H) (at most muon_noise_max_ratio), H an
    # EMA (factor muon_noise_beta) of the squared dual-norm (nuclear) gradient noise
    muon_layerwise_lr: str = "none"  # none | noise
    muon_noise_beta: float = 0.99
    muon_noise_max_ratio: float = 10.0
    note: str = ""

    def validate(self) -> None:
        """Each key on its own. Keys that must agree with each other are checked by
        :meth:`check_combination`, once the methods' recipe exceptions are applied
        (``modbench.methods.build.plan_run``): a method may set one of them itself."""
        if self.optimizer not in ("adamw", "adam", "muon"):
            raise ModbenchError(
                f"recipe.optimizer must be 'adamw', 'adam' or 'muon', got {self.optimizer!r}"
            )
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ModbenchError(
                f"recipe.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if not 1 <= self.muon_ns_steps < 100:
            raise ModbenchError(
                f"recipe.muon_ns_steps must be in [1, 99], got {self.muon_ns_steps}")
        if self.muon_adjust_lr not in ("match_rms_adamw", "original"):
            raise ModbenchError("recipe.muon_adjust_lr must be 'match_rms_adamw' or 'original', "
                                f"got {self.muon_adjust_lr!r}")
        if not 0 < self.muon_lr_ratio < math.inf:
            raise ModbenchError(
                f"recipe.muon_lr_ratio must be positive and finite, got {self.muon_lr_ratio}")
        if self.muon_layerwise_lr not in ("none", "noise"):
            raise ModbenchError("recipe.muon_layerwise_lr must be 'none' or 'noise', got "
                                f"{self.muon_layerwise_lr!r}")
        if not 0.0 <= self.muon_noise_beta < 1.0:
            raise ModbenchError(
                f"recipe.muon_noise_beta must be in [0, 1), got {self.muon_noise_beta}")
        if not 1.0 <= self.muon_noise_max_ratio < math.inf:
            raise ModbenchError("recipe.muon_noise_max_ratio must be at least 1 and finite, got "
                                f"{self.muon_noise_max_ratio}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ModbenchError(
                f"recipe.schedule must be cosine, linear or constant, got {self.schedule!r}"
            )
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ModbenchError(
                f"recipe.precision must be auto, fp32 or bf16, got {self.precision!r}"
            )
        if not self.lr > 0:
            raise ModbenchError(f"recipe.lr must be positive, got {self.lr}")
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ModbenchError(f"recipe.betas[{i}] must be in [0, 1), got {b}")
        for key in ("eps", "weight_decay", "grad_clip", "min_lr_ratio"):
            _at_least(f"recipe.{key}", getattr(self, key), 0.0)
        if self.warmup_steps is not None:
            _at_least("recipe.warmup_steps", self.warmup_steps, 0)
        if not 0.0 <= self.warmup_frac <= 1.0:
            raise ModbenchError(f"recipe.warmup_frac must be in [0, 1], got {self.warmup_frac}")

    def warmup_for(self, steps: int) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(self.warmup_frac * steps)

    def check_combination(self) -> None:
        """The keys that depend on each other, as the run will train (recipe exceptions
        applied): the Muon-only settings need recipe.optimizer=muon (``osp`` sets it)."""
        if self.muon_layerwise_lr == "noise" and self.optimizer != "muon":
            raise ModbenchError("recipe.muon_layerwise_lr=noise sets Muon's per-matrix learning "
                                f"rates, but recipe.optimizer is {self.optimizer!r}; add "
                                "recipe.optimizer=muon")


@dataclass
class TrainConfig:
    """Training shape and bookkeeping (not part of the frozen recipe)."""

    steps: int = 300
    batch_size: int = 16  # sequences per optimizer step
    # Sequences a forward takes (gradient accumulation when fewer than a process's batch;
    # validation and probe scoring too): a number dividing batch_size, None (the whole
    # batch), or auto: the largest that fits the device by the memory plan
    # (modbench.measure.plan; `modbench plan`), chosen when the run starts and recorded in
    # config.yaml's meta and summary.json. Only rounding changes, except for methods whose
    # forward uses batch statistics (powernorm, prepbn).
    micro_batch_size: int | str | None = None
    # The device memory (GB, 10^9 bytes) train.micro_batch_size=auto plans against; None: the
    # device's own (a GPU's total memory, the CPU's RAM)
    device_memory_gb: float | None = None
    seq_len: int = 128
    eval_every: int = 100  # validation every K steps (and always at the end); 0: only at end
    eval_sequences: int = 64  # size of the fixed validation set, in sequences
    # Held-out items per offline probe (mqar, induction, cloze) scored at every validation
    # point and logged with it: a capability learning curve. 0: off (`modbench eval` still
    # scores the finished run).
    eval_probes: int = 0
    checkpoint_every: int = 0  # 0: no periodic checkpoints (a final one is always written)
    log_every: int = 1
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # torch.compile the step's forward: auto (compiled on CUDA, eager on the CPU, falling back
    # to eager with a warning where compilation fails), true or false; blocks: each decoder
    # block compiled on its own (one graph per block, reused by every layer of the same code;
    # shorter compilation for deep models, and the unit FSDP2 shards)
    compile: bool | str = "auto"
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default
    # torch's oneDNN (mkldnn) CPU kernels; false turns them off for the run
    # (torch.backends.mkldnn.flags): other kernels, another summation order (a replication
    # factor: `modbench study replicate --change onednn`)
    onednn: bool = True
    # Initial weights for a fresh start (ignored on --resume): a run folder or a checkpoint
    # file; methods may map the weights onto new shapes (TokenFormer growth).
    init_from: str | None = None
    # Multi-process runs (`modbench train --nproc N`, torchrun): how the model is spread over
    # the processes. ddp: a full replica per process, gradients all-reduced; fsdp: parameters,
    # gradients and optimizer state sharded (FSDP2, one unit per decoder block); auto: DDP
    # where the memory plan fits the GPU with DDP, else FSDP where it fits with FSDP, else
    # refused (measure.plan.layout); DDP with one process (nothing to spread) and on the CPU
    # (no device memory to plan against). Ignored by a single process; the numbers agree
    # with a single process to float32 rounding either way.
    parallel: str = "ddp"  # ddp | fsdp | auto
    # FSDP2's mixed-precision policy: the dtype its units gather parameters in for the
    # forward and backward (gradients are reduced in fp32, master weights and optimizer stay
    # fp32). auto: bf16 where the forward runs under bf16 autocast (recipe.precision), else
    # fp32. bf16 halves the all-gathers and the unsharded parameters' memory; the numbers
    # then agree with one process to bf16 rounding.
    fsdp_param_dtype: str = "auto"  # auto | bf16 | fp32
    # Multi-process runs: seconds a process waits at a collective (the data check, a step's
    # all-reduce, a checkpoint's gather) before the run fails in one line naming this key;
    # passed to init_process_group. How long it may wait, never what it computes.
    dist_timeout: float = 1800.0
    # ... once the first step has run: a shorter wait, so a stuck or lost process ends the run
    # (and a restart, max_restarts, begins) in minutes; start-up (data preparation, hashing,
    # compiling, the first step) keeps dist_timeout, and so does a checkpoint's write. The
    # smaller of the two applies.
    dist_step_timeout: float = 300.0
    # Multi-process runs: times torchrun starts the whole group again after a process failed
    # or was killed (torchrun's --max-restarts); each restart resumes from the last
    # checkpoint. 0: a failure ends the run.
    max_restarts: int = 0
    # Recompute decoder blocks' activations in the backward (torch.utils.checkpoint) instead
    # of keeping them: less memory, more compute, the same numbers. false | true (= full:
    # every block, each keeps only its input) | every:K (every K-th block) | attn (every
    # block keeps its attention output and recomputes the rest); train/recompute.py.
    activation_checkpointing: bool | str = False
    # Per-layer gradient norms and activation RMS in each logged training record of
    # metrics.jsonl (docs/diagnostics.md); only what is logged changes, never the numbers.
    log_layers: bool = False
    # With log_layers: only in the logged records of every N-th step (and the last); 0: in
    # every logged record. Where the forward is compiled or seeds are stacked, each such step
    # costs one extra forward, so a large N keeps a GPU run's overhead small.
    log_layers_every: int = 0
    # Experiment trackers that also receive the run's config, metrics, validation, probes and
    # summary (docs/trackers.md): any of wandb, tensorboard (extras [wandb], [tensorboard]).
    # Only where the numbers are sent changes, never the numbers.
    trackers: list[str] = field(default_factory=list)
    # Stall detection (modbench.runtime.stall, docs/runs.md): a finished run whose validation
    # loss sat within stall_margin nats of the unigram level (or above it) from some step after
    # warm-up to the end, for at least stall_patience of the steps after warm-up and at least
    # stall_min_steps steps, and fell by less than stall_margin meanwhile, ends with status
    # stalled. stall_margin 0: off.
    stall_margin: float = 0.1
    stall_patience: float = 0.5  # fraction of the steps after warm-up, in [0, 1]
    stall_min_steps: int = 100
    # Early stop of a stalled run (docs/runs.md, "Stopping stalled runs"): at a validation,
    # a run whose losses since some step s after warm-up all sat at the unigram level (within
    # stop_stalled_margin nats of it, or above it), for at least this many steps, and fell by
    # less than stop_stalled_margin meanwhile, stops there with status stalled
    # (stalled_at_step s). None: off (modbench train's default); studies set it
    # (modbench.study.spec.STUDY_STOP_STALLED_AFTER).
    stop_stalled_after: int | None = None
    # the stop's margin: tighter than stall_margin, which only labels a finished run. At 0.1
    # runs that sat 0.03-0.08 nats under the level for 200 steps and then learned on
    # (Sandwich-LN, CRMSNorm at builtin-cpu's settings) were cut; stalled runs sit within 0.01
    # of it. 0: never stop
    stop_stalled_margin: float = 0.05
    # the validations the stop looks at: the first, then each at least this many steps after
    # the last one looked at (None: every validation). Each look is one more chance to cut a
    # run that would have learned on: at builtin-cpu's settings, looking every 20 steps cut
    # SeedNorm (seed 4, at the level from step 60 to 420) where looking every 100 cut none
    # (0 of 15 stops over 96 runs: benchmarks/stall_rule.py); studies set 100
    # (modbench.study.spec.STUDY_STOP_STALLED_EVERY)
    stop_stalled_every: int | None = None

    def logs(self, done: int) -> bool:
        """Whether ``metrics.jsonl`` logs the training record after ``done`` steps: every
        ``log_every`` steps (0 or 1: every step) and the last."""
        return done % max(self.log_every, 1) == 0 or done == self.steps

    def validate(self) -> None:
        if self.steps <= 0:
            raise ModbenchError(f"train.steps must be positive, got {self.steps}")
        _at_least("train.stall_margin", self.stall_margin, 0.0)
        _at_least("train.stall_min_steps", self.stall_min_steps, 0)
        if not 0.0 <= self.stall_patience <= 1.0:
            raise ModbenchError(f"train.stall_patience must be in [0, 1] (a fraction of the "
                                f"steps after warm-up), got {self.stall_patience}")
        _at_least("train.stop_stalled_margin", self.stop_stalled_margin, 0.0)
        ssa = self.stop_stalled_after
        if ssa is not None and (isinstance(ssa, bool) or not isinstance(ssa, int) or ssa < 1):
            raise ModbenchError(f"train.stop_stalled_after must be a number of steps, at least "
                                f"1, or null (never stop a stalled run early), got {ssa!r}")
        sse = self.stop_stalled_every
        if sse is not None and (isinstance(sse, bool) or not isinstance(sse, int) or sse < 1):
            raise ModbenchError(f"train.stop_stalled_every must be a number of steps, at least "
                                f"1, or null (the stop looks at every validation), got {sse!r}")
        if self.batch_size <= 0:
            raise ModbenchError(f"train.batch_size must be positive, got {self.batch_size}")
        if self.seq_len < 2:
            raise ModbenchError(f"train.seq_len must be at least 2 (a token and its next), got "
                                f"{self.seq_len}")
        for key in ("eval_every", "checkpoint_every", "log_every", "threads",
                    "log_layers_every"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        _at_least("train.eval_sequences", self.eval_sequences, 1)
        if not _DEVICE.fullmatch(self.device):
            raise ModbenchError(f"train.device must be auto, cpu, cuda or cuda:N, got "
                                f"{self.device!r}")
        if self.eval_probes < 0:
            raise ModbenchError(f"train.eval_probes must be 0 (off) or a number of items, got "
                                f"{self.eval_probes}")
        if not isinstance(self.onednn, bool):
            raise ModbenchError(f"train.onednn must be true or false, got {self.onednn!r}")
        if self.compile not in COMPILE or (self.compile in (0, 1)
                                           and not isinstance(self.compile, bool)):
            raise ModbenchError(f"train.compile must be auto, true, false or blocks, got "
                                f"{self.compile!r}")
        if isinstance(self.dist_timeout, bool) or not (
                isinstance(self.dist_timeout, int | float) and 0 < self.dist_timeout < 1e9):
            raise ModbenchError(f"train.dist_timeout must be a positive number of seconds "
                                f"(default 1800), got {self.dist_timeout!r}")
        if isinstance(self.dist_step_timeout, bool) or not (
                isinstance(self.dist_step_timeout, int | float)
                and 0 < self.dist_step_timeout < 1e9):
            raise ModbenchError(f"train.dist_step_timeout must be a positive number of seconds "
                                f"(default 300), got {self.dist_step_timeout!r}")
        mr = self.max_restarts
        if isinstance(mr, bool) or not isinstance(mr, int) or not 0 <= mr <= 100:
            raise ModbenchError(f"train.max_restarts must be a whole number from 0 to 100 "
                                f"(0: a failed process ends the run), got {mr!r}")
        ac = self.activation_checkpointing
        if not (isinstance(ac, bool) or ac in ("full", "attn")
                or (isinstance(ac, str) and _EVERY_K.fullmatch(ac))):
            raise ModbenchError(f"train.activation_checkpointing must be false, true (= full), "
                                f"full, attn or every:K with K >= 1 (e.g. every:2), got {ac!r}")
        if self.fsdp_param_dtype not in FSDP_PARAM_DTYPES:
            raise ModbenchError(f"train.fsdp_param_dtype must be {', '.join(FSDP_PARAM_DTYPES)}"
                                f", got {self.fsdp_param_dtype!r}")
        if self.parallel not in PARALLEL:
            raise ModbenchError(f"train.parallel must be ddp or fsdp, got {self.parallel!r} "
                                "(or auto: DDP where the memory plan fits the GPU, else FSDP)")
        for i, name in enumerate(self.trackers):
            if name not in TRACKERS:
                raise ModbenchError(f"unknown tracker {name!r} in train.trackers"
                                    f"{suggest(str(name), TRACKERS)}; the known ones are "
                                    f"{', '.join(TRACKERS)}")
            if name in self.trackers[:i]:
                raise ModbenchError(f"train.trackers lists {name!r} twice; name each tracker "
                                    "once")
        mb = self.micro_batch_size
        if isinstance(mb, str) and mb != "auto":
            raise ModbenchError(f"train.micro_batch_size must be a number of sequences, auto "
                                f"or null, got {mb!r}")
        if isinstance(mb, int) and (mb <= 0 or self.batch_size % mb):
            raise ModbenchError(
                f"train.micro_batch_size={mb} must divide train.batch_size={self.batch_size}"
            )
        gb = self.device_memory_gb
        if gb is not None and not (isinstance(gb, int | float) and math.isfinite(gb)
                                   and gb > 0):
            raise ModbenchError(f"train.device_memory_gb must be a positive number of GB (or "
                                f"null: the device's own), got {gb!r}")

    def forward_rows(self) -> int:
        """Sequences a forward outside a step takes (validation, probes, diagnostics): the
        micro-batch where it is a number (the trainer writes the one ``auto`` chose into its
        in-memory config; ``eval.run.load_run`` reads it back from config.yaml's meta), else
        the batch."""
        mb = self.micro_batch_size
        return mb if isinstance(mb, int) and not isinstance(mb, bool) else self.batch_size


PROBE_LOSSES = ("all", "answers")  # data.probe_loss (modbench.data.mix)


def check_probe_loss(value: str) -> None:
    if value not in PROBE_LOSSES:
        raise ModbenchError(f"data.probe_loss must be {' or '.join(PROBE_LOSSES)}, got {value!r}")


@dataclass
class DataConfig:
    """Where tokens come from. ``builtin`` needs no network; otherwise a prepared directory."""

    source: str = "builtin"  # builtin | path to a directory written by `modbench data prepare`
    data_seed: int = 1234  # fixes the batch order, independent of the init seed
    verify: bool = True  # check shard checksums when opening
    probe_mix: float = 0.0  # fraction of each training batch replaced by mqar/induction rows
    probe_loss: str = "all"  # all | answers: which predictions of a probe row enter the loss


@dataclass
class RunConfig:
    preset: str = "cpu-small"
    seed: int = 0  # init seed: varies the weights only, never the data order
    model: ModelConfig = field(default_factory=ModelConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe_exceptions: dict[str, Any] = field(default_factory=dict)

    def sync_seq_len(self) -> None:
        """Copy ``train.seq_len`` into ``model.train_seq_len`` where the two lengths differ
        (None where ``train.seq_len`` equals ``model.max_seq_len``)."""
        seq = self.train.seq_len
        self.model.train_seq_len = None if seq == self.model.max_seq_len else seq

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ModbenchError(f"unknown preset '{self.preset}'{suggest(self.preset, PRESETS)}; "
                                "choose it with --preset, one of: " + ", ".join(PRESETS))
        for key, seed in (("seed", self.seed), ("data.data_seed", self.data.data_seed)):
            if not 0 <= seed < 2**63:
                raise ModbenchError(f"{key} must be an integer in [0, 2**63), got {seed}")
        self.model.validate()
        self.recipe.validate()
        self.train.validate()
        check_probe_loss(self.data.probe_loss)
        if not 0.0 <= self.data.probe_mix < 1.0:
            raise ModbenchError(f"data.probe_mix must be in [0, 1), got {self.data.probe_mix}")
        if self.train.seq_len > self.model.max_seq_len:
            raise ModbenchError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; lower the first or raise the second"
            )

    def to_dict(self) -> dict[str, Any]:
        """The config's serialised form: a tree of plain values (every key, nested by
        section) that :func:`from_dict` reads back to an equal config; ``config.yaml``
        (:func:`dump_yaml`) and a study job crossing to another process
        (``modbench.study.jobs.Job``) carry it."""
        return _to_plain(dataclasses.asdict(self))


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_plain(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------
# Presets


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    recipe: str
    train: dict[str, Any]
    note: str = ""
    # recipe keys the preset sets over its recipe's (a ladder rung's scaled warm-up)
    recipe_keys: dict[str, Any] = field(default_factory=dict)


def _llama(vocab: int, d: int, layers: int, heads: int, ff: int) -> ModelConfig:
    # The Mix-LN / LayerNorm-Scaling scripts use HF LlamaForCausalLM configs: full MHA,
    # untied head, max_length 256, rms_norm_eps 1e-6.
    return ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                       n_kv_heads=heads, d_ff=ff, max_seq_len=256, norm_eps=1e-6,
                       tie_embeddings=False)


def _climb(name: str, d: int, layers: int, ff: int, note: str) -> Preset:
    # arXiv 2605.20798 §3.2: 32 heads with 8 KV heads, context 1024, vocab 65664, tied embeddings;
    # 44,000 steps of 512 x 1024 tokens, the seed002 recipe.
    model = ModelConfig(vocab_size=65664, d_model=d, n_layers=layers, n_heads=32, n_kv_heads=8,
                        d_ff=ff, max_seq_len=1024, tie_embeddings=True)
    train = {"steps": 44000, "batch_size": 512, "seq_len": 1024, "eval_every": 100,
             "eval_sequences": 1024, "checkpoint_every": 1000, "micro_batch_size": "auto"}
    return Preset(name, model, "seed002", train, note)


_LLAMA_TRAIN = {"batch_size": 512, "seq_len": 256, "eval_every": 1000, "eval_sequences": 2048,
                "checkpoint_every": 1000, "micro_batch_size": "auto"}
_MIXLN_NOTE = ("LLaMA shape of the Mix-LN / LayerNorm-Scaling scripts (docs/sources.md#comt); "
               "batch 512 x 256 tokens as in their C4 scripts; train on C4 prepared with a "
               "32000-token tokenizer (`modbench data prepare`).")

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "tiny",
            ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=176, max_seq_len=64),
            recipe="cpu",
            train={"steps": 30, "batch_size": 8, "seq_len": 64, "eval_every": 10,
                   "eval_sequences": 16},
            note="For tests: trains in seconds.",
        ),
        Preset(
            "cpu-small",
            ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                        d_ff=688, max_seq_len=128),
            recipe="cpu",
            train={"steps": 300, "batch_size": 16, "seq_len": 128, "eval_every": 100,
                   "eval_sequences": 128},
            note="A few million parameters; trains usefully in minutes on 2 CPU cores.",
        ),
        Preset(
            "cpu-deep",
            ModelConfig(vocab_size=1024, d_model=64, n_layers=24, n_heads=4, n_kv_heads=4,
                        d_ff=176, max_seq_len=128, norm_eps=1e-6, tie_embeddings=False),
            recipe="c4-mixln",
            train={"steps": 500, "batch_size": 8, "seq_len": 64, "eval_every": 100,
                   "eval_sequences": 32},
            note="Deep and narrow (24 layers of width 64, full MHA, untied head, the LLaMA "
                 "scripts' eps) at the c4-mixln recipe (Adam 1e-3, no clipping): a CPU-cheap "
                 "probe of depth instability for the norm placements (about 1.4M parameters).",
        ),
        Preset("llama-60m", _llama(32000, 512, 8, 8, 1376), "c4-mixln",
               {**_LLAMA_TRAIN, "steps": 10000}, _MIXLN_NOTE),
        Preset("llama-71m", _llama(32000, 512, 12, 8, 1368), "c4-mixln",
               {**_LLAMA_TRAIN, "steps": 10000}, _MIXLN_NOTE),
        Preset("llama-130m", _llama(32000, 768, 12, 12, 2048), "c4-mixln",
               {**_LLAMA_TRAIN, "steps": 20000}, _MIXLN_NOTE),
        Preset("llama-250m", _llama(32000, 768, 24, 16, 2560), "c4-mixln",
               {**_LLAMA_TRAIN, "steps": 40000}, _MIXLN_NOTE),
        Preset("llama-350m", _llama(32000, 1024, 24, 16, 2736), "c4-mixln",
               {**_LLAMA_TRAIN, "steps": 60000}, _MIXLN_NOTE),
        Preset("llama-1b", _llama(32000, 2048, 24, 32, 5461), "c4-mixln",
               {**_LLAMA_TRAIN, "steps": 90000}, _MIXLN_NOTE + " The scripts use lr 5e-4 at 1B."),
        _climb("climb-1.2b", 2048, 24, 5632,
               "arXiv 2605.20798 §3.2: 24 layers, hidden 2048, 32 heads / 8 KV heads, SwiGLU 5632, "
               "context 1024, vocab 65664, tied embeddings (1.217B parameters, Table 4); "
               "44,000 steps of 512 x 1024 tokens (23.07B tokens)."),
        _climb("climb-3b", 3072, 28, 8192,
               "arXiv 2605.20798 §5: 28 layers, hidden 3072, FFN 8192. The paper says only 'all "
               "other details identical', so heads (32), KV heads (8), vocab, context and tying "
               "are taken from climb-1.2b; the step count is not given (60.04B tokens would be "
               "~114,500 steps at 512 x 1024) and is left at the 1.2B value: set train.steps."),
    ]
}


# --------------------------------------------------------------------------------------
# Recipes

RECIPES: dict[str, RecipeConfig] = {
    "seed002": RecipeConfig(
        name="seed002", optimizer="adamw", lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
        weight_decay=0.1, grad_clip=1.0, warmup_steps=2000, schedule="cosine",
        min_lr_ratio=0.1, precision="auto",
        note="arXiv 2605.20798 §3.2: AdamW (0.9, 0.95), wd 0.1 on matrices, clip 1.0, 2,000 linear "
             "warm-up steps, cosine to 10%, bf16 autocast with fp32 master weights. The seed's "
             "text lost the learning rate; 3e-4 is our choice [unverified].",
    ),
    "c4-mixln": RecipeConfig(
        name="c4-mixln", optimizer="adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
        weight_decay=0.0, grad_clip=0.0, warmup_steps=None, warmup_frac=0.1, schedule="cosine",
        min_lr_ratio=0.1, precision="auto",
        note="The Mix-LN / LayerNorm-Scaling C4 scripts: Adam lr 1e-3 (5e-4 for 1B: set "
             "recipe.lr), no weight decay, no clipping (--grad_clipping 0.0), warm-up 10% of "
             "steps, cosine to 10%, bf16.",
    ),
    "cpu": RecipeConfig(
        name="cpu", optimizer="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
        grad_clip=1.0, warmup_steps=None, warmup_frac=0.05, schedule="cosine", min_lr_ratio=0.1,
        precision="auto",
        note="seed002's shape (AdamW, wd 0.1, clip 1.0, warm-up, cosine to 10%) with a learning "
             "rate and warm-up fraction sized for few-million-parameter CPU models and runs of "
             "a few hundred steps.",
    ),
}


# --------------------------------------------------------------------------------------
# Ladders: families of shapes derived from one shape by a size factor (docs/studies.md,
# "Ladders"; issue 31)


def non_embedding_params(m: ModelConfig) -> int:
    """Baseline parameters less the token embedding and untied head: per layer the attention
    projections, SwiGLU and two norms, plus the final norm (``measure.flops.baseline_params``
    less ``vocab x d`` once or twice)."""
    d, dh = m.d_model, m.head_dim
    attn = d * m.n_heads * dh + 2 * d * m.n_kv_heads * dh + m.n_heads * dh * d
    return m.n_layers * (attn + 3 * d * m.d_ff + 2 * d) + d


def ladder_shape(top: ModelConfig, size: float) -> ModelConfig:
    """The shape ``size`` times as large as ``top`` in non-embedding parameters, about: width
    and depth each scaled by ``c = size ** (1/3)`` (the aspect ratio d / L kept), so
    ``L' = max(1, round(c L))``; the query heads scaled with the width in whole GQA groups
    of the top's size g, ``H' = max(g, round(c H / g) g)``, ``n_kv' = H' / g``; the head size
    what is left of the scaled width, even (RoPE), ``d_h' = max(2, round(c d / H' / 2) 2)``, and
    ``d' = H' d_h'`` (so d_h stays near the top's); the FFN width keeps its ratio to d, a
    multiple of 8, ``d_ff' = max(8, round(d_ff d' / d / 8) 8)``. Vocabulary, context, norms and
    tying are the top's. ``size = 1`` gives ``top`` itself."""
    if not (math.isfinite(size) and 0 < size <= 1):
        raise ModbenchError(f"a ladder's size factor must be in (0, 1], got {size}")
    if size == 1:
        return dataclasses.replace(top)
    c = size ** (1.0 / 3.0)
    g = top.n_heads // top.n_kv_heads
    heads = max(g, round(c * top.n_heads / g) * g)
    dh = max(2, round(c * top.d_model / heads / 2) * 2)
    d = heads * dh
    ff = max(8, round(top.d_ff * d / top.d_model / 8) * 8)
    return dataclasses.replace(top, d_model=d, n_layers=max(1, round(c * top.n_layers)),
                               n_heads=heads, n_kv_heads=heads // g, d_ff=ff,
                               attn_head_dim=None)


@dataclass(frozen=True)
class Ladder:
    """A family of ``rungs`` shapes ending at the preset ``top`` (the largest rung, trained as
    that preset is; it may be a rung of a ladder listed before it in :data:`LADDERS`), each
    about ``factor`` times smaller in non-embedding parameters than the next
    (:func:`ladder_shape` at size ``factor ** -k``). Every rung trains on
    ``tokens_per_param`` tokens per non-embedding parameter (None: the top's own ratio),
    sequences of the top's length; its batch is the top's scaled with the compute
    ``C ~ N D ~ N^2`` as ``C^(1/3)`` (``batch (N'/N)^(2/3)`` to the nearest power of two, at
    least ``min_batch``); its steps give the tokens; its warm-up (a fixed count in the
    recipe), validation and checkpoint intervals shrink with its steps, so each rung warms up
    over the same fraction and validates as often. The learning rate and every other recipe
    key are the top's: the recipe is frozen along the ladder."""

    name: str
    top: str
    rungs: int
    factor: float
    min_batch: int
    tokens_per_param: float | None = None
    note: str = ""

    def rung_names(self) -> list[str]:
        """Smallest first; the last is ``top``."""
        return [f"{self.name}-ladder-{k + 1}" for k in range(self.rungs - 1)] + [self.top]


def _pow2(x: float) -> int:
    return 1 << max(0, round(math.log2(max(x, 1.0))))


def ladder_presets(ladder: Ladder, top: Preset) -> list[Preset]:
    """The rungs of ``ladder`` below its top, as presets (:class:`Ladder` has the rule)."""
    t = top.train
    seq, batch, steps = int(t["seq_len"]), int(t["batch_size"]), int(t["steps"])
    n_top = non_embedding_params(top.model)
    ratio = ladder.tokens_per_param or steps * batch * seq / n_top
    warm = RECIPES[top.recipe].warmup_steps
    out = []
    for k, name in enumerate(ladder.rung_names()[:-1]):
        model = ladder_shape(top.model, ladder.factor ** -(ladder.rungs - 1 - k))
        n = non_embedding_params(model)
        b = max(ladder.min_batch, min(batch, _pow2(batch * (n / n_top) ** (2 / 3))))
        st = max(1, round(ratio * n / (b * seq)))
        train = {**t, "batch_size": b, "steps": st}
        for key in ("eval_every", "checkpoint_every"):
            if t.get(key):
                train[key] = max(1, round(t[key] * st / steps))
        if isinstance(t.get("micro_batch_size"), int):
            train["micro_batch_size"] = math.gcd(b, t["micro_batch_size"])
        recipe = {"warmup_steps": round(warm * st / steps)} if warm is not None else {}
        out.append(Preset(name, model, top.recipe, train,
                          f"Rung {k + 1} of {ladder.rungs} of the {ladder.name} ladder "
                          f"(top {ladder.top}): {n / 1e6:.3g}M non-embedding parameters, "
                          f"{st * b * seq / n:.3g} tokens per non-embedding parameter.",
                          recipe))
    return out


LADDERS: dict[str, Ladder] = {lad.name: lad for lad in [
    Ladder("smoke", "smoke-top", rungs=4, factor=2.0, min_batch=8,
           note="Tiny rungs for CI (ladder-smoke): seconds each."),
    Ladder("cpu", "cpu-top", rungs=6, factor=2.1, min_batch=8,
           note="0.2M to 8M non-embedding parameters on the built-in corpus; ladder-cpu "
                "trains the four smallest."),
    Ladder("cpu-short", "cpu-ladder-3", rungs=4, factor=1.8, min_batch=8,
           note="0.16M to 0.95M non-embedding parameters (3 to 6 layers), ending at the cpu "
                "ladder's third rung: ladder-cpu's, a quarter of the cost of the cpu ladder's "
                "four smallest rungs (which took about 75 minutes on 2 shared cores)."),
    Ladder("gpu", "climb-1.2b", rungs=4, factor=4.0, min_batch=32,
           note="About 17M to 1.08B non-embedding parameters ending at seed 002's 1.2B "
                "shape, its tokens per parameter (about 21) at every rung."),
]}

LADDER_PRESETS = [
    Preset("smoke-top",
           ModelConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                       d_ff=176, max_seq_len=64),
           recipe="cpu",
           train={"steps": 48, "batch_size": 8, "seq_len": 32, "eval_every": 0,
                  "eval_sequences": 16},
           note="The smoke ladder's top rung (for tests and CI)."),
    Preset("cpu-top",
           ModelConfig(vocab_size=1024, d_model=256, n_layers=12, n_heads=8, n_kv_heads=4,
                       d_ff=688, max_seq_len=128),
           recipe="cpu",
           train={"steps": 5000, "batch_size": 8, "seq_len": 64, "eval_every": 500,
                  "eval_sequences": 32},
           note="The CPU ladder's top rung: about 8.7M non-embedding parameters (12 x 256, 8 "
                "heads of 32 in groups of 2)."),
]
PRESETS.update({p.name: p for p in LADDER_PRESETS})
for _lad in LADDERS.values():  # in order: a ladder may end at an earlier ladder's rung
    PRESETS.update({p.name: p for p in ladder_presets(_lad, PRESETS[_lad.top])})

_LADDER = re.compile(r"\s*ladder\s*\(\s*([A-Za-z0-9_.-]+)\s*(?:,\s*([0-9]+)\s*)?\)\s*")


def ladder_scales(text: str) -> list[str] | None:
    """The presets of ``ladder(NAME)`` (every rung) or ``ladder(NAME, K)`` (its K smallest
    rungs), smallest first; None when ``text`` is not of that form."""
    m = _LADDER.fullmatch(text)
    if m is None:
        return None
    name = m.group(1)
    if name not in LADDERS:
        raise ModbenchError(f"unknown ladder '{name}'{suggest(name, LADDERS)}; the ladders are "
                            f"{', '.join(LADDERS)} (docs/studies.md, Ladders)")
    names = LADDERS[name].rung_names()
    k = len(names) if m.group(2) is None else int(m.group(2))
    if not 1 <= k <= len(names):
        raise ModbenchError(f"ladder({name}, {k}): the {name} ladder has {len(names)} rungs; "
                            f"ask for 1 to {len(names)}")
    return names[:k]


def expand_scales(value: Any) -> Any:
    """A spec's ``scales``: ``ladder(NAME[, K])`` or a list whose items are presets or
    ladders, as the list of presets (other values are returned as they are, for the spec's
    own check to refuse)."""
    if isinstance(value, str):
        return ladder_scales(value) or value
    if isinstance(value, list):
        out: list[Any] = []
        for v in value:
            rungs = ladder_scales(v) if isinstance(v, str) else None
            out += [r for r in rungs or [v] if r not in out]  # a scale named twice: once
        return out
    return value


# --------------------------------------------------------------------------------------
# Resolution and overrides


DEFAULT_PRESET = "cpu-small"


def resolve(
    preset: str | None = None,
    *,
    recipe: str | None = None,
    yaml_file: str | Path | None = None,
    method: str | None = None,
    seed: int | None = None,
    steps: int | None = None,
    overrides: list[str] | None = None,
) -> RunConfig:
    """Build a validated :class:`RunConfig` (method recipe exceptions are applied later).

    The preset is the argument, else the YAML file's ``preset``, else ``cpu-small``. A YAML
    file may be a run's own ``config.yaml`` (its ``meta`` section is ignored).
    """
    tree: dict[str, Any] = {}
    if yaml_file is not None:
        tree = load_yaml(yaml_file)
        tree.pop("meta", None)
        if preset is not None:
            tree["preset"] = preset
    preset = str(preset or tree.get("preset") or DEFAULT_PRESET)
    if preset not in PRESETS:
        raise ModbenchError(
            f"unknown preset '{preset}'{suggest(preset, PRESETS)}; "
            f"choose one of: {', '.join(PRESETS)}"
        )
    p = PRESETS[preset]
    cfg = RunConfig(preset=preset, model=copy.deepcopy(p.model))
    recipe_tree = tree.get("recipe") if isinstance(tree.get("recipe"), dict) else {}
    recipe_name = str(recipe or recipe_tree.get("name") or p.recipe)
    if recipe_name not in RECIPES:
        raise ModbenchError(
            f"unknown recipe '{recipe_name}'{suggest(recipe_name, RECIPES)}; "
            f"choose one of: {', '.join(RECIPES)}"
        )
    cfg.recipe = copy.deepcopy(RECIPES[recipe_name])
    for k, v in p.train.items():
        setattr(cfg.train, k, v)
    for k, v in p.recipe_keys.items():
        setattr(cfg.recipe, k, v)
    if tree:
        _merge_tree(cfg, tree, prefix="")
    cfg.recipe.name = recipe_name
    if method is not None:
        cfg.model.method = method
    if seed is not None:
        cfg.seed = seed
    if steps is not None:
        cfg.train.steps = steps
    for item in overrides or []:
        apply_override(cfg, item)
    if cfg.model.train_seq_len not in (None, cfg.train.seq_len):
        raise ModbenchError(f"model.train_seq_len={cfg.model.train_seq_len} is copied from "
                            "train.seq_len, not set by hand; set train.seq_len instead")
    cfg.sync_seq_len()
    cfg.validate()
    return cfg


def yaml_nodes(node: yaml.Node, limit: int) -> int:
    """Nodes of a composed YAML document counting each alias use in full (an alias bomb is
    huge), stopping once past ``limit``: what study specs and task files check before they
    construct a document."""
    count, stack = 0, [node]
    while stack and count < limit:
        n = stack.pop()
        count += 1
        if isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
        elif isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack += [k, v]
    return count


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ModbenchError(f"config file {p} does not exist; pass a YAML file path")
    try:
        tree = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ModbenchError(f"config file {p} is not UTF-8 text; give a YAML file") from None
    except yaml.YAMLError as e:
        raise ModbenchError(f"config file {p} is not valid YAML ({e.__class__.__name__}); "
                            "fix the syntax") from e
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ModbenchError(f"config file {p} must hold a mapping of keys, got {type(tree)}")
    return tree


def valid_keys(obj: Any = None, prefix: str = "") -> list[str]:
    """All dotted keys of a RunConfig (``model.d_model``, ``recipe.lr``, ...)."""
    obj = obj if obj is not None else RunConfig()
    keys: list[str] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            keys += valid_keys(v, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def _is_key(obj: Any, name: Any) -> bool:
    """Whether ``name`` is a config key of the dataclass ``obj`` (a field: not a method,
    property or private attribute)."""
    return isinstance(name, str) and name in {f.name for f in dataclasses.fields(obj)}


def _unknown(key: str) -> ModbenchError:
    return ModbenchError(f"unknown config key {key!r}{suggest(key, valid_keys())}; "
                         "see `modbench train --help` or docs/config.md for valid keys")


def _merge_tree(obj: Any, tree: dict[str, Any], prefix: str) -> None:
    for k, v in tree.items():
        if not _is_key(obj, k):
            raise _unknown(prefix + str(k))
        cur = getattr(obj, k)
        if dataclasses.is_dataclass(cur):
            if not isinstance(v, dict):
                raise ModbenchError(f"config key '{prefix}{k}' is a section; give a mapping")
            _merge_tree(cur, v, prefix + k + ".")
        else:
            setattr(obj, k, _coerce(obj, k, v, prefix + k))


def apply_override(cfg: RunConfig, item: str) -> None:
    """Apply one ``key=value`` override; the value is parsed as YAML (``1e-3``, ``true``)."""
    if "=" not in item:
        raise ModbenchError(f"override {item!r} must look like key=value, e.g. recipe.lr=1e-3")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        is_last = i == len(parts) - 1
        if not _is_key(obj, part):
            raise _unknown(key)
        if is_last:
            if dataclasses.is_dataclass(getattr(obj, part)):
                raise ModbenchError(f"'{key}' is a section; set one of its keys, e.g. {key}.x=1")
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError as e:
                raise ModbenchError(f"the value of override {key} is not valid YAML "
                                    f"({e.__class__.__name__}): {raw!r}; quote it or fix "
                                    "it") from None
            setattr(obj, part, _coerce(obj, part, value, key))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ModbenchError(f"unknown config key {key!r}: '{part}' is not a section")


def _coerce(obj: Any, name: str, value: Any, key: str) -> Any:
    """Check (and gently convert) a value against the dataclass field's type."""
    hint = get_type_hints(type(obj))[name]
    text = str(hint)
    if value is None:
        if "None" in text or hint is Any:
            return None
        raise ModbenchError(f"config key '{key}' cannot be empty")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ModbenchError(f"config key '{key}' takes true or false, got {value!r}")
    if text.startswith("int | str") and isinstance(value, str):
        return value.strip()  # a word the key also takes (train.micro_batch_size: auto)
    if hint is int or text.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not value.is_integer()
        ):
            raise ModbenchError(f"config key '{key}' takes an integer, got {value!r}")
        return int(value)
    if hint is float or text.startswith("float"):
        try:
            if isinstance(value, bool):
                raise TypeError
            value = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ModbenchError(f"config key '{key}' takes a number, got {value!r}") from None
        if not math.isfinite(value):
            raise ModbenchError(f"config key '{key}' must be finite, got {value!r}")
        return value
    if hint is str or text.startswith("str"):
        if isinstance(value, list | dict):
            raise ModbenchError(f"config key '{key}' takes a single value, got {value!r}")
        return str(value)
    if text.startswith("tuple"):
        if not isinstance(value, list | tuple) or len(value) != 2 or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in value):
            raise ModbenchError(f"config key '{key}' takes a pair of numbers, e.g. [0.9, 0.95]")
        return (float(value[0]), float(value[1]))
    if text.startswith("dict"):
        if not isinstance(value, dict):
            raise ModbenchError(f"config key '{key}' takes a mapping")
        return dict(value)
    if text.startswith("list[str]"):  # a list, or one name / comma-separated names
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(
                isinstance(v, str) and v.strip() for v in items):
            raise ModbenchError(f"config key '{key}' takes a list of names, e.g. "
                                "[wandb, tensorboard]")
        return [v.strip() for v in items]
    return value


def dump_yaml(cfg: RunConfig) -> str:
    """:meth:`RunConfig.to_dict` as YAML (a run's ``config.yaml``)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def from_dict(tree: Any) -> RunConfig:
    """Read a config back from its serialised form (:meth:`RunConfig.to_dict`; a run's
    ``config.yaml`` without its ``meta``): the checks :func:`resolve` makes, no other: every
    key known and each value of its field's type (``_coerce``), then
    :meth:`RunConfig.validate`. Keys the tree lacks (added since it was written) take their
    defaults. Raises :class:`~modbench.errors.ModbenchError` in one line for a tree that is
    not a valid config."""
    if not isinstance(tree, dict):
        raise ModbenchError(f"a serialised run config must be a mapping of sections, got "
                            f"{type(tree).__name__}; it was not written by modbench")
    cfg = RunConfig()
    _merge_tree(cfg, tree, prefix="")
    cfg.validate()
    return cfg
