"""Online re-balancing inside the training loop (:class:`hetseq_hpc.train.loop.Trainer`)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("hetseq_hpc.train.loop")


def maybe_rebalance(trainer: Any, rec: Any) -> None:
    """Feed the re-balancer; every ``balance.rebalance_interval`` steps, or at once when it
    sees a speed change (:meth:`~hetseq_hpc.balance.rebalance.Rebalancer.speed_changed`, the
    same verdict on every rank), all ranks check they decided alike and switch together to
    its new allocation from the next step (:meth:`~hetseq_hpc.balance.rebalance.Rebalancer.due`
    also calls for a follow-up decision a few steps after a move that the evidence
    supported only in part). Nothing is decided after the last step or a stop request's
    step: no step would run the new split."""
    every = trainer.run.balance.rebalance_interval
    if trainer.rebalancer is None or not every:
        return
    trainer.rebalancer.record(rec.per_rank)
    if rec.step >= trainer.cfg.max_steps or rec.stop_code:
        # no step follows (the same on every rank): a switch now would leave an allocation
        # that never ran in allocation.json and its measured sync
        return
    if not trainer.rebalancer.due(rec.step, every, trainer.allocation):
        return
    new = trainer.rebalancer.observe(rec.step, trainer.allocation)
    with trainer.decision_timeout():
        trainer.rdv.check_agreement(
            new.digest() if new else "unchanged", f"re-balancing decision at step {rec.step}"
        )
    if new is None:
        return
    why = trainer.rebalancer.decisions[-1]
    log.info(
        "step %d: straggle %.2f -> re-balancing %s -> %s from step %d (predicted gain "
        "%.1f %%, %.1f %% at the cautious end of the rates' intervals)",
        rec.step,
        why["straggle"],
        trainer.allocation.samples,
        new.samples,
        rec.step + 1,
        100 * why["gain"],
        100 * why.get("supported_gain", why["gain"]),
    )
    rec.extra["reallocation"] = {
        "from": trainer.allocation.samples,
        "to": new.samples,
        "at_step": rec.step + 1,
        **{k: why[k] for k in ("gain", "supported_gain", "errors") if k in why},
    }
    trainer.allocation = new
    if trainer.on_allocation is not None:
        trainer.on_allocation(new)
