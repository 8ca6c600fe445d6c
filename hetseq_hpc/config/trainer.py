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

#: what trainer.compile accepts
COMPILE_MODES = ("off", "on", "auto")

#: optim=adamw's peak learning rate: hetseq_hpc's own models (task=bert, image, translation)
#: trained from scratch at their small default sizes
ADAMW_LR = 1e-3
#: optim=finetune's peak learning rate for pretrained weights (task=hf task.model.path): the
#: BERT paper's fine-tuning grid is {5e-5, 3e-5, 2e-5} (Devlin et al. 2019, appendix A.3), and
#: 5e-5 is transformers' Trainer default
FINETUNE_LR = 5e-5
#: optim=finetune's peak learning rate for a model trained from a random init (task=hf
#: task.model.config=...), a pre-training rate: GPT-3 used 6e-4 at 125M parameters down to
#: 1.2e-4 at 6.7B (Brown et al. 2020, table 2.1), LLaMA 3e-4 at 7B and 13B (Touvron et al.
#: 2023), BERT 1e-4 (Devlin et al. 2019), all AdamW with warm-up and decay; 3e-4 sits in the
#: middle (a fine-tuning rate barely moves a random init: 7.60 -> 7.55 in 30 GPT-2 steps)
RANDOM_INIT_LR = 3e-4


@dataclass
class ElasticConfig:
    """In-job recovery from a lost rank (:mod:`hetseq_hpc.train.recovery.elastic`): the survivors
    re-form the world and redo the interrupted step over themselves, same global batch."""

    # false = a lost rank ends the job (exit with its named error; a requeue resumes from the
    # last checkpoint). Takes effect for DDP runs (cluster=local: the launcher serves the job's
    # store; Slurm: the batch script does); FSDP runs keep the end-the-job behaviour (logged)
    enabled: bool = True
    # fewer survivors than this end the run as if recovery were off; at most the world size
    # (refused above it: hetseq_hpc/config/validate.py)
    min_ranks: int = 1
    # seconds a training-step collective may wait for a peer before that peer counts as stuck
    # (a killed peer is noticed at once); a rank without a heartbeat for half of it is lost
    timeout_s: float = 10.0
    # times each rank may be replaced by a new process that joins the running job at a step
    # boundary (DDP or FSDP; cluster=local: the launcher restarts a lost worker; Slurm: a new
    # step on the lost task's node, or on a spare node); 0 = the job shrinks
    restarts: int = 0
    # Slurm only: nodes reserved in EVERY het component beyond its `nodes`, kept idle for
    # replacements (trainer.elastic.restarts) of a rank whose node is down or drained
    spare_nodes: int = 0

    def __post_init__(self) -> None:
        require(
            self.min_ranks >= 1, f"trainer.elastic.min_ranks={self.min_ranks} is invalid: use >= 1"
        )
        require(
            self.timeout_s >= 2,
            f"trainer.elastic.timeout_s={self.timeout_s} is too short: use >= 2 (seconds)",
        )
        require(
            self.restarts >= 0,
            f"trainer.elastic.restarts={self.restarts} is invalid: use >= 0 (0: no replacement)",
        )
        require(
            self.spare_nodes >= 0,
            f"trainer.elastic.spare_nodes={self.spare_nodes} is invalid: use >= 0 (0: none)",
        )


