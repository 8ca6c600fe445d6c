"""Gradient accumulation under FSDP without resharding between micro-batches
(``sharding.between_micro_batches``; the mechanism is :meth:`hetseq_hpc.train.parallel.Sharded.sync`).

Kept gathered (``keep_unsharded``), each unit is all-gathered once per step instead of in every
forward and backward (a step of one pass too: its backward gathers nothing); ``auto`` does so
only when every rank says the whole weights fit beside its shard and largest pass (one
job-wide choice, agreed at start-up and after a re-formation).
The all-gather counts, what is not skipped and the memory rule:
docs/design/sharding.md, "Accumulation without resharding between micro-batches".
"""

from __future__ import annotations

import logging
from typing import Sequence, cast

from hetseq_hpc.balance.agree import RankReport
from hetseq_hpc.balance.allocation import Allocation
from hetseq_hpc.balance.memory import model_state_bytes
from hetseq_hpc.config.sharding import ShardingConfig
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.train.parallel import Replicated, Sharded, equal_pass_sizes

log = logging.getLogger(__name__)


def keep_unsharded_fits(
    state_bytes: float, budget_bytes: float, activation_bytes_per_sample: float, pass_samples: int
) -> bool:
    """Whether a rank holds the kept-gathered model state (``state_bytes``: its shard plus the
    whole weights and the gradients before their reduce-scatter) and the activations of its
    largest pass (``pass_samples`` x ``activation_bytes_per_sample``) within ``budget_bytes``
    (its calibrated budget, headroom applied). Bytes and samples in."""
    need = float(state_bytes) + float(activation_bytes_per_sample) * int(pass_samples)
    return need <= float(budget_bytes)


def agree_on_accumulation(
    sharding: ShardingConfig,
    parallel: Replicated,
    allocation: Allocation,
    reports: Sequence[RankReport],
    rdv: Gang,
) -> str:
    """Decide, on every rank alike, what FSDP does between the micro-batches of a step, and set
    it on ``parallel`` (``Sharded.between_micro_batches``, in ``summary.json``'s ``sharding``).

    Args:
        sharding: the ``sharding`` group (:class:`~hetseq_hpc.config.sharding.ShardingConfig`);
            its ``between_micro_batches`` is ``auto``, ``keep_unsharded`` or ``reshard``.
        parallel: the strategy (:func:`~hetseq_hpc.train.parallel.build_parallel`); DDP:
            nothing to decide.
        allocation: the agreed :class:`~hetseq_hpc.balance.allocation.Allocation`.
        reports: every rank's :class:`~hetseq_hpc.balance.agree.RankReport` (rank order;
            ``calibration`` has ``memory_budget_bytes`` and ``activation_bytes_per_sample``).
        rdv: the joined rendezvous (one all-gather when there is a choice to make).

    Returns:
        ``keep_unsharded`` (a step of one pass too: gathered from its forward to its
        backward), ``reshard`` or ``ddp`` (not sharded).
    """
    if not getattr(parallel, "sharded", False):
        return "ddp"
    shard = cast(Sharded, parallel)  # sharded: the FSDP2 strategy
    setting = str(sharding.between_micro_batches)
    passes = max(len(s.micro_sizes) for s in allocation.shares)
    chosen = setting
    if chosen in ("auto", "keep_unsharded"):
        rank = rdv.world.rank
        sizes = shard.sizes
        state = model_state_bytes(
            sizes.total,
            "fsdp",
            rdv.world.world_size,
            sizes.block,
            shard.offload,
            gathered_weights=False,
            root_bytes=sizes.root,
            keep_gathered=True,
        )
        cal = reports[rank].calibration
        largest = equal_pass_sizes(allocation.shares[rank].samples, passes)[0][0]
        fits = rdv.all_gather_objects(
            keep_unsharded_fits(
                state, cal.memory_budget_bytes, cal.activation_bytes_per_sample, largest
            )
        )
        short = [r for r, ok in enumerate(fits) if not ok]
        if chosen == "auto":
            chosen = "reshard" if short else "keep_unsharded"
        if rank == 0:
            whole = f"the whole weights ({sizes.total / 2**20:.1f} MiB)"
            why = (
                f"{whole} fit beside every rank's shard and largest micro-batch"
                if not short
                else f"{whole} do not fit rank(s) {short} beside the shard and micro-batch"
            )
            if short and chosen == "keep_unsharded":  # forced: the user's call
                log.warning(
                    "sharding.between_micro_batches=keep_unsharded although %s: "
                    "they may run out of memory; sharding.between_micro_batches=auto "
                    "reshards instead",
                    why,
                )
            log.info(
                "sharding.between_micro_batches=%s -> %s, %d passes per step (%s)",
                setting,
                chosen,
                passes,
                why,
            )
    shard.between_micro_batches = chosen
    return chosen


__all__ = ["agree_on_accumulation", "keep_unsharded_fits"]
