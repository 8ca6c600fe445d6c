"""A lost rank does not end the run: the survivors re-form the world, re-split the SAME global
batch over themselves and redo the interrupted step (``trainer.elastic``).

:class:`ElasticWorld` is this rank's recovery object. A failed or timed-out collective of the
loop (:class:`~hetseq_hpc.train.recovery.timeouts.StepTimeout`, and the phases' own timeouts)
makes every survivor leave the broken group, re-form through the job's store
(:func:`hetseq_hpc.distributed.membership.reform`), agree on the last completed step and phase,
re-split the batch and redo what was interrupted, on the training state
(:class:`~hetseq_hpc.train.recovery.state.TrainState`); too few survivors stop with
:class:`~hetseq_hpc.errors.Preempted` (exit 3) after a checkpoint. FSDP reloads the last
checkpoint instead (:mod:`hetseq_hpc.train.recovery.sharded`). The four steps, the limits and
why the trajectory is the uninterrupted run's: docs/design/elastic-recovery.md,
"Re-forming and redoing the interrupted step".
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetseq_hpc.balance.agree import RankReport, agree_on_allocation
from hetseq_hpc.balance.allocation import Allocation
from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.distributed.fence import GenerationFence
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.distributed.membership import (
    STORE_ENV,
    Heartbeat,
    Membership,
    announce_recovery,
    arm,
    fence_store,
    is_peer_failure,
    join_generation,
    new_gloo_group,
    reform,
)
from hetseq_hpc.distributed.rendezvous import Rendezvous, backend_for_job, leave
from hetseq_hpc.env.preemption import REQUEUE
from hetseq_hpc.env.rank_guard import FAILED
from hetseq_hpc.errors import AllocationError, Preempted, RankExcluded
from hetseq_hpc.train.checkpoint.files import step_of
from hetseq_hpc.train.records import DONE, PHASE_NAMES, REDO, TRAINED, StepRecord
from hetseq_hpc.train.recovery.sharded import reports_for_world
from hetseq_hpc.train.recovery.state import TrainState
from hetseq_hpc.train.recovery.timeouts import (
    PhaseTimeouts,
    StepTimeout,
    first_validation_wait,
    phase_timeout,
    predicted_step_s,
    step_timeout,
)

log = logging.getLogger(__name__)


class _FailedAgain(Exception):
    """Inside :meth:`ElasticWorld.recover`: nobody was lost and the same step and phase failed
    again; ``error`` is re-raised (not retried)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class ElasticWorld:
    """This rank's side of in-job recovery (built by the worker when the launcher serves a
    job store).

    Args:
        run: the run configuration (``trainer.elastic``, ``cluster.collective_timeout_s``).
        store: the job's store (:func:`hetseq_hpc.distributed.membership.job_store`).
        rdv: the rendezvous of generation 0; reports: every rank's start-up
            :class:`~hetseq_hpc.balance.agree.RankReport`, by original rank.
        device: this rank's device.
        rebuild: under FSDP, a fresh seeded model on the CPU (the start-up model before
            sharding) that the state reloads the last checkpoint into
            (:meth:`TrainState.reload <hetseq_hpc.train.recovery.state.TrainState.reload>`).
        static_for: under FSDP, ``world size -> bytes`` of model state a rank holds
            (:func:`~hetseq_hpc.balance.memory.model_state_bytes`): the survivors' micro-batch
            caps are recomputed for it (:func:`~hetseq_hpc.train.recovery.sharded.reports_for_world`).
        member: this rank's member id (default its rank: a replacement has a new one,
            :mod:`hetseq_hpc.distributed.admission`); membership: its world (default generation
            0 of every rank).
    """

    def __init__(
        self,
        run: RunConfig,
        store: dist.Store,
        rdv: Gang,
        reports: Sequence[RankReport],
        device: torch.device,
        rebuild: Optional[Callable[[], nn.Module]] = None,
        static_for: Optional[Callable[[int], float]] = None,
        member: Optional[int] = None,
        membership: Optional[Membership] = None,
    ):
        self.run, self.store, self.device, self.rebuild = run, store, device, rebuild
        self.static_for = static_for  # FSDP: a rank's model state at a world size, bytes
        self.split_reports: List[RankReport] = []
        self.cfg = run.trainer.elastic
        self.member = rdv.world.rank if member is None else int(member)
        self.origin = rdv.world
        self.reports = [RankReport.of(r) for r in reports]
        self.membership = membership or Membership(0, tuple(range(rdv.world.world_size)))
        # grow back (hetseq_hpc.train.recovery.grow): join requests answered, rank place of
        # every member (a replacement takes its predecessor's)
        self.joins_answered = 0
        self.slots: Dict[int, int] = {m: m for m in range(rdv.world.world_size)}
        self.heartbeat = Heartbeat(store, self.member, watch=range(rdv.world.world_size))
        # the write fence: left out after a heartbeat stood still for stale_s (reform); its
        # lease is shorter; a store out of reach is asked again for collective_timeout_s
        self.fence = GenerationFence(
            fence_store(store, self.cfg.timeout_s),
            self.member,
            generation=self.membership.generation,  # a replacement's: the one it joined
            lease_s=self.stale_s / 2.0,
            ask_s=self.cfg.timeout_s,
            give_up_s=run.cluster.collective_timeout_s,
            where=os.environ.get(STORE_ENV, ""),
        )
        self.heartbeat.on_beat = self.fence.renew
        self.retried_at: Optional[Tuple[int, int]] = None  # (step, phase) redone, nobody lost
        self.timeout = StepTimeout(self.cfg.timeout_s)
        self.timed_size = rdv.world.world_size  # the world the measured step times are of
        self.phase_timeouts = PhaseTimeouts(run.cluster.collective_timeout_s)  # validation, ...
        self.events: List[Dict[str, Any]] = []

    @property
    def stale_s(self) -> float:
        """Seconds without a heartbeat after which the others leave a rank out."""
        return self.cfg.timeout_s / 2.0

    def close(self) -> None:
        """Stop the heartbeat (the rank is done)."""
        self.heartbeat.close()

    def arm(self) -> None:
        """Say, in the job's store, that this rank is in the training loop and recovers from a
        lost peer from now on (:func:`~hetseq_hpc.distributed.membership.arm`): before every
        rank has, the local launcher ends the run when a rank dies (a start-up collective
        would wait ``cluster.collective_timeout_s`` for it)."""
        arm(self.store, self.member, self.origin.node_name or "")

    def recover(self, trainer: TrainState, error: BaseException) -> Dict[str, Any]:
        """Re-form the world after ``error`` (a collective of the training loop failed) and
        make ``trainer`` ready to redo what was interrupted (every survivor calls this): its
        ``step`` and ``phase`` (:mod:`hetseq_hpc.train.records`) are those agreed by the
        survivors. Returns the membership event (its ``recovery_s`` is filled in by the caller
        once the next step completes, from ``lost_monotonic``).

        A rank lost WHILE the survivors re-form (a node's ranks die some hundred ms apart)
        makes a collective of the re-forming fail in turn (the new world cannot form: a
        ``DistStoreError`` after ``trainer.elastic.timeout_s``, or a closed socket): the
        survivors re-form again from the world they had agreed on, as often as ranks are
        lost, and the event names every rank lost since ``error``.

        Raises:
            RankFenced: the others went on without this rank (found in the job's store before
                anything is done or logged; :class:`~hetseq_hpc.errors.StoreLost` when the
                store cannot be reached).
            RankExcluded: the others went on without this rank while it re-formed.
            Preempted: fewer than ``trainer.elastic.min_ranks`` survived, or the global batch
                no longer fits them: the last completed step was checkpointed first (code
                REQUEUE: a Slurm job is requeued and resumes from it).
            LaunchError: the survivors could not agree on a new world in
                ``cluster.collective_timeout_s``.
            the original ``error``: nobody was lost and the same step failed again.
        """
        failed = time.monotonic()
        # kept until the process ends, which then skips the interpreter's teardown
        # (rank_guard.FAILED): a broken world's DDP reducer freed at the end of a run that
        # went on (the worker's start-up references) joined a gloo thread that waited for
        # the GIL, and the survivor never exited
        FAILED.append(error)
        self.fence.check(ask=True)  # left out already (cut off, stopped): nothing more to do
        start = self.membership
        # a failure inside a step may leave DDP's all-reduce in flight on the broken group:
        # its groups are not destroyed by this rank (see drop_groups), in every attempt
        in_step = trainer.phase == DONE
        step, at = trainer.step + in_step, (trainer.step, trainer.phase)
        log.warning(
            "step %d (%s): a collective failed (%s); re-forming the world without the lost ranks",
            step,
            "training" if in_step else f"after {PHASE_NAMES[trainer.phase]}",
            _first_line(error),
        )
        for attempt in range(len(start.members)):
            try:
                return self._reform(trainer, error, start, failed, in_step, step, at)
            except _FailedAgain as again:
                raise again.error from None
            except Exception as exc:
                if not is_peer_failure(exc) or attempt == len(start.members) - 1:
                    raise
                log.warning(
                    "step %d: another rank was lost while the world re-formed (%s); "
                    "re-forming again without it",
                    step,
                    _first_line(exc),
                )
                error = exc
        raise error  # not reached: the last attempt returns or raises

    def _reform(
        self,
        trainer: TrainState,
        error: BaseException,
        start: Membership,
        failed: float,
        in_step: bool,
        step: int,
        at: Tuple[int, int],
    ) -> Dict[str, Any]:
        """One attempt of :meth:`recover` from :attr:`membership` (``start``: the world before
        the first failure; ``failed``: its ``time.monotonic()``)."""
        old = self.membership
        announce_recovery(self.store, old, self.member)  # alive, even if tearing down is slow
        with_abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if with_abort is not None:
            try:
                with_abort()
            except Exception:
                pass
        sharded = trainer.sharded
        if not in_step:  # no asynchronous work in flight (destroying a group waits for it)
            drop_groups(trainer, error)
        leave()
        if not in_step:
            gc.collect()  # the broken groups are destroyed now: their sockets close
        try:
            new = reform(
                self.store,
                self.heartbeat,
                self.member,
                old,
                stale_s=self.stale_s,
                timeout_s=self.run.cluster.collective_timeout_s,
            )
        except RankExcluded as exc:  # nothing is written from here on
            self.fence.exclude(str(exc))
            raise
        self.membership = new  # a failure from here on re-forms from this generation
        self.fence.enter(new.generation)
        lost = [m for m in start.members if m not in new.members]
        if not [m for m in old.members if m not in new.members]:
            if self.retried_at == at:
                raise _FailedAgain(error)
            self.retried_at = at
            self.phase_timeouts.forget()  # a slow phase, not a hang: the redo waits longer
        join_generation(
            self.store,
            new,
            self.member,
            backend_for_job(self.device, self.run.cluster.device_kinds()),
            self.cfg.timeout_s,
        )
        world = dataclasses.replace(
            self.origin, rank=new.rank_of(self.member), world_size=len(new.members)
        )
        rdv = Rendezvous(
            world=world,
            cpu_group=new_gloo_group(self.cfg.timeout_s, self.run.cluster.collective_timeout_s),
        )
        if sharded:  # the lost shard is gone: the survivors go back to the last checkpoint
            trainer.phase = DONE
        else:
            self._agree_progress(trainer, rdv)
        event = {
            "event": "membership",
            "step": step,
            "generation": new.generation,
            "lost": [{"rank": m, "host": self.reports[m].world.node_name} for m in lost],
            "world_size": len(new.members),
            "members": list(new.members),
            "lost_monotonic": min([failed, *(self._last_beat(m) for m in lost)]),
        }
        if len(new.members) < self.cfg.min_ranks:
            self._stop(
                trainer,
                rdv,
                event,
                f"losing rank(s) {lost} ({len(new.members)} left, "
                f"fewer than trainer.elastic.min_ranks={self.cfg.min_ranks})",
            )
        try:
            allocation = self._split(rdv, new.members)
        except AllocationError as exc:
            self._stop(
                trainer,
                rdv,
                event,
                f"losing rank(s) {lost} (the global batch does not "
                f"fit the {len(new.members)} left: {exc})",
            )
        self.timeout.rescale(self.timed_size / len(new.members))
        self.timed_size = len(new.members)
        metas = [trainer.metas_by_member[m] for m in new.members]
        if sharded:
            event.update(trainer.reload(rdv, metas, allocation, self._rebuild, self.split_reports))
        else:
            trainer.rejoin(rdv, metas, allocation)
        self.timeout.predict(predicted_step_s(allocation))
        if trainer.any_compiles():  # the new split (or rebuilt model) may compile first
            self.timeout.allow(self.run.cluster.collective_timeout_s)
        self.timeout.apply()  # on the new default group
        event.update(
            split=list(allocation.samples),
            resumed_at_step=trainer.step + 1,
            redo=REDO[trainer.phase],
        )
        log.warning(
            "step %d: going on with %d rank(s) (original ranks %s; lost %s), split %s; redoing %s",
            step,
            len(new.members),
            list(new.members),
            lost or "none",
            allocation.samples,
            f"step {trainer.step + 1}"
            if trainer.phase == DONE
            else f"step {trainer.step}'s {REDO[trainer.phase]} and what follows",
        )
        return event

    def _last_beat(self, member: int) -> float:
        """When this rank last saw ``member``'s heartbeat move (``time.monotonic()``; now if
        never)."""
        last = self.heartbeat.last_beat(member)
        return time.monotonic() if last is None else last

    def _rebuild(self) -> nn.Module:
        """A fresh seeded model for :meth:`TrainState.reload
        <hetseq_hpc.train.recovery.state.TrainState.reload>`.

        Raises:
            RuntimeError: no ``rebuild`` was given (a programming error of the caller).
        """
        if self.rebuild is None:
            raise RuntimeError("ElasticWorld(rebuild=...) is needed to recover an FSDP run")
        return self.rebuild()

    def _agree_progress(self, trainer: TrainState, rdv: Gang) -> None:
        """Every survivor at the most advanced survivor's step (its full state, step record and
        row sent to those behind), and at the earliest phase of it some survivor did not
        complete (:mod:`hetseq_hpc.train.records`): that phase is redone by all."""
        marks = rdv.all_gather_objects((int(trainer.step), int(trainer.phase)))
        top = max(s for s, _ in marks)
        # a survivor behind never started the work after ``top``: it redoes it from the start
        trainer.phase = min(p if s == top else TRAINED for s, p in marks)
        if all(s == top for s, _ in marks):
            return
        source = [s for s, _ in marks].index(top)
        mine = rdv.world.rank == source
        sent = (trainer.state_dict(), trainer.history[-1], trainer.last_row) if mine else None
        got = rdv.broadcast_object(sent, src=source)
        if trainer.step != top and got is not None:
            state, rec, row = got
            trainer.load_state_dict(state, f"the state of surviving rank {source}")
            trainer.history.append(rec)
            trainer.last_row = row
        log.info("step %d was completed by some survivors: all now continue from it", top)

    def _stop(self, trainer: TrainState, rdv: Gang, event: Dict[str, Any], why: str) -> None:
        """Checkpoint the last completed step (the new rank 0 writes it, with the step's row
        and the membership event if missing) and stop with code REQUEUE, as a preemption does:
        a Slurm job is requeued and resumes from it. Under FSDP the lost shard is gone: no
        checkpoint is written, the requeue resumes from the last one on disk."""
        if trainer.sharded:
            found = trainer.checkpoints.list()
            step = step_of(found[-1]) if found else 0
            log.warning(
                "step %d: %s: stopping (sharding.mode=fsdp: the lost shard is gone, "
                "a requeue resumes from the last checkpoint, step %d)",
                event["step"],
                why,
                step,
            )
            if rdv.world.rank == 0:
                trainer.log_before_stop({**event, "stopped": why})
            raise Preempted(step, REQUEUE, why, leader=rdv.world.rank == 0)
        log.warning(
            "step %d: %s: checkpointing step %d and stopping", event["step"], why, trainer.step
        )
        if rdv.world.rank == 0:
            trainer.log_before_stop({**event, "stopped": why})
        trainer.checkpoints.save_on_rank0(trainer.step, rdv, trainer.state_dict)
        trainer.checkpoints.finish(rdv)  # on disk before the requeue
        raise Preempted(trainer.step, REQUEUE, why, leader=rdv.world.rank == 0)

    def expect(self, allocation: Allocation, compiling: bool = False) -> None:
        """A split starts (the first, or a re-formed world's): its predicted step time sets
        the training-step collective timeout (:class:`StepTimeout`). ``compiling``: its first
        step may compile graphs (``trainer.compile``) on some ranks, which the others wait
        for: that step alone may also take ``cluster.collective_timeout_s``, and its time is
        not taken as a step time."""
        stale = self.timeout.predict(predicted_step_s(allocation))
        if compiling:
            stale = self.timeout.allow(self.run.cluster.collective_timeout_s)
        if stale:
            self.timeout.apply()

    def observe_step(self, rec: StepRecord) -> None:
        """After a completed step: its time sets the collective timeout of the next steps
        (:class:`StepTimeout`), and its collectives confirm this rank to its write fence
        (:meth:`~hetseq_hpc.distributed.fence.GenerationFence.confirm`)."""
        self.fence.confirm(time.monotonic())  # the step's collectives had every member
        longest = max([rec.wall_s, *(s.step_time_s for s in rec.per_rank)])
        if self.timeout.observe(longest):
            self.timeout.apply()

    def step_timeout(self, rdv: Gang) -> contextlib.AbstractContextManager:
        """A decision right after a step (re-balancing) waits at most the step's timeout
        (:func:`~hetseq_hpc.train.recovery.timeouts.step_timeout`)."""
        return step_timeout(self.timeout, rdv, self.run.cluster.collective_timeout_s)

    def phase_timeout(self, phase: str, rdv: Gang) -> contextlib.AbstractContextManager:
        """The collectives of ``phase`` (``"validation"``, ``"checkpoint"``) wait their own
        measured time (:func:`~hetseq_hpc.train.recovery.timeouts.phase_timeout`)."""
        return phase_timeout(
            self.phase_timeouts, self.timeout, rdv, phase, self.run.cluster.collective_timeout_s
        )

    def first_validation_wait(
        self,
        rdv: Gang,
        history: Sequence[StepRecord],
        rank: int,
        world_size: int,
        local_s: float,
    ) -> Optional[float]:
        """The first validation's gather waits an estimate from this rank's pass of
        ``local_s`` seconds (:func:`~hetseq_hpc.train.recovery.timeouts.first_validation_wait`)."""
        return first_validation_wait(
            self.phase_timeouts,
            self.timeout.seconds,
            rdv.cpu_group,
            history,
            rank,
            world_size,
            local_s,
        )

    def _split(self, rdv: Gang, members: Sequence[int]) -> Allocation:
        """The same global batch over the survivors, from their start-up calibrations (under
        FSDP with the micro-batch caps of the larger shards, :func:`reports_for_world`)."""
        run = self.run
        if run.balance.allocation is not None:
            log.warning(
                "balance.allocation=%s was for %d ranks: the split over the %d survivors "
                "is computed from their calibrations",
                list(run.balance.allocation),
                len(self.reports),
                len(members),
            )
            run = dataclasses.replace(
                run, balance=dataclasses.replace(run.balance, allocation=None)
            )
        reports = [self.reports[m] for m in members]
        if self.static_for is not None:  # FSDP: each survivor's shard is larger now
            reports = reports_for_world(
                reports, self.static_for(len(members)), run.balance.max_micro_batch
            )
        self.split_reports = reports  # what the survivors' FSDP accumulation is decided from
        return agree_on_allocation(run, reports, rdv)


def _first_line(error: BaseException) -> str:
    """What failed, for a log line: a store wait that timed out in words (a member of the world
    did not answer in the job's store: it was lost, or is stopped), else ``Type: first line of
    the message`` (at most 200 characters)."""
    if isinstance(error, dist.DistStoreError):
        return "a member did not answer in the job's store in time (lost, or stopped)"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


def drop_groups(trainer: TrainState, error: BaseException) -> None:
    """Drop this rank's references to the broken process groups (the failed step's frames here,
    the DDP wrapper and the gloo group of the rendezvous in ``trainer``,
    :meth:`~hetseq_hpc.train.recovery.state.TrainState.drop_groups`), so that once they are
    destroyed their sockets close: a survivor still blocked in a collective with this rank
    (not with the lost one: it finished an earlier phase) fails at once instead of after its
    timeout. Aborting a gloo group does not unblock its peers; closing its sockets does. Only
    outside a training step: destroying a group with work in flight (DDP's all-reduce) blocks,
    GIL held."""
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)
    trainer.drop_groups()


__all__ = ["ElasticWorld", "drop_groups"]
