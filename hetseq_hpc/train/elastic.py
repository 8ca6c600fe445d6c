"""A lost rank does not end the run: the survivors re-form the world, re-split the SAME global
batch over themselves and redo the interrupted step (``trainer.elastic``).

With data parallelism every survivor holds the whole model and optimizer state, and an
allocation can split one global batch over any set of ranks exactly, so nothing of the
trajectory is lost (peers differ: torchrun elastic restarts every worker from the last
checkpoint; TorchFT continues but lets the global batch shrink with the lost replicas).

When a collective of a training step fails (a peer's socket closed: a killed process or node)
or times out (``trainer.elastic.timeout_s``: a stopped or stuck peer), every survivor:

1. leaves the broken process group and re-forms the world through the job's store, which the
   launcher serves (:func:`hetseq_hpc.distributed.membership.reform`: a member whose heartbeat
   stopped is left out; new ranks are dense, in the old order);
2. agrees on the last completed step: a survivor that finished the step (its exchange
   completed before the peer died) sends its model, optimizer, scheduler and loss-scale state
   to the others, so every survivor stands at the same step;
3. re-splits the global batch over the survivors from their start-up calibrations (memory caps
   kept; a forced ``balance.allocation`` is for the old world, so the split is computed);
4. wraps the model in a new DDP on the new group and redoes the interrupted step from its
   start: gradients zeroed, the step's data positions are a function of the step alone.

Gradients are summed and divided by the global unit count as in any step, so the trajectory is
the uninterrupted run's (up to float summation order; dropout masks are drawn per rank and
step, so with dropout on the masks of a moved sample differ, as with any re-balancing).

Not covered: FSDP (a lost rank takes its shard; it ends the run as before). On Slurm the batch
script serves the store (:func:`hetseq_hpc.launch.sbatch.store_lines`) and its step survives a
task's death (``srun --kill-on-bad-exit=0 --no-kill``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from hetseq_hpc.balance.agree import RankReport, agree_on_allocation
from hetseq_hpc.distributed.membership import Heartbeat, Membership, join_generation, reform
from hetseq_hpc.distributed.rendezvous import Rendezvous, backend_for, leave
from hetseq_hpc.errors import TooFewRanks
from hetseq_hpc.train.parallel import build_parallel

log = logging.getLogger(__name__)


class ElasticWorld:
    """This rank's side of in-job recovery (built by the worker when the launcher serves a
    job store).

    Args:
        run: the run configuration (``trainer.elastic``, ``cluster.collective_timeout_s``).
        store: the job's store (:func:`hetseq_hpc.distributed.membership.job_store`).
        rdv: the rendezvous of generation 0; reports: every rank's start-up
            :class:`~hetseq_hpc.balance.agree.RankReport`, by original rank.
        device: this rank's device.
    """

    def __init__(self, run: Any, store: Any, rdv: Rendezvous, reports: Sequence[Any],
                 device: torch.device):
        self.run, self.store, self.device = run, store, device
        self.cfg = run.trainer.elastic
        self.member = rdv.world.rank
        self.origin = rdv.world
        self.reports = [RankReport.of(r) for r in reports]
        self.membership = Membership(0, tuple(range(rdv.world.world_size)))
        self.heartbeat = Heartbeat(store, self.member, watch=range(rdv.world.world_size))
        self.retried_at: Optional[int] = None  # a step redone with nobody lost
        self.events: List[Dict[str, Any]] = []

    def close(self) -> None:
        """Stop the heartbeat (the rank is done)."""
        self.heartbeat.close()

    def recover(self, trainer: Any, error: BaseException, step: int) -> Dict[str, Any]:
        """Re-form the world after ``error`` in step ``step`` and make ``trainer`` ready to
        redo it (every survivor calls this); returns the membership event (its
        ``recovery_s`` is filled in by the caller once the next step completes).

        Raises:
            RankExcluded: the others went on without this rank.
            TooFewRanks: fewer than ``trainer.elastic.min_ranks`` survived.
            the original ``error``: nobody was lost and the same step failed again.
        """
        detected = time.monotonic()
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        log.warning("step %d: a collective failed (%s: %s); re-forming the world without the "
                    "lost ranks", step, type(error).__name__, first)
        old = self.membership
        with_abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if with_abort is not None:
            try:
                with_abort()
            except Exception:
                pass
        leave()
        new = reform(self.store, self.heartbeat, self.member, old,
                     stale_s=self.cfg.timeout_s / 2.0, timeout_s=self.run.cluster.collective_timeout_s)
        lost = [m for m in old.members if m not in new.members]
        if not lost:
            if self.retried_at == step:
                raise error
            self.retried_at = step
        if len(new.members) < self.cfg.min_ranks:
            raise TooFewRanks(f"only {len(new.members)} rank(s) left after losing rank(s) {lost} "
                              f"at step {step}, fewer than trainer.elastic.min_ranks="
                              f"{self.cfg.min_ranks}: the run resumes from its last checkpoint "
                              "when requeued (or run it again with trainer.resume=auto)")
        join_generation(self.store, new, self.member, backend_for(self.device),
                        self.cfg.timeout_s)
        world = dataclasses.replace(self.origin, rank=new.rank_of(self.member),
                                    world_size=len(new.members))
        from datetime import timedelta

        rdv = Rendezvous(world=world, cpu_group=dist.new_group(
            backend="gloo", timeout=timedelta(seconds=self.run.cluster.collective_timeout_s)))
        self.membership = new
        self._same_state(trainer, rdv)
        allocation = self._split(rdv, new.members)
        rejoin(trainer, rdv, [trainer.metas_by_member[m] for m in new.members], allocation)
        event = {"event": "membership", "step": step, "generation": new.generation,
                 "lost": [{"rank": m, "host": self.reports[m].world.get("node_name", "")}
                          for m in lost],
                 "world_size": len(new.members), "members": list(new.members),
                 "split": list(allocation.samples), "resumed_at_step": trainer.step + 1,
                 "detected_monotonic": detected}
        log.warning("step %d: going on with %d rank(s) (original ranks %s; lost %s), split %s; "
                    "redoing step %d", step, len(new.members), list(new.members), lost or "none",
                    allocation.samples, trainer.step + 1)
        return event

    def _same_state(self, trainer: Any, rdv: Rendezvous) -> None:
        """Every survivor at the most advanced survivor's step (its full state sent)."""
        steps = rdv.all_gather_objects(int(trainer.step))
        top = max(steps)
        if min(steps) == top:
            return
        source = steps.index(top)
        box = [trainer.state_dict() if rdv.world.rank == source else None]
        dist.broadcast_object_list(box, src=source, group=rdv.cpu_group)
        if rdv.world.rank != source:
            trainer.load_state_dict(box[0], f"the state of surviving rank {source}")
        log.info("step %d was completed by some survivors: all now continue from it", top)

    def _split(self, rdv: Rendezvous, members: Sequence[int]) -> Any:
        """The same global batch over the survivors, from their start-up calibrations."""
        run = self.run
        if run.balance.allocation is not None:
            log.warning("balance.allocation=%s was for %d ranks: the split over the %d survivors "
                        "is computed from their calibrations", list(run.balance.allocation),
                        len(self.reports), len(members))
            run = dataclasses.replace(run, balance=dataclasses.replace(run.balance,
                                                                       allocation=None))
        return agree_on_allocation(run, [self.reports[m] for m in members], rdv)


def rejoin(trainer: Any, rdv: Rendezvous, metas: List[Any], allocation: Any) -> None:
    """Go on in a re-formed world (:mod:`hetseq_hpc.train.elastic`): its rendezvous, the
    survivors' metas and split, a new DDP on the new group; gradients zeroed, the
    re-balancer dropped (its history is of the old world)."""
    trainer.rdv, trainer.world, trainer.rank = rdv, rdv.world, rdv.world.rank
    trainer.metas, trainer.allocation, trainer.rebalancer = metas, allocation, None
    trainer.optimizer.zero_grad(set_to_none=True)
    scale = trainer.grad_path.loss_scale.state_dict()
    trainer.reset_gradient_path()
    trainer.grad_path.loss_scale.load_state_dict(scale)
    trainer.parallel = build_parallel(trainer.run, trainer.task, trainer.parallel.model,
                                      trainer.device, "ddp")
    trainer.parallel.start(trainer.grad_path, trainer.hook_state)
    if trainer.on_allocation is not None:
        trainer.on_allocation(allocation, {"members": list(trainer.elastic.membership.members)})
