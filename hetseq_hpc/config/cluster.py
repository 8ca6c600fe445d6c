"""Cluster schemas: where the ranks run (``cluster=local`` or a SLURM cluster file).

:class:`ClusterConfig` holds what every cluster has (its kind, the collective timeout, a memory
budget) and what every caller asks of one (``is_local``, ``planned_world_size()``);
:class:`LocalClusterConfig` and :class:`SlurmClusterConfig` extend it. ``RunConfig.cluster`` is
typed with the base, so code outside ``hetseq_hpc.config`` asks the cluster, never its name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from omegaconf import MISSING

from hetseq_hpc.config.common import check_sbatch_value, require, require_finite

#: ``cluster.choose``: none = submit the configured mix; finish_first = the mix Slurm's start
#: estimate plus the predicted run time finishes first; cheapest = the fewest GPU-hours
CHOOSE = ("none", "finish_first", "cheapest")
#: the longest wall-clock limit accepted (365 days in minutes); Slurm's INFINITE is not a number
MAX_TIMEOUT_MIN = 525_600
#: ``cluster.devices`` entries: a rank on a GPU (the next one not taken by a lower rank) or
#: on the CPU
DEVICE_KINDS = ("cuda", "cpu")


def _gpu_driver_present() -> bool:
    """Whether a GPU driver is there at all (NVML initialises, or an AMD ``/dev/kfd``): where
    none is, there is no GPU to count and torch need not be imported (about a second of CPU
    in every command that starts a local run)."""
    if os.path.exists("/dev/kfd"):
        return True
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


#: the values of ``cluster.rank_start`` (:class:`LocalClusterConfig`)
RANK_STARTS = ("auto", "fork", "exec")


def visible_gpu_count() -> int:
    """GPUs this process could use (``torch.cuda.device_count()``; 0 without CUDA, or without
    any GPU driver: then without importing torch)."""
    if not _gpu_driver_present():
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - broken CUDA install
        return 0


def _check_common(cfg: ClusterConfig) -> None:
    require_finite(cfg, "cluster")
    require(
        cfg.collective_timeout_s >= 10,
        f"cluster.collective_timeout_s={cfg.collective_timeout_s} is too short: use >= 10",
    )
    if cfg.memory_budget_gb is not None:
        require(
            cfg.memory_budget_gb > 0,
            f"cluster.memory_budget_gb={cfg.memory_budget_gb} is invalid: it must be > 0 (GiB)",
        )
    for i, word in enumerate(cfg.command):
        require(
            isinstance(word, str) and word != "" and not any(ord(c) < 32 for c in word),
            f"cluster.command[{i}]={word!r} is invalid: give the per-rank command as a list of "
            "non-empty words without control characters, e.g. 'cluster.command=[python,train.py]'",
        )


@dataclass
class ClusterConfig:
    """What every cluster has. Not used alone: ``name`` selects a subclass (``local``/``slurm``)."""

    # the cluster kind: local or slurm (selects the schema)
    name: str = MISSING
    # seconds a collective may wait for a peer before the run fails (a dead rank is reported)
    collective_timeout_s: int = 300
    # per-rank memory budget in GiB for the micro-batch cap; null = RAM (CPU) or free GPU memory
    memory_budget_gb: Optional[float] = None
    # every rank runs this command instead of hetseq_hpc's worker, e.g. [python, train.py]: a
    # Lightning / Fabric / accelerate script using hetseq_hpc.integrations (docs/integrations.md);
    # the launch, the checks and the sbatch script stay the same; empty = the worker
    command: List[str] = field(default_factory=list)

    @property
    def is_local(self) -> bool:
        """True when the ranks are processes on this machine (no scheduler)."""
        return False

    def planned_world_size(self) -> int:
        """Ranks the launch will create.

        Raises:
            NotImplementedError: on the base class (use a subclass).
        """
        raise NotImplementedError("ClusterConfig is abstract: use cluster=local or a slurm file")

    @property
    def max_requeues(self) -> int:
        """Times a preempted or timed-out job may be requeued (0: no scheduler requeues it)."""
        return 0

    def partition_for(self, rank: int, het_group: Optional[int] = None) -> Optional[str]:
        """Key of the partition that holds ``rank`` (None: this cluster has no partitions)."""
        return None

    def check_world(self, world_size: int) -> None:
        """Check per-rank settings against the planned world size (nothing to check here).

        Raises:
            ConfigError: in subclasses, a per-rank list of the wrong length.
        """

    def device_kinds(self) -> Optional[List[str]]:
        """Every rank's device kind (``cuda`` or ``cpu``) in rank order when the config names
        them, else None: each rank takes its own (a GPU where CUDA is)."""
        return None


@dataclass
class LocalClusterConfig(ClusterConfig):
    """``cluster=local``: worker processes on this machine, no scheduler."""

    name: str = "local"
    # worker processes (ranks); null = one per visible GPU, else 2
    ranks: Optional[int] = None
    # CPU threads per rank; null = the cores this process may use (its affinity, lowered to a
    # cgroup CPU quota) split evenly between the ranks: one rank gets all of them
    threads_per_rank: Optional[int] = None
    # rendezvous port on 127.0.0.1; null = a free port picked at launch
    master_port: Optional[int] = None
    # per-rank emulated speed factors, e.g. [1.0, 0.35]; empty = full speed everywhere
    speeds: List[float] = field(default_factory=list)
    # per-rank memory budgets in GiB, e.g. [0.5, 4.0] (a small and a large GPU emulated on
    # CPU); empty = cluster.memory_budget_gb for every rank
    memory_budgets_gb: List[float] = field(default_factory=list)
    # per-rank devices, e.g. [cuda, cpu] (one rank on the GPU, one on the CPU: gloo for all);
    # null = every rank on a GPU where CUDA is, else on the CPU
    devices: Optional[List[str]] = None
    # how the ranks' processes start: fork = from one template process that imported torch
    # once (~5 CPU-s less per rank; CPU ranks only), exec = a fresh python each, auto = fork
    # when every rank is on the CPU, else exec (docs/design/rank-template.md)
    rank_start: str = "auto"

    def __post_init__(self) -> None:
        _check_common(self)
        require(
            self.rank_start in RANK_STARTS,
            f"cluster.rank_start={self.rank_start!r} is unknown: use one of "
            f"{', '.join(RANK_STARTS)} (auto: fork when every rank is on the CPU)",
        )
        for i, kind in enumerate(self.devices or []):
            require(
                kind in DEVICE_KINDS,
                f"cluster.devices[{i}]={kind!r} is unknown: give cuda or cpu per rank, "
                "e.g. cluster.devices=[cuda,cpu]",
            )
        require(
            self.devices is None or len(self.devices) >= 1,
            "cluster.devices=[] is empty: give one device per rank (cuda or cpu), or "
            "cluster.devices=null for a GPU per rank where CUDA is",
        )
        if self.ranks is not None:
            require(
                self.ranks >= 1,
                f"cluster.ranks={self.ranks} is invalid: it must be >= 1; "
                "set cluster.ranks=2, or leave it unset for one rank per GPU",
            )
        if self.threads_per_rank is not None:
            require(
                self.threads_per_rank >= 1,
                f"cluster.threads_per_rank={self.threads_per_rank} is invalid: it must be >= 1",
            )
        if self.master_port is not None:
            require(
                1024 <= self.master_port <= 65535,
                f"cluster.master_port={self.master_port} is invalid: use a port in 1024..65535",
            )
        for speed in self.speeds:
            require(
                0.0 < speed <= 1.0,
                f"cluster.speeds contains {speed}: each speed must be in (0, 1]",
            )
        for budget in self.memory_budgets_gb:
            require(
                budget > 0,
                f"cluster.memory_budgets_gb contains {budget}: each budget must be > 0 (GiB)",
            )
        require(
            not (self.memory_budgets_gb and self.memory_budget_gb is not None),
            f"cluster.memory_budgets_gb={list(self.memory_budgets_gb)} and "
            f"cluster.memory_budget_gb={self.memory_budget_gb} are both set: keep one (the list "
            "gives each rank its own budget)",
        )

    @property
    def is_local(self) -> bool:
        """Always True: ranks are processes on this machine."""
        return True

    def planned_world_size(self) -> int:
        """``cluster.ranks``, else one rank per ``cluster.devices`` entry, else one rank per
        visible GPU, else 2."""
        if self.ranks is not None:
            return self.ranks
        if self.devices:
            return len(self.devices)
        gpus = visible_gpu_count()
        return gpus if gpus > 0 else 2

    def check_world(self, world_size: int) -> None:
        """``cluster.speeds``, ``cluster.memory_budgets_gb`` and ``cluster.devices`` have one
        entry per rank (or none).

        Raises:
            ConfigError: the lengths differ.
        """
        devices = list(self.devices or [])
        require(
            not devices or len(devices) == world_size,
            f"cluster.devices=[{','.join(devices)}] has {len(devices)} entries but cluster.ranks "
            f"is {world_size}: give one device (cuda or cpu) per rank, or drop cluster.ranks",
        )
        require(
            not self.speeds or len(self.speeds) == world_size,
            f"cluster.speeds={list(self.speeds)} has {len(self.speeds)} entries but cluster.ranks "
            f"is {world_size}: give one speed per rank",
        )
        budgets = list(self.memory_budgets_gb)
        require(
            not budgets or len(budgets) == world_size,
            f"cluster.memory_budgets_gb={budgets} has {len(budgets)} entries but cluster.ranks "
            f"is {world_size}: give one budget (GiB) per rank",
        )

    def device_kinds(self) -> Optional[List[str]]:
        """``cluster.devices`` (one ``cuda`` or ``cpu`` per rank), or None when unset."""
        return list(self.devices) if self.devices else None


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
    # null = cluster.memory_budget_gb, else the device's free memory
    memory_budget_gb: Optional[float] = None
    # the planner's link between two ranks of one node in Gbit/s (PCIe, NVLink); null = the
    # GPU class's spec row (hetseq-hpc plan), e.g. 128 for PCIe 3.0 x16 behind one switch
    intra_node_gbps: Optional[float] = None
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
            ConfigError: the key or a value is unsafe for sbatch, a count is < 1, or a number is
                out of range or not finite.
        """
        check_sbatch_value("cluster.partitions key", key)
        where = f"cluster.partitions.{key}"
        require_finite(self, where)
        require(
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
            require(value >= 1, f"{where}.{name}={value} is invalid: it must be >= 1")
        require(self.mem_gb > 0, f"{where}.mem_gb={self.mem_gb} is invalid: it must be > 0")
        require(
            0.0 < self.emulate_speed <= 1.0,
            f"{where}.emulate_speed={self.emulate_speed} is invalid: it must be in (0, 1]",
        )
        require(
            self.intra_node_gbps is None or self.intra_node_gbps > 0,
            f"{where}.intra_node_gbps={self.intra_node_gbps} is invalid: give the link "
            "between two GPUs of a node in Gbit/s (> 0), or null for the GPU's spec",
        )
        if self.memory_budget_gb is not None:
            require(
                self.memory_budget_gb > 0,
                f"{where}.memory_budget_gb={self.memory_budget_gb} is invalid: it must be > 0",
            )
        for opt, value in self.extra_sbatch.items():
            check_sbatch_value(f"{where}.extra_sbatch key", opt)
            check_sbatch_value(f"{where}.extra_sbatch.{opt}", value)


@dataclass
class SlurmClusterConfig(ClusterConfig):
    """A SLURM cluster: one het component per entry of ``partitions``, one srun step over all."""

    name: str = "slurm"
    # seconds a collective may wait for a peer before the run fails
    collective_timeout_s: int = 600
    # het components in order; component 0 holds rank 0 (the rendezvous master)
    partitions: Dict[str, PartitionConfig] = field(default_factory=dict)
    # job name shown by squeue
    job_name: str = "hetseq"
    # wall-clock limit of the job in minutes (at most 525600 = 365 days)
    timeout_min: int = 60
    # seconds before the time limit at which Slurm signals the job (checkpoint, then requeue)
    signal_delay_s: int = 90
    # requeues after preemption or time-out before the job is left to end (0 = never requeue)
    max_num_timeout: int = 3
    # where submitit keeps its scripts, pickles and logs; null = <run dir>/submitit
    folder: Optional[str] = None
    # wait for the job and stream rank 0's progress (false = submit, print the id, return)
    wait: bool = False
    # seconds sbatch may take to answer the submission; then it is killed, any job it had
    # submitted is cancelled (squeue finds it) and one line says so (hetseq_hpc/launch/submit.py)
    submit_timeout_s: float = 120.0
    # write the sbatch text to <run dir>/job.sbatch and submit nothing
    dry_run: bool = False
    # extra environment for every rank, e.g. {NCCL_ALGO: Ring}
    env: Dict[str, str] = field(default_factory=dict)
    # commands run before the step in the sbatch script (module load ..., source venv)
    setup: List[str] = field(default_factory=list)
    # none = submit the partitions as configured; finish_first / cheapest = plan the candidate
    # mixes of them (hetseq-hpc plan --when) and submit the one that finishes first / costs the
    # fewest GPU-hours
    choose: str = "none"

    def __post_init__(self) -> None:
        _check_common(self)
        require(
            len(self.partitions) >= 1,
            "cluster.partitions is empty: describe at least one partition "
            "(see conf/cluster/mixed.yaml), or use cluster=local",
        )
        for key, part in self.partitions.items():
            part.validate(key)
        check_sbatch_value("cluster.job_name", self.job_name)
        require(
            1 <= self.timeout_min <= MAX_TIMEOUT_MIN,
            f"cluster.timeout_min={self.timeout_min} is invalid: use 1..{MAX_TIMEOUT_MIN} "
            "minutes (365 days), e.g. cluster.timeout_min=720",
        )
        require(
            self.signal_delay_s >= 0,
            f"cluster.signal_delay_s={self.signal_delay_s} is invalid: it must be >= 0",
        )
        require(
            self.max_num_timeout >= 0,
            f"cluster.max_num_timeout={self.max_num_timeout} is invalid: use >= 0 "
            "(0 = never requeue)",
        )
        require(
            self.submit_timeout_s > 0,
            f"cluster.submit_timeout_s={self.submit_timeout_s} is invalid: give the seconds "
            "sbatch may take to answer (> 0), e.g. cluster.submit_timeout_s=120",
        )
        require(
            self.choose in CHOOSE,
            f"cluster.choose={self.choose!r} is unknown: use none, finish_first or cheapest",
        )

    @property
    def world_size(self) -> int:
        """Total ranks over all partitions."""
        return sum(p.num_ranks for p in self.partitions.values())

    def planned_world_size(self) -> int:
        """Total ranks over all partitions (same as :attr:`world_size`)."""
        return self.world_size

    @property
    def max_requeues(self) -> int:
        """``cluster.max_num_timeout``."""
        return self.max_num_timeout

    def partition_for(self, rank: int, het_group: Optional[int] = None) -> Optional[str]:
        """Key of the partition of ``rank``: het component ``het_group`` is the ``het_group``-th
        partition; without one, the only partition, else the one srun's rank order gives
        (:meth:`partition_of_rank`). None if out of range."""
        keys = list(self.partitions)
        if het_group is not None:
            return keys[het_group] if 0 <= het_group < len(keys) else None
        if len(keys) == 1:
            return keys[0]
        return self.partition_of_rank(rank)

    def partition_of_rank(self, rank: int) -> Optional[str]:
        """Key of the partition (het component) that holds global rank ``rank``: srun numbers
        the tasks of component 0 first, then component 1, ... None if ``rank`` is outside."""
        start = 0
        for key, part in self.partitions.items():
            if start <= rank < start + part.num_ranks:
                return key
            start += part.num_ranks
        return None
