"""The ``sharding`` group: whether every rank holds the whole model (DDP) or a shard (FSDP2).

Read by :mod:`hetseq_hpc.train.parallel` (the strategies), :mod:`hetseq_hpc.balance.memory` (what
a rank's memory must hold in each mode) and the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetseq_hpc.config.common import require

#: what sharding.mode accepts
SHARDING_MODES = ("none", "fsdp", "auto")
#: what sharding.checkpoint accepts
CHECKPOINT_LAYOUTS = ("sharded", "full")
#: what sharding.between_micro_batches accepts
BETWEEN_MICRO_BATCHES = ("auto", "keep_unsharded", "reshard")
#: what sharding.units accepts
UNIT_GROUPINGS = ("auto", "per_unit", "one")


@dataclass
class ShardingConfig:
    """Replicated (DDP) or sharded (FSDP2) data parallelism, and the memory savers of small GPUs."""

    # none = DDP, a full replica (weights, gradients, AdamW state) on every rank; fsdp = PyTorch
    # FSDP2 (fully_shard): each rank holds 1/world of them and gathers one unit at a time;
    # auto = DDP when the full replica fits every rank's memory budget (faster), else fsdp
    mode: str = "none"
    # recompute each sharding unit's activations in the backward pass (torch.utils.checkpoint):
    # less activation memory per sample, about one more forward pass of compute
    activation_checkpointing: bool = False
    # keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
    # CPUOffloadPolicy); for GPUs too small for even their shard; ignored on CPU ranks
    cpu_offload: bool = False
    # how an FSDP run writes checkpoints: sharded = every rank its own shard, in parallel, with
    # torch.distributed.checkpoint (no rank holds the whole state; resumes on any world size and
    # under DDP); full = gathered to rank 0 into one file, as DDP writes (needs the whole model
    # and optimizer state in rank 0's CPU memory)
    checkpoint: str = "sharded"
    # FSDP within a step: keep_unsharded = the parameters stay gathered from the step's first
    # forward to its last backward (each unit is all-gathered once per step instead of twice
    # per micro-batch, a step of one micro-batch too; the rank holds the whole weights
    # meanwhile); reshard = gathered again in every forward and backward (least memory);
    # auto = keep_unsharded when the whole weights fit beside every rank's shard and
    # micro-batch in its memory budget (hetseq_hpc/train/fsdp_accumulation.py), else reshard
    between_micro_batches: str = "auto"
    # how FSDP groups the task's sharding units (its transformer layers): per_unit = each one
    # gathered and reduce-scattered on its own (a layer at a time: the memory FSDP is for);
    # one = all of them in one group (one all-gather and one reduce-scatter per pass for the
    # layers: far less per-unit host work, the whole weights and their gradients held at once);
    # auto = one when a full replica would fit every rank's memory budget (FSDP then holds no
    # more than DDP would), else per_unit (hetseq_hpc/balance/agree.py, agree_on_units)
    units: str = "auto"

    def __post_init__(self) -> None:
        require(
            self.mode in SHARDING_MODES,
            f"sharding.mode={self.mode!r} is unknown: use "
            f"{', '.join(SHARDING_MODES)} (e.g. sharding.mode=fsdp)",
        )
        require(
            self.checkpoint in CHECKPOINT_LAYOUTS,
            f"sharding.checkpoint={self.checkpoint!r}"
            f" is unknown: use {' or '.join(CHECKPOINT_LAYOUTS)} (e.g. "
            "sharding.checkpoint=sharded)",
        )
        require(
            self.between_micro_batches in BETWEEN_MICRO_BATCHES,
            f"sharding.between_micro_batches={self.between_micro_batches!r} is unknown: use "
            f"{', '.join(BETWEEN_MICRO_BATCHES)} (e.g. sharding.between_micro_batches=auto)",
        )
        require(
            self.units in UNIT_GROUPINGS,
            f"sharding.units={self.units!r} is unknown: use "
            f"{', '.join(UNIT_GROUPINGS)} (e.g. sharding.units=auto)",
        )
