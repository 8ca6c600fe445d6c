"""Trainer and optimizer schemas (``trainer=``, ``optim=`` groups)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hetseq_hpc.config.common import require, require_finite

#: what trainer.loggers accepts (jsonl, metrics.jsonl, is always written)
LOGGER_NAMES = ("jsonl", "csv", "tensorboard", "wandb")
#: largest trainer.seed: numpy's legacy seeding and most tools take 32-bit seeds (Lightning's
#: seed_everything allows the same range)
MAX_SEED = 2**32 - 1
#: re-balancing interval (steps) when trainer.rebalance_every is null and the split is measured
AUTO_REBALANCE_EVERY = 10


@dataclass
class TrainerConfig:
    """The training loop: global batch, its split, steps, checkpoints, logging."""

    # samples per optimizer step over all ranks together (the global batch)
    global_batch_size: int = 32
    # forced per-rank sample counts, e.g. [24, 8]; null = proportional to measured throughput
    allocation: Optional[List[int]] = None
    # largest micro-batch any rank may use (memory caps may lower it); null = no extra cap
    max_micro_batch: Optional[int] = None
    # optimizer steps to train for
    max_steps: int = 1000
    # seed of model init, data order, masking and dropout, in [0, 2**32 - 1]
    seed: int = 0
    # write a metrics.jsonl row every N steps
    log_every: int = 1
    # validate every N steps (and at the end); 0 = only at the end
    val_every: int = 100
    # checkpoint every N steps (and at the end); 0 = only at the end
    checkpoint_every: int = 100
    # checkpoints kept in <run dir>/checkpoints
    keep_checkpoints: int = 2
    # auto = continue from the latest checkpoint of the run dir; never; or a checkpoint path
    resume: str = "auto"
    # clip the global gradient norm to this value; 0 = no clipping
    grad_clip: float = 1.0
    # timed forward+backward passes per rank (after 1 warm-up pass), alternating the
    # calibration micro-batch and a quarter of it; the fastest of each size fits the cost curve
    # (a rank done before the slowest one times more of them while it waits, at most 16)
    calibration_steps: int = 4
    # micro-batch used while calibrating; null = global batch / world size (at most 16)
    calibration_micro_batch: Optional[int] = None
    # auto = bf16 autocast on compute capability >= 8.0, fp16 on 7.x (Volta/Turing, with one
    # job-wide loss scale), fp32 on older GPUs and CPU; or fp32 / bf16 / fp16 for every rank
    precision: str = "auto"
    # gradient all-reduce payload: none (fp32), bf16 or fp16 (cast per bucket, still a SUM)
    grad_compression: str = "none"
    # DDP gradient bucket size in MiB; null = DDP's default (25)
    bucket_cap_mb: Optional[float] = None
    # sum = exact global-batch gradient; adasum = Adasum of each rank's own mean gradient
    # (Maleki et al. 2020; NOT the exact global-batch update; power-of-two world sizes only)
    grad_combine: str = "sum"
    # every N steps ranks refit their cost curves from measured step times and may re-balance;
    # 0 = never; null = every 10 steps when the split is measured, never with trainer.allocation
    rebalance_every: Optional[int] = None
    # straggle (max - min) / mean of per-rank compute time that triggers a re-balance
    rebalance_threshold: float = 0.1
    # write <run dir>/ranks.png at the end (loss and validation, throughput, each rank's share
    # and step time, re-allocations marked) and log where; a failure to draw only warns
    plot: bool = True
    # resume even when the checkpoint was written by a run whose configuration differs in
    # what matters (seed, task, model shape, global batch); false = refuse and list the differences
    allow_resume_mismatch: bool = False
    # continuing a run directory whose saved config names a user's task module (task.target /
    # task.path) imports that code only when the command line names it again or this is true
    trust_saved_task: bool = False
    # train a model with BatchNorm although uneven per-rank batches then are NOT exact (recorded
    # in the log and summary.json); false = refuse it before training
    allow_inexact_batchnorm: bool = False
    # skip the check of the task contract on the first batch (SUM loss, additive count,
    # row-wise make_batch; docs/tasks.md) for a task whose samples interact in a batch; the run
    # is then recorded as NOT exact in the log and summary.json
    skip_contract_check: bool = False
    # where rank 0 logs every step besides metrics.jsonl (always on): csv, tensorboard, wandb
    loggers: List[str] = field(default_factory=lambda: ["jsonl"])

    def __post_init__(self) -> None:
        require_finite(self, "trainer")
        require(
            self.global_batch_size >= 1,
            f"trainer.global_batch_size={self.global_batch_size} is invalid: it must be >= 1",
        )
        if self.allocation is not None:
            require(
                len(self.allocation) >= 1 and all(int(b) >= 1 for b in self.allocation),
                f"trainer.allocation={list(self.allocation)} is invalid: give every rank at least "
                "one sample, e.g. trainer.allocation=[24,8]",
            )
            require(
                sum(self.allocation) == self.global_batch_size,
                f"trainer.allocation={list(self.allocation)} sums to {sum(self.allocation)}, not "
                f"trainer.global_batch_size={self.global_batch_size}: make the counts add up to "
                "the global batch",
            )
        if self.max_micro_batch is not None:
            require(
                self.max_micro_batch >= 1,
                f"trainer.max_micro_batch={self.max_micro_batch} is invalid: it must be >= 1",
            )
        require(
            0 <= self.seed <= MAX_SEED,
            f"trainer.seed={self.seed} is out of range: use an integer in 0..{MAX_SEED}",
        )
        if self.calibration_micro_batch is not None:
            require(
                self.calibration_micro_batch >= 1,
                f"trainer.calibration_micro_batch={self.calibration_micro_batch} is invalid: use "
                ">= 1, or null for global batch / world size (at most 16)",
            )
        require(self.max_steps >= 1, f"trainer.max_steps={self.max_steps} is invalid: use >= 1")
        for name in ("log_every",):
            value = getattr(self, name)
            require(value >= 1, f"trainer.{name}={value} is invalid: it must be >= 1")
        for name in ("val_every", "checkpoint_every", "rebalance_every"):
            value = getattr(self, name)
            require(value is None or value >= 0,
                    f"trainer.{name}={value} is invalid: it must be >= 0")
        require(
            self.keep_checkpoints >= 1,
            f"trainer.keep_checkpoints={self.keep_checkpoints} is invalid: keep at least 1",
        )
        require(
            bool(self.resume),
            "trainer.resume is empty: use auto, never, or the path of a checkpoint",
        )
        unknown = [n for n in self.loggers if n not in LOGGER_NAMES]
        require(not unknown, f"trainer.loggers={list(self.loggers)} has unknown {unknown}: use "
                f"any of {', '.join(LOGGER_NAMES)}, e.g. trainer.loggers=[jsonl,tensorboard]")
        require(self.grad_clip >= 0, f"trainer.grad_clip={self.grad_clip} is invalid: use >= 0")
        require(
            self.calibration_steps >= 1,
            f"trainer.calibration_steps={self.calibration_steps} is invalid: use >= 1",
        )
        require(
            self.precision in ("auto", "fp32", "bf16", "fp16"),
            f"trainer.precision={self.precision!r} is unknown: use auto, fp32, bf16 or fp16",
        )
        require(
            self.grad_compression in ("none", "bf16", "fp16"),
            f"trainer.grad_compression={self.grad_compression!r} is unknown: use none, bf16 or fp16",
        )
        if self.bucket_cap_mb is not None:
            require(self.bucket_cap_mb > 0, f"trainer.bucket_cap_mb={self.bucket_cap_mb} is "
                    "invalid: use a size > 0 in MiB, or null for DDP's default 25")
        require(
            self.grad_combine in ("sum", "adasum"),
            f"trainer.grad_combine={self.grad_combine!r} is unknown: use sum or adasum",
        )
        require(
            self.rebalance_threshold > 0,
            f"trainer.rebalance_threshold={self.rebalance_threshold} is invalid: it must be > 0",
        )

    @property
    def rebalance_interval(self) -> int:
        """Steps between re-balancing decisions (0 = never): ``rebalance_every`` when given,
        else :data:`AUTO_REBALANCE_EVERY` for a measured split and 0 for a forced
        ``trainer.allocation`` (the user's split is kept)."""
        if self.rebalance_every is not None:
            return int(self.rebalance_every)
        return 0 if self.allocation is not None else AUTO_REBALANCE_EVERY


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then linear or cosine decay (the schedules of transformers'
    ``get_scheduler``, reimplemented in :mod:`hetseq_hpc.train.optim`)."""

    name: str = "adamw"
    # peak learning rate
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-8
    # steps of linear warm-up from 0 to lr
    warmup_steps: int = 20
    # linear | cosine | constant (constant after warm-up)
    schedule: str = "linear"
    # horizon of the decay in steps; null = trainer.max_steps
    schedule_steps: Optional[int] = None

    def __post_init__(self) -> None:
        require_finite(self, "optim")
        require(self.name == "adamw", f"optim.name={self.name!r} is unknown: use adamw")
        require(self.lr > 0, f"optim.lr={self.lr} is invalid: it must be > 0")
        require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} is invalid")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={list(self.betas)} is invalid: give two values in [0, 1)",
        )
        require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} is invalid")
        require(
            self.schedule in ("linear", "cosine", "constant"),
            f"optim.schedule={self.schedule!r} is unknown: use linear, cosine or constant",
        )
        if self.schedule_steps is not None:
            require(
                self.schedule_steps >= 1,
                f"optim.schedule_steps={self.schedule_steps} is invalid: use >= 1 or null",
            )
