"""How many samples a rank's micro-batch may hold: the ONE memory formula the runtime
(calibration, allocation, re-balancing) and the planner share.

* :func:`memory_budget_bytes`: what a rank may use (``memory_budget_gb``, else free GPU memory,
  else its share of the node's RAM);
* :func:`memory_cap`: ``floor((budget x MEMORY_HEADROOM - STATIC_PARAM_COPIES x param bytes)
  / activation bytes per sample)``, via :func:`micro_batch_cap`;
* :func:`param_memory_cap`: the same from a parameter count (the planner, fp32 parameters);
* :func:`model_state_bytes`: what the model state takes on a rank, replicated (DDP) or
  sharded (FSDP2), and :func:`replica_fits` (``sharding.mode=auto``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.balance.placement import RankPlacement

#: weights + gradients + two AdamW moments + one DDP bucket copy, in parameter sizes
STATIC_PARAM_COPIES = 5
#: weights + gradients + two AdamW moments, each split over the world under FSDP
SHARDED_STATE_COPIES = 4
#: the unit FSDP is computing, gathered whole: its weights and its gradients
UNIT_COPIES = 2
#: validation and the task-contract check gather the whole weights once (no gradients)
GATHERED_WEIGHT_COPIES = 1
#: share of a rank's planned memory that ``sharding.mode=auto`` keeps free for activations
#: when it asks whether a full replica fits
AUTO_ACTIVATION_SHARE = 0.1
#: share of free GPU memory / of this rank's RAM share that the cap may plan to use
MEMORY_HEADROOM = 0.9
#: bytes of one fp32 parameter
PARAM_BYTES = 4


def memory_budget_bytes(placement: RankPlacement, device_kind: str, free_bytes: float,
                        local_world_size: int) -> float:
    """Bytes a rank may plan its micro-batch with (before the headroom of
    :func:`memory_cap`): the configured ``memory_budget_gb``; else the free
    GPU memory (``device_kind == "cuda"``); else its share ``free_bytes / local_world_size`` of
    the node's available RAM."""
    if placement.memory_budget_gb:
        return float(placement.memory_budget_gb) * 2**30
    if device_kind == "cuda":
        return float(free_bytes)
    return float(free_bytes) / max(int(local_world_size), 1)


