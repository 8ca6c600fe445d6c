"""How many samples a rank's micro-batch may hold: the ONE memory formula the runtime
(calibration, allocation, re-balancing) and the planner share.

* :func:`memory_budget_bytes`: what a rank may use (``memory_budget_gb``, else free GPU memory,
  else its share of the node's RAM);
* :func:`memory_cap`: ``floor((budget x MEMORY_HEADROOM - STATIC_PARAM_COPIES x param bytes)
  / activation bytes per sample)``, via :func:`micro_batch_cap`;
* :func:`param_memory_cap`: the same from a parameter count (the planner, fp32 parameters);
* :func:`model_state_bytes`: what the model state takes on a rank, replicated (DDP) or
  sharded (FSDP2: the shard plus FSDP2's gathered units at their peak, or, with
  ``keep_gathered``, the whole weights kept between micro-batches: :func:`kept_gathered_bytes`),
  and :func:`replica_fits` (``sharding.mode=auto``);
* :func:`model_bytes`: the parameter bytes of a model, of its FSDP root unit and of its
  largest block (the task's sharding units), as :func:`model_state_bytes` takes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, NamedTuple, Optional

if TYPE_CHECKING:  # pragma: no cover (torch is not imported by the planner's path)
    import torch
    from torch import nn

    from hetseq_hpc.balance.placement import RankPlacement
    from hetseq_hpc.tasks.base import Task

#: weights + gradients + two AdamW moments + one DDP bucket copy, in parameter sizes
STATIC_PARAM_COPIES = 5
#: weights + gradients + two AdamW moments, each split over the world under FSDP
SHARDED_STATE_COPIES = 4
#: FSDP2 keeps the ROOT unit (everything outside the task's sharding units: embeddings, head)
#: gathered from its forward to the end of the backward pass (the root is not resharded after
#: forward, :class:`hetseq_hpc.train.parallel.Sharded`), and its gradient is reduce-scattered
#: only at the end of the backward pass: its weights and its gradient, whole
ROOT_COPIES = 2
#: a BLOCK (a sharding unit) in the backward pass: its gathered weights, its whole gradient
#: before the reduce-scatter, and the next block's weights, prefetched
BLOCK_COPIES = 3
#: the most FSDP ever gathers at once in training: every weight and every gradient, whole
MAX_GATHERED_COPIES = 2
#: validation and the task-contract check gather the whole weights once (no gradients)
GATHERED_WEIGHT_COPIES = 1
#: parameters kept gathered between the micro-batches of a step
#: (``sharding.between_micro_batches``): next to every weight, whole, the gradients FSDP2 holds
#: whole before their reduce-scatter: the root unit's (to the end of the backward pass) and a
#: block's, with the previous block's reduce-scatter still in flight
KEPT_BLOCK_GRADIENT_COPIES = 2
#: share of a rank's planned memory that ``sharding.mode=auto`` keeps free for activations
#: when it asks whether a full replica fits
AUTO_ACTIVATION_SHARE = 0.1
#: share of free GPU memory / of this rank's RAM share that the cap may plan to use
MEMORY_HEADROOM = 0.9
#: bytes of one fp32 parameter
PARAM_BYTES = 4


def memory_budget_bytes(
    placement: RankPlacement, device_kind: str, free_bytes: float, local_world_size: int
) -> float:
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
    memory_budget_bytes: float,
    static_bytes: float,
    bytes_per_sample: float,
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


def model_state_bytes(
    param_bytes: float,
    mode: str = "ddp",
    world_size: int = 1,
    block_bytes: float = 0.0,
    offload: bool = False,
    gathered_weights: bool = True,
    root_bytes: Optional[float] = None,
    keep_gathered: bool = False,
) -> float:
    """Bytes of model state one rank holds at its peak (before activations): the ONE formula
    the runtime (worker, calibration), the planner and the pre-flight check share.

    ``ddp``: ``STATIC_PARAM_COPIES x param_bytes`` (weights, gradients, two AdamW moments, one
    DDP bucket copy).

    ``fsdp``: ``SHARDED_STATE_COPIES x param_bytes / world_size`` (this rank's shard of
    weights, gradients and moments; none on the device with ``offload``) plus what FSDP2 holds
    gathered at the peak of a training step, :func:`gathered_bytes`:
    ``ROOT_COPIES x root_bytes + BLOCK_COPIES x block_bytes`` (the root unit's weights and
    gradient, whole through forward and backward; the block being computed, its gradient, and
    the next block prefetched), at most ``MAX_GATHERED_COPIES x param_bytes``; or, when
    ``gathered_weights``, the larger of that and ``GATHERED_WEIGHT_COPIES x param_bytes``:
    validation gathers the whole weights on every rank when the task's ``evaluate_batch`` runs
    a data-dependent number of forward passes
    (:meth:`hetseq_hpc.tasks.base.Task.evaluates_in_fixed_passes` is False: decoding). The
    contract check runs on the CPU model before sharding and the examples on a CPU copy, so
    neither counts. With ``keep_gathered`` (the parameters stay gathered between the
    micro-batches of a step) the gathered part is :func:`kept_gathered_bytes` instead.

    Args:
        param_bytes: the model's parameter bytes.
        mode: ``ddp`` or ``fsdp``.
        world_size: ranks the model is sharded over.
        block_bytes: parameter bytes of the largest sharding unit (0: none).
        offload: ``sharding.cpu_offload`` on GPUs (the shards live in CPU memory).
        gathered_weights: validation gathers the whole weights (the safe default where the
            task is not known).
        root_bytes: parameter bytes of the root unit; None = not known: everything outside
            the largest block (an upper bound).
        keep_gathered: the whole weights stay gathered through a step's micro-batches.
    """
    if mode != "fsdp":
        return float(param_bytes) * STATIC_PARAM_COPIES
    shard = 0.0 if offload else float(param_bytes) * SHARDED_STATE_COPIES / max(int(world_size), 1)
    whole = GATHERED_WEIGHT_COPIES * float(param_bytes) if gathered_weights else 0.0
    held = (kept_gathered_bytes if keep_gathered else gathered_bytes)(
        param_bytes, block_bytes, root_bytes
    )
    return shard + max(held, whole)


def gathered_bytes(
    param_bytes: float, block_bytes: float = 0.0, root_bytes: Optional[float] = None
) -> float:
    """What FSDP2 holds unsharded at the peak of a training step (see
    :func:`model_state_bytes`): ``ROOT_COPIES x root + BLOCK_COPIES x block``, at most
    ``MAX_GATHERED_COPIES x param_bytes``. ``root_bytes`` None: ``param_bytes - block_bytes``."""
    param, block = float(param_bytes), float(block_bytes)
    root = max(param - block, 0.0) if root_bytes is None else float(root_bytes)
    return min(ROOT_COPIES * root + BLOCK_COPIES * block, MAX_GATHERED_COPIES * param)


def kept_gathered_bytes(
    param_bytes: float, block_bytes: float = 0.0, root_bytes: Optional[float] = None
) -> float:
    """What FSDP2 holds unsharded when the parameters stay gathered between the micro-batches
    of a step: ``GATHERED_WEIGHT_COPIES x param_bytes`` (every weight) plus the gradients
    before their reduce-scatter, ``root + KEPT_BLOCK_GRADIENT_COPIES x block``; at most
    ``MAX_GATHERED_COPIES x param_bytes``. Bytes in and out; ``root_bytes`` None:
    ``param_bytes - block_bytes``."""
    param, block = float(param_bytes), float(block_bytes)
    root = max(param - block, 0.0) if root_bytes is None else float(root_bytes)
    return min(
        GATHERED_WEIGHT_COPIES * param + root + KEPT_BLOCK_GRADIENT_COPIES * block,
        MAX_GATHERED_COPIES * param,
    )


def memory_cap(
    memory_budget_bytes: float,
    param_bytes: float,
    activation_bytes_per_sample: float,
    limit: Optional[int] = None,
    static_bytes: Optional[float] = None,
) -> int:
    """Micro-batch cap of a device (the one formula the runtime and the planner share):
    :func:`micro_batch_cap` with budget ``memory x MEMORY_HEADROOM`` and static bytes
    ``static_bytes`` (default :func:`model_state_bytes` of a DDP replica). Bytes in, samples
    out; 0 if not one sample fits."""
    static = model_state_bytes(param_bytes) if static_bytes is None else float(static_bytes)
    return micro_batch_cap(
        float(memory_budget_bytes) * MEMORY_HEADROOM, static, activation_bytes_per_sample, limit
    )


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of an FSDP (DTensor) parameter or gradient,
    else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class ModelBytes(NamedTuple):
    """Parameter bytes of a model as FSDP2 shards it (:func:`model_bytes`)."""

    total: float  # every parameter
    root: float  # the root unit: the parameters outside every sharding unit
    block: float  # the largest sharding unit (0 when the task names none)

    def grouped(self) -> ModelBytes:
        """The same model with its units sharded as ONE group (``sharding.units=one``, or
        ``auto`` where a replica fits): the block is every parameter outside the root."""
        return self._replace(block=self.total - self.root)


def model_bytes(task: Task, model: nn.Module) -> ModelBytes:
    """:class:`ModelBytes` of ``model``: the units are ``task.sharding_units(model)``, the
    root unit everything outside them (the whole model when there are none)."""
    units = list(task.sharding_units(model)) if hasattr(task, "sharding_units") else []
    return unit_bytes(model, units)


def unit_bytes(model: nn.Module, units: Iterable[nn.Module]) -> ModelBytes:
    """:class:`ModelBytes` of ``model`` sharded into ``units`` (modules inside it) plus the
    root unit (everything outside them); read before sharding (a DTensor counts whole too)."""

    def size(params: Iterable[torch.Tensor]) -> float:
        return float(sum(p.numel() * p.element_size() for p in params))

    modules = list(units)
    in_units = {id(p) for u in modules for p in u.parameters()}
    root = size(p for p in model.parameters() if id(p) not in in_units)
    return ModelBytes(
        size(model.parameters()), root, max([0.0] + [size(u.parameters()) for u in modules])
    )


def replica_fits(memory_budget_bytes: float, param_bytes: float) -> bool:
    """Whether a full DDP replica fits a rank with :data:`AUTO_ACTIVATION_SHARE` of its planned
    memory left for activations (``sharding.mode=auto`` picks DDP when it does on every rank)."""
    room = float(memory_budget_bytes) * MEMORY_HEADROOM * (1.0 - AUTO_ACTIVATION_SHARE)
    return model_state_bytes(param_bytes) <= room


def units_grouped(setting: str, replica_fits_every_rank: bool) -> bool:
    """Whether FSDP shards a task's units (two or more) as ONE group, from ``sharding.units``:
    ``one`` yes, ``per_unit`` no, ``auto`` where a full replica fits every rank
    (:func:`replica_fits`): the rule the ranks agree on
    (:func:`hetseq_hpc.balance.agree.agree_on_units`) and the planner predicts."""
    return setting == "one" or (setting == "auto" and replica_fits_every_rank)


def param_memory_cap(
    memory_bytes: float,
    param_count: int,
    activation_bytes_per_sample: float,
    limit: Optional[int] = None,
) -> int:
    """Micro-batch cap of a device with ``memory_bytes`` and ``param_count`` fp32 parameters:
    the runtime's own formula, :func:`memory_cap`."""
    return memory_cap(memory_bytes, PARAM_BYTES * param_count, activation_bytes_per_sample, limit)


__all__ = [
    "AUTO_ACTIVATION_SHARE",
    "BLOCK_COPIES",
    "GATHERED_WEIGHT_COPIES",
    "KEPT_BLOCK_GRADIENT_COPIES",
    "MAX_GATHERED_COPIES",
    "MEMORY_HEADROOM",
    "PARAM_BYTES",
    "ROOT_COPIES",
    "SHARDED_STATE_COPIES",
    "STATIC_PARAM_COPIES",
    "ModelBytes",
    "gathered_bytes",
    "kept_gathered_bytes",
    "local_part",
    "memory_budget_bytes",
    "memory_cap",
    "micro_batch_cap",
    "model_bytes",
    "model_state_bytes",
    "param_memory_cap",
    "replica_fits",
    "unit_bytes",
    "units_grouped",
]