@dataclass
class TrainerConfig:
    """The training loop: global batch, steps, seed, checkpoints, logging, safety switches.

    The split of the global batch is the ``balance`` group, gradient communication the ``comm``
    group and each rank's precision the ``precision`` group (:mod:`hetseq_hpc.config.schema`).
    """

    # samples per optimizer step over all ranks together (the global batch)
    global_batch_size: int = 32
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
    # rank 0 copies the state to CPU memory and writes, hashes and fsyncs it in a background
    # thread while training goes on (costs a CPU copy of the model and optimizer state,
    # pinned on CUDA); false = the training thread writes it
    checkpoint_async: bool = True
    # torch.compile each sharding unit (transformer block) in place: on, off, or auto = on for
    # a CUDA rank and off on a CPU (compiling takes tens of seconds there and gains nothing in
    # fp32); validation runs eager; docs/performance.md
    compile: str = "auto"
    # auto = continue from the latest checkpoint of the run dir; never; or a checkpoint path
    resume: str = "auto"
    # clip the global gradient norm to this value; 0 = no clipping
    grad_clip: float = 1.0
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
    # a lost rank does not end the run (DDP on cluster=local): see ElasticConfig
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def __post_init__(self) -> None:
        require_finite(self, "trainer")
        require(
            self.global_batch_size >= 1,
            f"trainer.global_batch_size={self.global_batch_size} is invalid: it must be >= 1",
        )
        require(
            0 <= self.seed <= MAX_SEED,
            f"trainer.seed={self.seed} is out of range: use an integer in 0..{MAX_SEED}",
        )
        require(self.max_steps >= 1, f"trainer.max_steps={self.max_steps} is invalid: use >= 1")
        require(
            self.log_every >= 1, f"trainer.log_every={self.log_every} is invalid: it must be >= 1"
        )
        for name in ("val_every", "checkpoint_every"):
            value = getattr(self, name)
            require(value >= 0, f"trainer.{name}={value} is invalid: it must be >= 0")
        require(
            self.keep_checkpoints >= 1,
            f"trainer.keep_checkpoints={self.keep_checkpoints} is invalid: keep at least 1",
        )
        require(
            bool(self.resume),
            "trainer.resume is empty: use auto, never, or the path of a checkpoint",
        )
        unknown = [n for n in self.loggers if n not in LOGGER_NAMES]
        require(
            not unknown,
            f"trainer.loggers={list(self.loggers)} has unknown {unknown}: use "
            f"any of {', '.join(LOGGER_NAMES)}, e.g. trainer.loggers=[jsonl,tensorboard]",
        )
        require(self.grad_clip >= 0, f"trainer.grad_clip={self.grad_clip} is invalid: use >= 0")
        require(
            str(self.compile) in COMPILE_MODES,
            f"trainer.compile={self.compile} is invalid: use on, off or auto",
        )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then linear or cosine decay (the schedules of transformers'
    ``get_scheduler``, reimplemented in :mod:`hetseq_hpc.train.optim`)."""

    name: str = "adamw"
    # peak learning rate; null (optim=finetune's default) = 5e-5 for pretrained weights, 3e-4
    # for a model trained from a random init (task=hf task.model.config=...)
    lr: Optional[float] = ADAMW_LR
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
        require(self.lr is None or self.lr > 0, f"optim.lr={self.lr} is invalid: it must be > 0")
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

    def default_lr(self, random_init: bool) -> float:
        """The peak learning rate where ``lr`` is null: :data:`RANDOM_INIT_LR` for a model
        trained from a random init, else :data:`FINETUNE_LR`."""
        return RANDOM_INIT_LR if random_init else FINETUNE_LR

    def describe(self, max_steps: int, random_init: bool) -> str:
        """One line for the start of a run: the peak learning rate and where it comes from,
        the warm-up and the decay, e.g. ``AdamW, learning rate 0.0003 (the default for a random
        init; optim.lr sets it), linear warm-up over 10 steps, then linear decay to 0 at step
        200 (trainer.max_steps)``. A rate equal to a default of its case (``random_init``:
        :data:`RANDOM_INIT_LR`, else :data:`FINETUNE_LR`; :data:`ADAMW_LR`) reads as that
        default, any other as set by ``optim.lr``; a null ``lr`` reads as its default."""
        lr = float(self.lr if self.lr is not None else self.default_lr(random_init))
        defaults = {ADAMW_LR: "optim=adamw's default"}
        if random_init:
            defaults[RANDOM_INIT_LR] = "the default for a random init"
        else:
            defaults[FINETUNE_LR] = "optim=finetune's default for pretrained weights"
        origin = defaults.get(lr)
        origin = f"{origin}; optim.lr sets it" if origin else "set by optim.lr"
        warmup = (
            f"linear warm-up over {self.warmup_steps} steps, then "
            if self.warmup_steps
            else "no warm-up, "
        )
        horizon = self.schedule_steps or max_steps
        where = "optim.schedule_steps" if self.schedule_steps else "trainer.max_steps"
        decay = (
            "constant"
            if self.schedule == "constant"
            else f"{self.schedule} decay to 0 at step {horizon} ({where})"
        )
        return f"AdamW, learning rate {lr:g} ({origin}), {warmup}{decay}"
