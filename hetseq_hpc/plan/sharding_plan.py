"""The planner's view of ``sharding.mode``: for the configured mix, the model state each rank
holds under DDP and under FSDP2, whether it fits, the predicted step of each, and the largest
model (parameters) that fits the mix in each mode.

Memory per rank is the runtime's own formula (:func:`hetseq_hpc.balance.memory.model_state_bytes`
plus one sample's activations, within ``budget x MEMORY_HEADROOM``). The FSDP step is the DDP
step plus its extra traffic, counted in ring all-reduces (an all-gather or a reduce-scatter
moves half of one): with ``K`` passes per step, resharded between them
(``sharding.between_micro_batches=reshard``) FSDP all-gathers the parameters in every forward
and every backward and reduce-scatters the gradients in every pass, ``3K / 2``; kept gathered
(``keep_unsharded``, :mod:`hetseq_hpc.train.fsdp_accumulation`) it all-gathers once per step,
``(K + 1) / 2`` (one pass: 1), but holds the whole weights
(:func:`~hetseq_hpc.balance.memory.kept_gathered_bytes`): the plan shows that as a third row
(``fsdp-kept``). DDP moves one
all-reduce; the extra is counted as exposed (an upper bound: FSDP2 prefetches the next unit's
all-gather during compute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from hetseq_hpc.balance.memory import (
    MEMORY_HEADROOM,
    PARAM_BYTES,
    model_state_bytes,
    replica_fits,
    units_grouped,
)


@dataclass
class ModeFit:
    """One data-parallel mode on the planned mix.

    Attributes:
        mode: ``ddp``, ``fsdp`` (resharded between passes) or ``fsdp-kept`` (kept gathered).
        state_bytes: model state on one rank (bytes; the same on every rank).
        fits: every rank holds it and at least one sample's activations.
        step_s: predicted step time, seconds.
        largest_params: the largest parameter count whose state and one sample's activations
            (as measured for this model) fit every rank of the mix, at this model's shape
            (its largest unit's share of the parameters).
    """

    mode: str
    state_bytes: float
    fits: bool
    step_s: float
    largest_params: int

    def to_dict(self) -> Dict[str, Any]:
        return {
            "mode": self.mode,
            "state_bytes": round(self.state_bytes),
            "fits": self.fits,
            "step_time_s": round(self.step_s, 6),
            "largest_params": self.largest_params,
        }


def fsdp_traffic_factor(passes: int, keep_gathered: bool = False) -> float:
    """FSDP's bytes per step over a ring all-reduce's for ``K`` passes: ``3K / 2`` resharded
    between passes, ``(K + 1) / 2`` with the parameters kept gathered from the step's first
    forward to its last backward (one pass: 1, an all-gather and a reduce-scatter)."""
    k = max(int(passes), 1)
    return (k + 1) / 2.0 if keep_gathered else 1.5 * k


def mode_fits(
    memory_bytes: Sequence[float],
    param_count: int,
    unit_params: int,
    activation_bytes_per_sample: float,
    ddp_step_s: float,
    allreduce_s: float,
    passes: int,
    offload: bool = False,
    gathered_weights: bool = True,
    root_params: Optional[int] = None,
    scaled_unit_params: Optional[int] = None,
) -> List[ModeFit]:
    """:class:`ModeFit` of DDP and of FSDP (and of FSDP with the parameters kept gathered
    from the step's first forward to its last backward: ``fsdp-kept``) on ranks with ``memory_bytes``
    budgets.

    Args:
        memory_bytes: each rank's memory budget (before the headroom), bytes.
        param_count: the model's parameters; unit_params: those of its largest FSDP block
            (a sharding unit; 0: none).
        activation_bytes_per_sample: one sample's activations, bytes.
        ddp_step_s: the predicted DDP step; allreduce_s: its full ring all-reduce, seconds.
        passes: forward/backward passes per step (the largest accumulation count).
        offload: ``sharding.cpu_offload`` (the shards live in CPU memory).
        gathered_weights: validation gathers the whole weights (a task that decodes); False:
            it runs on the shards (:func:`hetseq_hpc.balance.memory.model_state_bytes`).
        root_params: those of its FSDP root unit (outside every block); None = not known
            (everything outside the largest block).
        scaled_unit_params: the block of the largest model that fits, at this model's scale
            (None: ``unit_params``); the units grouped for this model (``sharding.units=auto``
            where a replica fits) are sharded one by one in a model too large for a replica.

    The largest model that fits scales this model's state, linear in its parameters at its
    shape (the root's and the largest block's shares of the parameters kept).
    """
    world = len(memory_bytes)
    room = min(memory_bytes) * MEMORY_HEADROOM - activation_bytes_per_sample
    count = max(int(param_count), 1)

    def fsdp_bytes(scale: float, kept: bool = False, block: int = unit_params) -> float:
        root = None if root_params is None else float(root_params) * scale  # fsdp state, x scale
        return model_state_bytes(
            float(param_count) * scale,
            "fsdp",
            world,
            float(block) * scale,
            offload,
            gathered_weights,
            root,
            keep_gathered=kept,
        )

    def fsdp_fit(name: str, kept: bool) -> ModeFit:
        state = fsdp_bytes(PARAM_BYTES, kept)
        scaled = unit_params if scaled_unit_params is None else scaled_unit_params
        per_param = fsdp_bytes(PARAM_BYTES / count, kept, scaled) or PARAM_BYTES
        extra = (fsdp_traffic_factor(passes, kept) - 1.0) * allreduce_s
        return ModeFit(
            name, state, state <= room, ddp_step_s + extra, max(int(room // per_param), 0)
        )

    ddp = model_state_bytes(float(param_count) * PARAM_BYTES)
    fits = [
        ModeFit(
            "ddp", ddp, ddp <= room, ddp_step_s, max(int(room // model_state_bytes(PARAM_BYTES)), 0)
        ),
        fsdp_fit("fsdp", False),
    ]
    # sharding.between_micro_batches=keep_unsharded (auto picks it where it fits)
    fits.append(fsdp_fit("fsdp-kept", True))
    return fits


def chosen_mode(configured: str, memory_bytes: Sequence[float], param_count: int) -> str:
    """What the runtime would use for ``sharding.mode`` (``auto``: DDP when a replica fits
    every rank, :func:`hetseq_hpc.balance.memory.replica_fits`)."""
    if configured == "auto":
        param_bytes = float(param_count) * PARAM_BYTES
        return "ddp" if all(replica_fits(m, param_bytes) for m in memory_bytes) else "fsdp"
    return "fsdp" if configured == "fsdp" else "ddp"


def planned_block_params(
    units_setting: str,
    memory_bytes: Sequence[float],
    param_count: int,
    largest_unit_params: int,
    root_params: Optional[int],
) -> int:
    """Parameters of the largest block FSDP gathers at once, as the runtime groups the units
    (:func:`hetseq_hpc.balance.agree.agree_on_units`): ``sharding.units=one``, or ``auto``
    where a replica fits every rank, shards them as ONE group (every parameter outside the
    root); ``per_unit`` (or a root the plan does not know) keeps the largest unit."""
    param_bytes = float(param_count) * PARAM_BYTES
    fits = units_setting == "auto" and all(replica_fits(m, param_bytes) for m in memory_bytes)
    if root_params is None or not units_grouped(units_setting, fits):
        return int(largest_unit_params)
    return max(int(largest_unit_params), int(param_count) - int(root_params))


def render_fits(fits: Sequence[ModeFit], configured: str, chosen: str) -> List[str]:
    """The planner's sharding block (one line per mode)."""
    lines = [
        "",
        f"sharding (sharding.mode={configured} -> {chosen}): model state per rank, "
        "whether it fits every rank with one sample, step, largest model for this mix",
        f"{'mode':<9} {'state/rank MB':>14} {'fits':>5} {'step ms':>9} {'largest model':>16}",
    ]
    for fit in fits:
        lines.append(
            f"{fit.mode:<9} {fit.state_bytes / 1e6:>14,.1f} "
            f"{'yes' if fit.fits else 'no':>5} {fit.step_s * 1e3:>9,.1f} "
            f"{fit.largest_params / 1e6:>13,.1f} M"
        )
    return lines
