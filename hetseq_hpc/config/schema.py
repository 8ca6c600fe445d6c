"""Schema dataclasses of the run configuration, registered in Hydra's ConfigStore.

The YAML files under ``conf/`` only select a schema and override its defaults (Hydra's
structured-config pattern, https://hydra.cc/docs/tutorials/structured_config/schema/).
Each dataclass checks its own fields in ``__post_init__``, which runs when the composed
``DictConfig`` is turned into objects with :func:`hetseq_hpc.config.to_run_config`;
checks that span groups (an allocation against the world size) live in
:mod:`hetseq_hpc.config.validate`.

Units are in the field names: ``*_s`` seconds, ``*_min`` minutes, ``*_gb`` GiB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from hetseq_hpc.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# --------------------------------------------------------------------------- task: bert
@dataclass
class BertModelConfig:
    """Size of the ``BertForMaskedLM`` built from scratch (nothing is downloaded)."""

    # width of every token representation
    hidden_size: int = 128
    # transformer layers
    num_layers: int = 2
    # attention heads per layer (must divide hidden_size)
    num_heads: int = 2
    # width of the feed-forward block
    intermediate_size: int = 512
    # dropout on hidden states and attention probabilities; 0.0 makes runs bit-comparable
    dropout: float = 0.1
    # tokens per packed training sequence, [CLS] and [SEP] included
    max_seq_len: int = 128

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            value = getattr(self, name)
            _require(value >= 1, f"task.model.{name}={value} is invalid: it must be >= 1")
        _require(
            self.hidden_size % self.num_heads == 0,
            f"task.model.num_heads={self.num_heads} does not divide task.model.hidden_size="
            f"{self.hidden_size}: choose heads that divide the hidden size",
        )
        _require(
            0.0 <= self.dropout < 1.0,
            f"task.model.dropout={self.dropout} is invalid: it must be in [0, 1)",
        )
        _require(
            self.max_seq_len >= 8,
            f"task.model.max_seq_len={self.max_seq_len} is too short: use at least 8 tokens",
        )


@dataclass
class BertDataConfig:
    """Where the text comes from and how it is tokenised and masked."""

    # text files or globs; empty = the embedded corpus (CPython's pydoc_data.topics)
    files: List[str] = field(default_factory=list)
    # WordPiece vocabulary size asked of the tokenizer trainer (small corpora stop earlier)
    vocab_size: int = 8192
    # share of packed sequences held out for validation
    val_fraction: float = 0.05
    # share of tokens selected for masked-language modelling (BERT: 0.15)
    mask_prob: float = 0.15
    # where tokenizers and packed token ids are cached; null = ~/.cache/hetseq_hpc
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _require(
            self.vocab_size >= 200,
            f"task.data.vocab_size={self.vocab_size} is too small: use at least 200",
        )
        _require(
            0.0 < self.val_fraction < 0.5,
            f"task.data.val_fraction={self.val_fraction} is invalid: it must be in (0, 0.5)",
        )
        _require(
            0.0 < self.mask_prob < 1.0,
            f"task.data.mask_prob={self.mask_prob} is invalid: it must be in (0, 1)",
        )


@dataclass
class BertTaskConfig:
    """Masked-language modelling with BERT (Devlin et al., 2019) on packed text."""

    name: str = "bert"
    model: BertModelConfig = field(default_factory=BertModelConfig)
    data: BertDataConfig = field(default_factory=BertDataConfig)


# --------------------------------------------------------------------------- clusters
@dataclass
class LocalClusterConfig:
    """``cluster=local``: worker processes on this machine, no scheduler."""

    name: str = "local"
    # worker processes (ranks); null = one per visible GPU, else 2
    ranks: Optional[int] = None
    # CPU threads per rank; null = this machine's cores split evenly between the ranks
    threads_per_rank: Optional[int] = None
    # rendezvous port on 127.0.0.1; null = a free port picked at launch
    master_port: Optional[int] = None
    # seconds a collective may wait for a peer before the run fails (a dead rank is reported)
    collective_timeout_s: int = 300
    # per-rank emulated speed factors, e.g. [1.0, 0.35]; empty = full speed everywhere
    speeds: List[float] = field(default_factory=list)
    # per-rank memory budget in GiB for the micro-batch cap; null = RAM (CPU) or free GPU memory
    memory_budget_gb: Optional[float] = None

    def __post_init__(self) -> None:
        if self.ranks is not None:
            _require(
                self.ranks >= 1,
                f"cluster.ranks={self.ranks} is invalid: it must be >= 1; "
                "set cluster.ranks=2, or leave it unset for one rank per GPU",
            )
        if self.threads_per_rank is not None:
            _require(
                self.threads_per_rank >= 1,
                f"cluster.threads_per_rank={self.threads_per_rank} is invalid: it must be >= 1",
            )
        if self.master_port is not None:
            _require(
                1024 <= self.master_port <= 65535,
                f"cluster.master_port={self.master_port} is invalid: use a port in 1024..65535",
            )
        _require(
            self.collective_timeout_s >= 10,
            f"cluster.collective_timeout_s={self.collective_timeout_s} is too short: use >= 10",
        )
        for speed in self.speeds:
            _require(
                0.0 < speed <= 1.0,
                f"cluster.speeds contains {speed}: each speed must be in (0, 1]",
            )
        if self.memory_budget_gb is not None:
            _require(
                self.memory_budget_gb > 0,
                f"cluster.memory_budget_gb={self.memory_budget_gb} is invalid: it must be > 0",
            )


# Values that end up in an sbatch script: no whitespace, quotes, `;`, `$`, backticks, newlines.
_SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.:,+=/@%-]+$")


def check_sbatch_value(where: str, value: str) -> None:
    """Reject a value that could break out of an ``#SBATCH`` line.

    Raises:
        ConfigError: ``value`` holds a character outside ``[A-Za-z0-9_.:,+=/@%-]``
            (a newline, ``;``, ``$(``, a space, a quote ...).
    """
    _require(
        bool(_SBATCH_SAFE.match(str(value))),
        f"{where}={value!r} is not allowed in an sbatch script: use only letters, digits "
        "and _.:,+=/@%-",
    )


@dataclass
class PartitionConfig:
    """One partition of a heterogeneous SLURM job (one het component)."""

    # Slurm partition name (sbatch --partition)
    partition: str = MISSING
    # GPU class = the GRES type (gpu:<gpu_type>:N); null = CPU-only nodes
    gpu_type: Optional[str] = None
    # nodes of this partition in the job
    nodes: int = 1
    # GPUs per node; one rank is started per GPU
    gpus_per_node: int = 1
    # ranks per node on CPU-only nodes (gpu_type null); ignored when GPUs are requested
    ranks_per_node: int = 1
    # CPU cores per rank (sbatch --cpus-per-task)
    cpus_per_rank: int = 4
    # memory per node in GiB (sbatch --mem)
    mem_gb: float = 32
    # optional sbatch --account / --qos / --constraint
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # emulated speed factor (0, 1] for test clusters without a real mix (cgroup CPU quota)
    emulate_speed: float = 1.0
    # memory budget per rank in GiB for the micro-batch cap (emulates a small-memory GPU);
    # null = the device's free memory
    memory_budget_gb: Optional[float] = None
    # more sbatch options for this component, e.g. {exclude: "n7"}
    extra_sbatch: Dict[str, str] = field(default_factory=dict)

    @property
    def ranks_per_node_effective(self) -> int:
        """Ranks started on each node: one per GPU, or ``ranks_per_node`` on CPU-only nodes."""
        return self.gpus_per_node if self.gpu_type else self.ranks_per_node

    @property
    def num_ranks(self) -> int:
        """Ranks this partition contributes to the world size."""
        return self.nodes * self.ranks_per_node_effective

    def validate(self, key: str) -> None:
        """Check the fields; ``key`` is the partition's name in ``cluster.partitions``.

        Raises:
            ConfigError: a count is < 1, a value is unsafe for sbatch, or a speed is out of range.
        """
        where = f"cluster.partitions.{key}"
        _require(
            self.partition not in (None, "", MISSING),
            f"{where}.partition is missing: name the Slurm partition (sinfo -s lists them)",
        )
        check_sbatch_value(f"{where}.partition", self.partition)
        for name in ("gpu_type", "account", "qos", "constraint"):
            value = getattr(self, name)
            if value is not None:
                check_sbatch_value(f"{where}.{name}", value)
        for name in ("nodes", "gpus_per_node", "ranks_per_node", "cpus_per_rank"):
            value = getattr(self, name)
            _require(value >= 1, f"{where}.{name}={value} is invalid: it must be >= 1")
        _require(self.mem_gb > 0, f"{where}.mem_gb={self.mem_gb} is invalid: it must be > 0")
        _require(
            0.0 < self.emulate_speed <= 1.0,
            f"{where}.emulate_speed={self.emulate_speed} is invalid: it must be in (0, 1]",
        )
        if self.memory_budget_gb is not None:
            _require(
                self.memory_budget_gb > 0,
                f"{where}.memory_budget_gb={self.memory_budget_gb} is invalid: it must be > 0",
            )
        for opt, value in self.extra_sbatch.items():
            check_sbatch_value(f"{where}.extra_sbatch key", opt)
            check_sbatch_value(f"{where}.extra_sbatch.{opt}", value)


@dataclass
class SlurmClusterConfig:
    """A SLURM cluster: one het component per entry of ``partitions``, one srun step over all."""

    name: str = "slurm"
    # het components in order; component 0 holds rank 0 (the rendezvous master)
    partitions: Dict[str, PartitionConfig] = field(default_factory=dict)
    # job name shown by squeue
    job_name: str = "hetseq"
    # wall-clock limit of the job in minutes
    timeout_min: int = 60
    # seconds before the time limit at which Slurm signals the job (checkpoint, then requeue)
    signal_delay_s: int = 90
    # requeues after preemption or time-out before the job is left to end
    max_num_timeout: int = 3
    # where submitit keeps its scripts, pickles and logs; null = <run dir>/submitit
    folder: Optional[str] = None
    # wait for the job and stream rank 0's progress (false = submit, print the id, return)
    wait: bool = False
    # write the sbatch text to <run dir>/job.sbatch and submit nothing
    dry_run: bool = False
    # seconds a collective may wait for a peer before the run fails
    collective_timeout_s: int = 600
    # extra environment for every rank, e.g. {NCCL_ALGO: Ring}
    env: Dict[str, str] = field(default_factory=dict)
    # commands run before the step in the sbatch script (module load ..., source venv)
    setup: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(
            len(self.partitions) >= 1,
            "cluster.partitions is empty: describe at least one partition "
            "(see conf/cluster/mixed.yaml), or use cluster=local",
        )
        for key, part in self.partitions.items():
            part.validate(key)
        check_sbatch_value("cluster.job_name", self.job_name)
        _require(
            self.timeout_min >= 1,
            f"cluster.timeout_min={self.timeout_min} is invalid: it must be >= 1",
        )
        _require(
            self.signal_delay_s >= 0,
            f"cluster.signal_delay_s={self.signal_delay_s} is invalid: it must be >= 0",
        )
        _require(
            self.collective_timeout_s >= 10,
            f"cluster.collective_timeout_s={self.collective_timeout_s} is too short: use >= 10",
        )

    @property
    def world_size(self) -> int:
        """Total ranks over all partitions."""
        return sum(p.num_ranks for p in self.partitions.values())


# --------------------------------------------------------------------------- trainer / optim
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
    # seed of model init, data order, masking and dropout
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
    # timed forward+backward passes per rank to measure throughput (after 1 warm-up pass)
    calibration_steps: int = 3
    # micro-batch used while calibrating; null = global batch / world size (at most 16)
    calibration_micro_batch: Optional[int] = None
    # auto = bf16 autocast on GPUs with compute capability >= 8.0, else fp32; or fp32 / bf16
    precision: str = "auto"
    # every N steps ranks compare measured step times and may re-balance; 0 = never
    rebalance_every: int = 0
    # straggle (max - min) / mean of per-rank compute time that triggers a re-balance
    rebalance_threshold: float = 0.1
    # write a PNG of per-rank step times at the end
    plot: bool = False

    def __post_init__(self) -> None:
        _require(
            self.global_batch_size >= 1,
            f"trainer.global_batch_size={self.global_batch_size} is invalid: it must be >= 1",
        )
        if self.allocation is not None:
            _require(
                len(self.allocation) >= 1 and all(int(b) >= 1 for b in self.allocation),
                f"trainer.allocation={list(self.allocation)} is invalid: give every rank at least "
                "one sample, e.g. trainer.allocation=[24,8]",
            )
            _require(
                sum(self.allocation) == self.global_batch_size,
                f"trainer.allocation={list(self.allocation)} sums to {sum(self.allocation)}, not "
                f"trainer.global_batch_size={self.global_batch_size}: make the counts add up to "
                "the global batch",
            )
        if self.max_micro_batch is not None:
            _require(
                self.max_micro_batch >= 1,
                f"trainer.max_micro_batch={self.max_micro_batch} is invalid: it must be >= 1",
            )
        _require(self.max_steps >= 1, f"trainer.max_steps={self.max_steps} is invalid: use >= 1")
        for name in ("log_every",):
            value = getattr(self, name)
            _require(value >= 1, f"trainer.{name}={value} is invalid: it must be >= 1")
        for name in ("val_every", "checkpoint_every", "rebalance_every"):
            value = getattr(self, name)
            _require(value >= 0, f"trainer.{name}={value} is invalid: it must be >= 0")
        _require(
            self.keep_checkpoints >= 1,
            f"trainer.keep_checkpoints={self.keep_checkpoints} is invalid: keep at least 1",
        )
        _require(
            bool(self.resume),
            "trainer.resume is empty: use auto, never, or the path of a checkpoint",
        )
        _require(self.grad_clip >= 0, f"trainer.grad_clip={self.grad_clip} is invalid: use >= 0")
        _require(
            self.calibration_steps >= 1,
            f"trainer.calibration_steps={self.calibration_steps} is invalid: use >= 1",
        )
        _require(
            self.precision in ("auto", "fp32", "bf16"),
            f"trainer.precision={self.precision!r} is unknown: use auto, fp32 or bf16",
        )
        _require(
            self.rebalance_threshold > 0,
            f"trainer.rebalance_threshold={self.rebalance_threshold} is invalid: it must be > 0",
        )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then linear or cosine decay (transformers' schedulers)."""

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
        _require(self.name == "adamw", f"optim.name={self.name!r} is unknown: use adamw")
        _require(self.lr > 0, f"optim.lr={self.lr} is invalid: it must be > 0")
        _require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} is invalid")
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={list(self.betas)} is invalid: give two values in [0, 1)",
        )
        _require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} is invalid")
        _require(
            self.schedule in ("linear", "cosine", "constant"),
            f"optim.schedule={self.schedule!r} is unknown: use linear, cosine or constant",
        )
        if self.schedule_steps is not None:
            _require(
                self.schedule_steps >= 1,
                f"optim.schedule_steps={self.schedule_steps} is invalid: use >= 1 or null",
            )


@dataclass
class RunConfig:
    """The whole run: ``task``, ``cluster``, ``trainer`` and ``optim`` groups."""

    task: Any = MISSING
    cluster: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


#: task name -> schema; the ``name`` field of a task config selects its schema.
TASK_SCHEMAS: Dict[str, type] = {"bert": BertTaskConfig}
#: cluster name -> schema, chosen by the ``name`` field (``slurm`` for every SLURM cluster file).
CLUSTER_SCHEMAS: Dict[str, type] = {"local": LocalClusterConfig, "slurm": SlurmClusterConfig}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent).

    ``conf/config.yaml`` starts from ``run_schema``; ``conf/task/*.yaml`` and
    ``conf/cluster/*.yaml`` start from ``<name>_schema`` in their group.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="task", name=f"{name}_schema", node=schema)
    for name, schema in CLUSTER_SCHEMAS.items():
        cs.store(group="cluster", name=f"{name}_schema", node=schema)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="optim", name="adamw_schema", node=OptimConfig)
