"""In-job recovery of an FSDP run (``sharding.mode=fsdp``, :mod:`hetseq_hpc.train.elastic`).

Under FSDP a lost rank takes its shard of the parameters, gradients and optimizer state with
it: the survivors cannot hand each other the missing state as data-parallel survivors do. So,
after re-forming the world, they

1. drop the broken FSDP model and optimizer, build the model again (seeded as at start-up, on
   the CPU) and shard it over the new world (:func:`~hetseq_hpc.train.parallel.build_parallel`);
2. load the newest checkpoint of this run (full or sharded; DCP reshards a sharded one onto the
   new world size), else the checkpoint the run started from, else nothing: the seeded model
   at step 0 is the run's own start;
3. continue from that step with the same global batch split over the survivors. The steps
   after the checkpoint are trained again; their data positions and dropout seeds are functions
   of the step, so the trajectory is the uninterrupted run's. ``metrics.jsonl`` drops the
   rows written after the checkpoint (the new rank 0 opens it at the checkpoint's step) and
   gets them again; the membership row says ``reloaded`` (checkpoint, step) and
   ``steps_redone``.

The cost is the steps since the last checkpoint (``trainer.checkpoint_every``), not a requeue.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

from torch import nn

from hetseq_hpc.balance.memory import micro_batch_cap
from hetseq_hpc.train.fsdp_accumulation import agree_on_accumulation
from hetseq_hpc.train.optim import build_optimizer
from hetseq_hpc.train.parallel import build_parallel
from hetseq_hpc.train.phases import DONE

log = logging.getLogger(__name__)


def reload_sharded(
    trainer: Any,
    rdv: Any,
    metas: List[Any],
    allocation: Any,
    rebuild: Callable[[], nn.Module],
    reports: Sequence[Any] = (),
) -> Dict[str, Any]:
    """Go on in a re-formed world from the last checkpoint (every survivor calls this, after
    :func:`~hetseq_hpc.distributed.membership.join_generation`; collectives over ``rdv``).

    Args:
        trainer: the :class:`~hetseq_hpc.train.loop.Trainer` whose FSDP model lost a shard.
        rdv: the new world's rendezvous; metas: the survivors' rank facts (new rank order);
        allocation: the global batch split over the survivors.
        rebuild: a fresh, seeded model on the CPU (the start-up model before it was sharded).
        reports: the survivors' :class:`~hetseq_hpc.balance.agree.RankReport` the split was
            made from (caps for the larger shards, :func:`reports_for_world`): what FSDP does
            between micro-batches is agreed again from them
            (:func:`~hetseq_hpc.train.fsdp_accumulation.agree_on_accumulation`; without them
            the rebuilt model reshards, the safe default).

    Returns:
        ``{"reloaded": {"checkpoint": path or None, "step": s}, "steps_redone": n}`` for the
        membership event; ``trainer.step`` is ``s`` and ``trainer.phase`` DONE afterwards.

    Raises:
        CheckpointError: the newest checkpoint does not verify (the run cannot go on in-job;
            one line naming it, as a resume would).
    """
    watch = getattr(trainer.parallel, "memory_watch", None)
    was = trainer.step
    # the broken model and optimizer hold DTensors of the old group: gone before the new ones
    trainer.parallel = trainer.model = trainer.optimizer = trainer.scheduler = None
    gc.collect()
    trainer.rdv, trainer.world, trainer.rank = rdv, rdv.world, rdv.world.rank
    trainer.metas, trainer.allocation, trainer.rebalancer = metas, allocation, None
    trainer.parallel = build_parallel(trainer.run, trainer.task, rebuild(), trainer.device, "fsdp")
    trainer.parallel.memory_watch = watch
    if reports:  # every survivor: one small all-gather when there is a choice
        agree_on_accumulation(trainer.run.sharding, trainer.parallel, allocation, reports, rdv)
    trainer.model = trainer.parallel.model
    trainer.optimizer, trainer.scheduler = build_optimizer(trainer.model, trainer.run)
    trainer.reset_gradient_path()
    path, state = _checkpoint(trainer, rdv)
    if state is not None:
        trainer.load_state_dict(state, path)
    else:
        trainer.step = 0  # the seeded model is the run's start
    trainer.phase = DONE
    trainer.history = [r for r in trainer.history if r.step <= trainer.step]
    trainer.last_row = {}
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.parallel.start(trainer.grad_path, trainer.hook_state)
    log.warning(
        "sharding.mode=fsdp: the lost rank's shard is gone: reloaded %s and re-sharded "
        "it over %d rank(s); steps %d-%d are trained again",
        path or "the seeded start model (no checkpoint yet)",
        rdv.world.world_size,
        trainer.step + 1,
        was,
    )
    if trainer.on_allocation is not None:
        trainer.on_allocation(allocation, {"members": list(trainer.elastic.membership.members)})
    return {
        "reloaded": {"checkpoint": path, "step": trainer.step},
        "steps_redone": max(0, was - trainer.step),
    }


def reports_for_world(
    reports: Sequence[Any], static_bytes: float, limit: Optional[int] = None
) -> List[Any]:
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
        cal = dict(report.calibration)
        cap = micro_batch_cap(
            float(cal["memory_budget_bytes"]),
            static_bytes,
            float(cal["activation_bytes_per_sample"]),
            limit,
        )
        if cap < int(cal["max_micro_batch"]):
            log.info(
                "rank %s: micro-batch cap %d -> %d for its larger shard (%.1f MiB of model state)",
                report.world.get("rank", "?"),
                int(cal["max_micro_batch"]),
                cap,
                static_bytes / 2**20,
            )
        cal["max_micro_batch"] = min(int(cal["max_micro_batch"]), cap)
        cal["static_bytes"] = float(static_bytes)
        out.append(dataclasses.replace(report, calibration=cal))
    return out


def _checkpoint(trainer: Any, rdv: Any) -> tuple:
    """``(path, state)`` of the newest checkpoint of this run, else of the checkpoint the run
    started from (``trainer.resumed_from``), else ``(None, None)``."""
    path, state, _ = trainer.checkpoints.load("auto", rdv)
    if path is not None:
        return path, state
    start: Optional[str] = getattr(trainer, "resumed_from", None)
    if start is None:
        return None, None
    return start, trainer.checkpoints.choose(start).state


__all__ = ["reload_sharded", "reports_for_world"]
