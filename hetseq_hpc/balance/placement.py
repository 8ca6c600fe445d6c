"""Where and how one rank runs, resolved from the run configuration and the rank's place.

One function, :func:`placement_for`, answers for a rank: its CPU threads, its emulated speed,
its memory budget, its partition and GPU class, and its requested precision. The worker calls
it with its :class:`~hetseq_hpc.env.world.WorldInfo`, the local launcher to set
``OMP_NUM_THREADS``, and the planner (through :func:`plan_placements`) for every rank of a world
that is not started. The formulas the three share live here too: the CPU
thread split (:func:`cpu_threads`), the calibration micro-batch
(:func:`calibration_micro_batch`), the memory budget (:func:`memory_budget_bytes`) and the
emulation quota (:func:`emulated_cpus`, from :mod:`hetseq_hpc.env.emulation`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, List, Optional

from hetseq_hpc.config.cluster import LocalClusterConfig, SlurmClusterConfig
from hetseq_hpc.env.emulation import emulated_cpus
from hetseq_hpc.env.hardware import usable_cores

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.config import PartitionConfig, RunConfig

log = logging.getLogger(__name__)

__all__ = [
    "CALIBRATION_MICRO_BATCH_MAX",
    "CALIBRATION_MICRO_BATCH_MAX_CUDA",
    "RankPlacement",
    "calibration_micro_batch",
    "cpu_threads",
    "emulated_cpus",
    "placement_for",
    "plan_placements",
]

#: largest default calibration micro-batch on a CPU (balance.calibration_micro_batch unset)
CALIBRATION_MICRO_BATCH_MAX = 16
#: the same on a GPU. At 16 samples a GPU is bound by kernel launches, not by the samples:
#: measured on an H100 (docs/benchmarks.md, 2026-11-27), BERT-base in bf16 timed
#: t(16) = 37 ms and t(4) = 32 ms against t(256) = 80 ms in training, so the curve through
#: 16 and 4 predicted 427 samples/s where the run trained at 3188. Calibrating near the
#: rank's real share measures the regime it will train in (lowered to the memory cap first).
CALIBRATION_MICRO_BATCH_MAX_CUDA = 256


@dataclass(frozen=True)
class RankPlacement:
    """How one rank runs.

    Attributes:
        rank: global rank.
        threads: torch CPU threads for this rank (>= 1).
        emulate_speed: emulated speed factor in (0, 1]; 1.0 = no emulation.
        memory_budget_gb: configured budget in GiB (the partition's, else the cluster's);
            None = the device's free memory.
        ranks_on_node: ranks sharing this rank's node (its RAM share on CPU).
        partition_key: key in ``cluster.partitions`` (None on ``cluster=local``).
        partition: Slurm partition name (None on ``cluster=local``).
        gres: GPU class = GRES type (``gpu_type``) of the partition, None for CPU nodes.
        precision: requested precision (auto, fp32, bf16 or fp16) from the ``precision`` group
            (:meth:`hetseq_hpc.config.rank_precision.PrecisionConfig.for_rank`); the
            device decides what ``auto`` becomes (:func:`hetseq_hpc.train.precision.resolve_precision`).
        het_group: het component index (None on ``cluster=local``).
    """

    rank: int
    threads: int
    emulate_speed: float
    memory_budget_gb: Optional[float]
    ranks_on_node: int
    partition_key: Optional[str]
    partition: Optional[str]
    gres: Optional[str]
    precision: str
    het_group: Optional[int]

    @property
    def emulated_cpus(self) -> float:
        """CPUs' worth of time this rank may use under emulation (``speed x threads``)."""
        return emulated_cpus(self.emulate_speed, self.threads)

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def cpu_threads(
    cores: int, ranks_on_node: int, configured: Optional[int] = None, warn: bool = True
) -> int:
    """Torch CPU threads of a rank: ``configured`` if set, else the node's ``cores`` split evenly
    between its ``ranks_on_node`` ranks, at least 1 (one rank takes every core: the local
    launcher only polls while the ranks train). More ranks than cores is logged as a
    warning when ``warn`` (the ranks then share cores and each runs slower)."""
    if configured:
        return int(configured)
    ranks = max(int(ranks_on_node), 1)
    if ranks > cores and warn:
        log.warning(
            "%d ranks on %d CPU core(s): one thread each, ranks share cores; lower "
            "cluster.ranks for full speed",
            ranks,
            cores,
        )
    return max(1, int(cores) // ranks)


def calibration_micro_batch(run: RunConfig, world_size: int, device_type: str = "cpu") -> int:
    """Micro-batch timed while calibrating: ``balance.calibration_micro_batch``, else the global
    batch (``trainer.global_batch_size``) / world size, capped at
    :data:`CALIBRATION_MICRO_BATCH_MAX` on a CPU and :data:`CALIBRATION_MICRO_BATCH_MAX_CUDA`
    on a GPU (``device_type="cuda"``), at least 1. Calibration lowers it further to the
    rank's memory cap."""
    if run.balance.calibration_micro_batch:
        return int(run.balance.calibration_micro_batch)
    share = run.trainer.global_batch_size // max(int(world_size), 1)
    most = (
        CALIBRATION_MICRO_BATCH_MAX_CUDA if device_type == "cuda" else CALIBRATION_MICRO_BATCH_MAX
    )
    return max(1, min(most, share))


def placement_for(
    run: RunConfig,
    rank: int,
    *,
    het_group: Optional[int] = None,
    local_world_size: Optional[int] = None,
    cpus_per_task: Optional[int] = None,
    cores: Optional[int] = None,
) -> RankPlacement:
    """Resolve rank ``rank``'s placement from ``run`` (nothing is started or probed).

    Args:
        run: the validated run configuration.
        rank: global rank.
        het_group: the rank's het component (``WorldInfo.het_group``); None = derived from the
            rank (srun numbers component 0's tasks first) on SLURM, none on ``cluster=local``.
        local_world_size: ranks on this rank's node; None = the planned world size locally,
            the partition's ranks per node on SLURM.
        cpus_per_task: cores the scheduler reserved for the rank (``SLURM_CPUS_PER_TASK``);
            None = the partition's ``cpus_per_rank`` on SLURM; ignored on ``cluster=local``.
        cores: CPUs this process may use; None = :func:`usable_cores`.

    Threads: locally ``cluster.threads_per_rank``, else the cores split between the ranks; on
    SLURM ``cpus_per_task``, else the partition's ``cpus_per_rank`` (:func:`cpu_threads`; the
    warning about more ranks than cores is logged for rank 0 only).
    Speed: ``cluster.speeds[rank]`` locally, the partition's ``emulate_speed`` on SLURM.
    Memory: the partition's ``memory_budget_gb``, else ``cluster.memory_budgets_gb[rank]``
    (cluster=local), else ``cluster.memory_budget_gb``.
    Precision: :meth:`hetseq_hpc.config.rank_precision.PrecisionConfig.for_rank` (``precision.ranks``,
    else ``precision.partitions``, else ``precision.default``).
    """
    cluster = run.cluster
    key = cluster.partition_for(rank, het_group)
    partitions = cluster.partitions if isinstance(cluster, SlurmClusterConfig) else {}
    part: Optional[PartitionConfig] = partitions[key] if key is not None else None
    if isinstance(cluster, LocalClusterConfig):
        world = cluster.planned_world_size()
        speeds = list(cluster.speeds)
        speed = float(speeds[rank]) if rank < len(speeds) else 1.0
        on_node = local_world_size or world
        configured = cluster.threads_per_rank
        group = None
    else:
        speed = float(part.emulate_speed) if part is not None else 1.0
        on_node = local_world_size or (part.ranks_per_node_effective if part is not None else 1)
        configured = cpus_per_task or (part.cpus_per_rank if part is not None else None)
        group = (
            het_group
            if het_group is not None
            else (list(partitions).index(key) if key is not None else None)
        )
    budget = part.memory_budget_gb if part is not None and part.memory_budget_gb else None
    budgets = list(getattr(cluster, "memory_budgets_gb", None) or [])  # cluster=local only
    budget = budget or (budgets[rank] if rank < len(budgets) else None) or cluster.memory_budget_gb
    return RankPlacement(
        rank=rank,
        threads=cpu_threads(
            usable_cores() if cores is None else cores, on_node, configured, warn=rank == 0
        ),
        emulate_speed=speed,
        memory_budget_gb=float(budget) if budget else None,
        ranks_on_node=int(on_node),
        partition_key=key,
        partition=part.partition if part is not None else None,
        gres=part.gpu_type if part is not None else None,
        precision=run.precision.for_rank(rank, key),
        het_group=group,
    )


def plan_placements(run: RunConfig, cores: Optional[int] = None) -> List[RankPlacement]:
    """Placement of every rank of the planned world, in rank order; nothing is started.

    ``cores`` (None = this machine's usable cores) only matters where threads are not set by
    the configuration (``cluster=local`` without ``threads_per_rank``).
    """
    return [
        placement_for(run, rank, cores=cores) for rank in range(run.cluster.planned_world_size())
    ]