def micro_batch_cap(
    memory_budget_bytes: float, static_bytes: float, bytes_per_sample: float,
    limit: Optional[int] = None,
) -> int:
    """Largest micro-batch that fits: ``floor((budget - static) / per_sample)``, at most ``limit``.

    Args:
        memory_budget_bytes: memory this rank may use (free GPU memory, or its RAM share).
        static_bytes: parameters, gradients, optimizer state and buffers.
        bytes_per_sample: activation memory of one sample (measured during calibration).
        limit: an extra cap (``balance.max_micro_batch``).

    Returns:
        The cap, or 0 if not even one sample fits (the caller reports it).
    """
    if bytes_per_sample <= 0:
        cap = 1 << 20
    else:
        cap = int((memory_budget_bytes - static_bytes) // bytes_per_sample)
    if limit is not None:
        cap = min(cap, int(limit))
    return max(cap, 0)


def model_state_bytes(param_bytes: float, mode: str = "ddp", world_size: int = 1,
                      largest_unit_bytes: float = 0.0, offload: bool = False,
                      gathered_weights: bool = True) -> float:
    """Bytes of model state one rank holds (before activations).

    ``ddp``: ``STATIC_PARAM_COPIES x param_bytes`` (weights, gradients, two AdamW moments, one
    DDP bucket copy). ``fsdp``: ``SHARDED_STATE_COPIES x param_bytes / world_size`` (this rank's
    shard of weights, gradients and moments; none on the device with ``offload``) plus
    ``UNIT_COPIES x largest_unit_bytes`` (the unit being computed, gathered whole, and its
    gradient before the reduce-scatter) or, when ``gathered_weights``, the larger of that and
    ``GATHERED_WEIGHT_COPIES x param_bytes``: validation gathers the whole weights on every rank
    when the task's ``evaluate_batch`` runs a data-dependent number of forward passes
    (:meth:`hetseq_hpc.tasks.base.Task.evaluates_in_fixed_passes` is False: decoding). The
    default (True) is the safe bound where the task is not known; the contract check runs on
    the CPU model before sharding and the examples on a CPU copy, so neither counts.
    """
    if mode != "fsdp":
        return float(param_bytes) * STATIC_PARAM_COPIES
    shard = 0.0 if offload else float(param_bytes) * SHARDED_STATE_COPIES / max(int(world_size), 1)
    whole = GATHERED_WEIGHT_COPIES * float(param_bytes) if gathered_weights else 0.0
    return shard + max(UNIT_COPIES * float(largest_unit_bytes), whole)


def memory_cap(memory_budget_bytes: float, param_bytes: float, activation_bytes_per_sample: float,
               limit: Optional[int] = None, static_bytes: Optional[float] = None) -> int:
    """Micro-batch cap of a device (the one formula the runtime and the planner share):
    :func:`micro_batch_cap` with budget ``memory x MEMORY_HEADROOM`` and static bytes
    ``static_bytes`` (default :func:`model_state_bytes` of a DDP replica). Bytes in, samples
    out; 0 if not one sample fits."""
    static = model_state_bytes(param_bytes) if static_bytes is None else float(static_bytes)
    return micro_batch_cap(float(memory_budget_bytes) * MEMORY_HEADROOM, static,
                           activation_bytes_per_sample, limit)


def local_part(tensor: Any) -> Any:
    """This rank's part of a tensor: the local shard of an FSDP (DTensor) parameter or gradient,
    else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def model_bytes(task: Any, model: Any) -> Tuple[float, float]:
    """``(parameter bytes of the model, parameter bytes of its largest FSDP unit)``: the units
    are ``task.sharding_units(model)``; the root unit (everything outside them) counts as one."""
    def size(params: Any) -> float:
        return float(sum(p.numel() * p.element_size() for p in params))

    units = list(task.sharding_units(model)) if hasattr(task, "sharding_units") else []
    in_units = {id(p) for u in units for p in u.parameters()}
    root = size(p for p in model.parameters() if id(p) not in in_units)
    return size(model.parameters()), max([root] + [size(u.parameters()) for u in units])


def replica_fits(memory_budget_bytes: float, param_bytes: float) -> bool:
    """Whether a full DDP replica fits a rank with :data:`AUTO_ACTIVATION_SHARE` of its planned
    memory left for activations (``sharding.mode=auto`` picks DDP when it does on every rank)."""
    room = float(memory_budget_bytes) * MEMORY_HEADROOM * (1.0 - AUTO_ACTIVATION_SHARE)
    return model_state_bytes(param_bytes) <= room


def param_memory_cap(memory_bytes: float, param_count: int, activation_bytes_per_sample: float,
               limit: Optional[int] = None) -> int:
    """Micro-batch cap of a device with ``memory_bytes`` and ``param_count`` fp32 parameters:
    the runtime's own formula, :func:`memory_cap`."""
    return memory_cap(memory_bytes, PARAM_BYTES * param_count,
                              activation_bytes_per_sample, limit)


__all__ = [
    "AUTO_ACTIVATION_SHARE",
    "GATHERED_WEIGHT_COPIES",
    "MEMORY_HEADROOM",
    "PARAM_BYTES",
    "SHARDED_STATE_COPIES",
    "STATIC_PARAM_COPIES",
    "UNIT_COPIES",
    "local_part",
    "memory_budget_bytes",
    "memory_cap",
    "micro_batch_cap",
    "model_bytes",
    "model_state_bytes",
    "param_memory_cap",
    "replica_fits",
]
