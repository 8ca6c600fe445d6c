"""In-job recovery of an FSDP run (``sharding.mode=fsdp``, :mod:`hetseq_hpc.train.recovery.elastic`).

Under FSDP a lost rank takes its shard of the parameters, gradients and optimizer state with
it: the survivors cannot hand each other the missing state as data-parallel survivors do. So,
after re-forming the world, they

1. drop the broken FSDP model and optimizer, build the model again (seeded as at start-up, on
   the CPU) and shard it over the new world (``Trainer.reload``), each survivor's micro-batch
   cap recomputed for its larger shard (:func:`reports_for_world`);
2. load the newest checkpoint of this run (full or sharded; DCP reshards a sharded one onto the
   new world size), else the checkpoint the run started from, else nothing: the seeded model
   at step 0 is the run's own start (:func:`checkpoint_to_reload`);
3. continue from that step with the same global batch split over the survivors. The steps
   after the checkpoint are trained again; their data positions and dropout seeds are functions
   of the step, so the trajectory is the uninterrupted run's. ``metrics.jsonl`` drops the
   rows written after the checkpoint and gets them again; the membership row says
   ``reloaded`` (checkpoint, step) and ``steps_redone``.

The cost is the steps since the last checkpoint (``trainer.checkpoint_every``), not a requeue.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hetseq_hpc.balance.agree import RankReport
from hetseq_hpc.balance.memory import micro_batch_cap
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.train.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)


def checkpoint_to_reload(
    checkpoints: CheckpointManager, rdv: Gang, resumed_from: Optional[str]
) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """``(path, state)`` of the newest checkpoint of this run (agreed over ``rdv``: a
    collective), else of the checkpoint the run started from (``resumed_from``), else
    ``(None, None)``.

    Raises:
        CheckpointError: the newest checkpoint does not verify (the run cannot go on in-job;
            one line naming it, as a resume would).
    """
    path, state, _ = checkpoints.load("auto", rdv)
    if path is not None:
        return path, state
    if resumed_from is None:
        return None, None
    return resumed_from, checkpoints.choose(resumed_from).state


def reports_for_world(
    reports: Sequence[RankReport], static_bytes: float, limit: Optional[int] = None
) -> List[RankReport]:
    """The survivors' start-up reports with each micro-batch cap recomputed for the model state
    a rank holds in the smaller world: a shard of ``1 / world`` grows when ranks are lost, and
    the start-up cap (``(budget - static) / activation bytes per sample``) would overrun the
    budget. Each cap only ever goes down; a cap of 0 makes the split refuse (the survivors then
    checkpoint and stop for a requeue, as when the batch no longer fits).

    Args:
        reports: :class:`~hetseq_hpc.balance.agree.RankReport` of the survivors (new order).
        static_bytes: bytes of model state one rank holds at its peak in the new world
            (:func:`~hetseq_hpc.balance.memory.model_state_bytes` with the new world size).
        limit: ``balance.max_micro_batch``.

    Returns:
        New reports (the given ones are not changed); ``calibration.static_bytes`` is
        ``static_bytes`` and ``calibration.max_micro_batch`` the lower of the two caps.
    """
    out = []
    for report in reports:
        cal = report.calibration
        cap = micro_batch_cap(
            float(cal.memory_budget_bytes),
            static_bytes,
            float(cal.activation_bytes_per_sample),
            limit,
        )
        if cap < int(cal.max_micro_batch):
            log.info(
                "rank %s: micro-batch cap %d -> %d for its larger shard (%.1f MiB of model state)",
                report.world.rank,
                int(cal.max_micro_batch),
                cap,
                static_bytes / 2**20,
            )
        cal = dataclasses.replace(
            cal,
            max_micro_batch=min(int(cal.max_micro_batch), cap),
            static_bytes=float(static_bytes),
        )
        out.append(dataclasses.replace(report, calibration=cal))
    return out


__all__ = ["checkpoint_to_reload", "reports_for_world"]
