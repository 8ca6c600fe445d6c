"""The ``precision`` group: the ONE place a rank's compute precision comes from.

A rank trains in ``precision.ranks[rank]`` if that list is given, else in
``precision.partitions[<its partition>]`` if its partition is listed, else in
``precision.default`` (:meth:`PrecisionConfig.for_rank`). The device then decides what
``auto`` becomes (:func:`hetseq_hpc.train.precision.resolve_precision`). Read by
:func:`hetseq_hpc.balance.placement.placement_for` (the runtime) and the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hetseq_hpc.config.common import require

#: what every precision value accepts
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass
class PrecisionConfig:
    """Per-rank compute precision (autocast); parameters and optimizer state stay fp32."""

    # every rank not listed below: auto = bf16 autocast on compute capability >= 8.0, fp16 on
    # 7.x (Volta/Turing, with one job-wide loss scale), fp32 on older GPUs and CPU
    default: str = "auto"
    # per partition of a Slurm cluster, e.g. {v100: fp16}; a listed partition wins over default
    partitions: Dict[str, str] = field(default_factory=dict)
    # per rank, e.g. [bf16, fp16] (one entry per rank); wins over partitions and default
    ranks: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        choices = ", ".join(PRECISIONS)
        require(
            self.default in PRECISIONS,
            f"precision.default={self.default!r} is unknown: use {choices}",
        )
        for key, value in self.partitions.items():
            require(
                value in PRECISIONS,
                f"precision.partitions.{key}={value!r} is unknown: use {choices}",
            )
        for value in self.ranks:
            require(
                value in PRECISIONS,
                f"precision.ranks contains {value!r}: use {choices} per "
                "rank, e.g. precision.ranks=[bf16,fp16]",
            )

    def for_rank(self, rank: int, partition_key: Optional[str] = None) -> str:
        """The precision rank ``rank`` asks for (``auto``, ``fp32``, ``bf16`` or ``fp16``).

        Args:
            rank: global rank.
            partition_key: the rank's key in ``cluster.partitions``; None off Slurm.
        """
        if rank < len(self.ranks):
            return self.ranks[rank]
        if partition_key is not None and partition_key in self.partitions:
            return self.partitions[partition_key]
        return self.default

    def check_world(self, world_size: int, partition_keys: List[str]) -> None:
        """Check the per-rank list against the world size and the partition names against the
        cluster's.

        Raises:
            ConfigError: a list of the wrong length, or an unknown partition name.
        """
        require(
            not self.ranks or len(self.ranks) == world_size,
            f"precision.ranks={list(self.ranks)} has {len(self.ranks)} entries but the world "
            f"size is {world_size}: give one precision per rank",
        )
        unknown = sorted(set(self.partitions) - set(partition_keys))
        known = ", ".join(partition_keys) if partition_keys else "none (use precision.ranks)"
        require(
            not unknown,
            f"precision.partitions names {', '.join(unknown)}, not a partition "
            f"of this cluster: use one of {known}",
        )
