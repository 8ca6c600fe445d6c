"""How many samples a rank's micro-batch may hold: the ONE memory formula the runtime
(calibration, allocation, re-balancing) and the planner share.

* :func:`memory_budget_bytes`: what a rank may use (``memory_budget_gb``, else free GPU memory,
  else its share of the node's RAM);
* :func:`memory_cap`: ``floor((budget x MEMORY_HEADROOM - STATIC_PARAM_COPIES x param bytes)
  / activation bytes per sample)``, via :func:`micro_batch_cap`;
* :func:`param_memory_cap`: the same from a parameter count (the planner, fp32 parameters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.balance.placement import RankPlacement

#: weights + gradients + two AdamW moments + one DDP bucket copy, in parameter sizes
STATIC_PARAM_COPIES = 5
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


def memory_cap(memory_budget_bytes: float, param_bytes: float, activation_bytes_per_sample: float,
               limit: Optional[int] = None) -> int:
    """Micro-batch cap of a device (the one formula the runtime and the planner share):
    :func:`micro_batch_cap` with budget ``memory x MEMORY_HEADROOM`` and
    static ``STATIC_PARAM_COPIES x param_bytes`` (weights, gradients, two AdamW moments, one DDP
    bucket copy). Bytes in, samples out; 0 if not one sample fits."""
    return micro_batch_cap(float(memory_budget_bytes) * MEMORY_HEADROOM,
                           float(param_bytes) * STATIC_PARAM_COPIES,
                           activation_bytes_per_sample, limit)


def param_memory_cap(memory_bytes: float, param_count: int, activation_bytes_per_sample: float,
               limit: Optional[int] = None) -> int:
    """Micro-batch cap of a device with ``memory_bytes`` and ``param_count`` fp32 parameters:
    the runtime's own formula, :func:`memory_cap`."""
    return memory_cap(memory_bytes, PARAM_BYTES * param_count,
                              activation_bytes_per_sample, limit)


__all__ = ["MEMORY_HEADROOM", "PARAM_BYTES", "STATIC_PARAM_COPIES", "memory_budget_bytes",
           "memory_cap", "micro_batch_cap", "param_memory_cap"]
