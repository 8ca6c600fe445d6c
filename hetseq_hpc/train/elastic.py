"""A lost rank does not end the run: the survivors re-form the world, re-split the SAME global
batch over themselves and redo the interrupted step (``trainer.elastic``).

A failed or timed-out collective of the loop (:class:`StepTimeout`) makes every survivor leave
the broken group, re-form through the job's store
(:func:`hetseq_hpc.distributed.membership.reform`), agree on the last completed step and phase,
re-split the batch and redo what was interrupted; too few survivors stop with
:class:`~hetseq_hpc.errors.Preempted` (exit 3) after a checkpoint. FSDP reloads the last
checkpoint instead (:mod:`hetseq_hpc.train.elastic_sharded`). The four steps, the limits and
why the trajectory is the uninterrupted run's: docs/design/elastic-recovery.md,
"Re-forming and redoing the interrupted step".
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import traceback
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hetseq_hpc.balance.agree import RankReport, agree_on_allocation
from hetseq_hpc.distributed.membership import (
    Heartbeat,
    Membership,
    announce_recovery,
    arm,
    is_peer_failure,
    join_generation,
    reform,
)
from hetseq_hpc.distributed.rendezvous import Rendezvous, backend_for, leave
from hetseq_hpc.env.preemption import REQUEUE
from hetseq_hpc.errors import AllocationError, Preempted
from hetseq_hpc.train.checkpoint.files import step_of
from hetseq_hpc.train.elastic_sharded import reload_sharded, reports_for_world
from hetseq_hpc.train.parallel import build_parallel
from hetseq_hpc.train.phase_timeout import PhaseTimeouts
from hetseq_hpc.train.phases import DONE, PHASE_NAMES, REDO, TRAINED, log_before_stop

log = logging.getLogger(__name__)


class StepTimeout:
    """The collective timeout of a training step (the default group: DDP's gradient
    all-reduce), ``max(floor_s, factor × T)``: ``T`` is the longest of the last ``window``
    measured step times and the predicted one (twice the prediction before any step is
    measured: a first step warms up). A longer wait than that is a stuck peer; a shorter
    timeout would take an uneven but healthy step (accumulation, a slow device, a big model)
    for a lost rank.

    Args:
        floor_s: the least timeout (``trainer.elastic.timeout_s``).
        factor: the multiple of the step time (3).
        window: how many measured steps count.
    """

    def __init__(self, floor_s: float, factor: float = 3.0, window: int = 20):
        self.floor_s, self.factor = float(floor_s), float(factor)
        self.predicted_s = 0.0
        self.recent: Deque[float] = deque(maxlen=window)
        self.applied: Optional[float] = None

    @property
    def seconds(self) -> float:
        """The timeout now, seconds."""
        longest = max(self.recent) if self.recent else 2.0 * self.predicted_s
        return max(self.floor_s, self.factor * max(longest, self.predicted_s))

    def predict(self, seconds: float) -> bool:
        """Set the predicted step time (of a new split); True when the timeout should be
        applied again (it moved by more than 10 %)."""
        self.predicted_s = max(0.0, float(seconds))
        return self.stale()

    def observe(self, seconds: float) -> bool:
        """Record a measured step time; True when the timeout should be applied again."""
        self.recent.append(max(0.0, float(seconds)))
        return self.stale()

    def rescale(self, ratio: float) -> None:
        """Scale the measured times by ``ratio`` (old over new world size: each survivor
        now computes a larger share of the same global batch)."""
        self.recent = deque((x * ratio for x in self.recent), maxlen=self.recent.maxlen)

    def stale(self) -> bool:
        """Whether the timeout applied differs from :attr:`seconds` by more than 10 %."""
        return self.applied is None or abs(self.seconds - self.applied) > 0.1 * self.applied

    def apply(self) -> float:
        """Set :attr:`seconds` as the default process group's timeout (if one exists);
        returns it."""
        seconds = self.seconds
        if dist.is_available() and dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
            log.debug("training-step collective timeout now %.1f s", seconds)
        self.applied = seconds
        return seconds


def predicted_step_s(allocation: Any) -> float:
    """The step time an allocation predicts: its slowest rank's samples over its measured
    samples/s (0 when the split was not computed from measured speeds: forced, or equal)."""
    rates = list(getattr(allocation, "throughputs", ()) or ())
    if (
        allocation.source not in ("cost_curve", "throughput", "rebalanced")
        or len(rates) != len(allocation.shares)
        or min(rates, default=0.0) <= 0
    ):
        return 0.0
    return max(s.samples / r for s, r in zip(allocation.shares, rates))


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
            sharding) for :func:`~hetseq_hpc.train.elastic_sharded.reload_sharded`.
        static_for: under FSDP, ``world size -> bytes`` of model state a rank holds
            (:func:`~hetseq_hpc.balance.memory.model_state_bytes`): the survivors' micro-batch
            caps are recomputed for it (:func:`~hetseq_hpc.train.elastic_sharded.reports_for_world`).
    """

    def __init__(
        self,
        run: Any,
        store: Any,
        rdv: Rendezvous,
        reports: Sequence[Any],
        device: torch.device,
        rebuild: Optional[Callable[[], Any]] = None,
        static_for: Optional[Callable[[int], float]] = None,
    ):
        self.run, self.store, self.device, self.rebuild = run, store, device, rebuild
        self.static_for = static_for  # FSDP: a rank's model state at a world size, bytes
        self.split_reports: List[Any] = []
        self.cfg = run.trainer.elastic
        self.member = rdv.world.rank
        self.origin = rdv.world
        self.reports = [RankReport.of(r) for r in reports]
        self.membership = Membership(0, tuple(range(rdv.world.world_size)))
        self.heartbeat = Heartbeat(store, self.member, watch=range(rdv.world.world_size))
        self.retried_at: Optional[Tuple[int, int]] = None  # (step, phase) redone, nobody lost
        self.timeout = StepTimeout(self.cfg.timeout_s)
        self.timed_size = rdv.world.world_size  # the world the measured step times are of
        self.phase_timeouts = PhaseTimeouts(run.cluster.collective_timeout_s)  # validation, ...
        self.events: List[Dict[str, Any]] = []

    def close(self) -> None:
        """Stop the heartbeat (the rank is done)."""
        self.heartbeat.close()

    def arm(self) -> None:
        """Say, in the job's store, that this rank is in the training loop and recovers from a
        lost peer from now on (:func:`~hetseq_hpc.distributed.membership.arm`): before every
        rank has, the local launcher ends the run when a rank dies (a start-up collective
        would wait ``cluster.collective_timeout_s`` for it)."""
        arm(self.store, self.member)

    def recover(self, trainer: Any, error: BaseException) -> Dict[str, Any]:
        """Re-form the world after ``error`` (a collective of the training loop failed) and
        make ``trainer`` ready to redo what was interrupted (every survivor calls this): its
        ``step`` and ``phase`` (:mod:`hetseq_hpc.train.phases`) are those agreed by the
        survivors. Returns the membership event (its ``recovery_s`` is filled in by the caller
        once the next step completes, from ``lost_monotonic``).

        A rank lost WHILE the survivors re-form (a node's ranks die some hundred ms apart)
        makes a collective of the re-forming fail in turn (the new world cannot form: a
        ``DistStoreError`` after ``trainer.elastic.timeout_s``, or a closed socket): the
        survivors re-form again from the world they had agreed on, as often as ranks are
        lost, and the event names every rank lost since ``error``.

        Raises:
            RankExcluded: the others went on without this rank.
            Preempted: fewer than ``trainer.elastic.min_ranks`` survived, or the global batch
                no longer fits them: the last completed step was checkpointed first (code
                REQUEUE: a Slurm job is requeued and resumes from it).
            LaunchError: the survivors could not agree on a new world in
                ``cluster.collective_timeout_s``.
            the original ``error``: nobody was lost and the same step failed again.
        """
        failed = time.monotonic()
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
        trainer: Any,
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
        sharded = trainer.parallel.sharded
        if not in_step:  # no asynchronous work in flight (destroying a group waits for it)
            drop_groups(trainer, error)
        leave()
        if not in_step:
            gc.collect()  # the broken groups are destroyed now: their sockets close
        new = reform(
            self.store,
            self.heartbeat,
            self.member,
            old,
            stale_s=self.cfg.timeout_s / 2.0,
            timeout_s=self.run.cluster.collective_timeout_s,
        )
        self.membership = new  # a failure from here on re-forms from this generation
        lost = [m for m in start.members if m not in new.members]
        if not [m for m in old.members if m not in new.members]:
            if self.retried_at == at:
                raise _FailedAgain(error)
            self.retried_at = at
            self.phase_timeouts.forget()  # a slow phase, not a hang: the redo waits longer
        join_generation(self.store, new, self.member, backend_for(self.device), self.cfg.timeout_s)
        world = dataclasses.replace(
            self.origin, rank=new.rank_of(self.member), world_size=len(new.members)
        )
        rdv = Rendezvous(
            world=world,
            cpu_group=dist.new_group(
                backend="gloo", timeout=timedelta(seconds=self.run.cluster.collective_timeout_s)
            ),
        )
        if sharded:  # the lost shard is gone: the survivors go back to the last checkpoint
            trainer.phase = DONE
        else:
            self._agree_progress(trainer, rdv)
        event = {
            "event": "membership",
            "step": step,
            "generation": new.generation,
            "lost": [{"rank": m, "host": self.reports[m].world.get("node_name", "")} for m in lost],
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
            event.update(
                reload_sharded(trainer, rdv, metas, allocation, self._rebuild, self.split_reports)
            )
        else:
            rejoin(trainer, rdv, metas, allocation)
        self.timeout.predict(predicted_step_s(allocation))
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

    def _rebuild(self) -> Any:
        """A fresh seeded model for :func:`reload_sharded`.

        Raises:
            RuntimeError: no ``rebuild`` was given (a programming error of the caller).
        """
        if self.rebuild is None:
            raise RuntimeError("ElasticWorld(rebuild=...) is needed to recover an FSDP run")
        return self.rebuild()

    def _agree_progress(self, trainer: Any, rdv: Rendezvous) -> None:
        """Every survivor at the most advanced survivor's step (its full state, step record and
        row sent to those behind), and at the earliest phase of it some survivor did not
        complete (:mod:`hetseq_hpc.train.phases`): that phase is redone by all."""
        marks = rdv.all_gather_objects((int(trainer.step), int(trainer.phase)))
        top = max(s for s, _ in marks)
        # a survivor behind never started the work after ``top``: it redoes it from the start
        trainer.phase = min(p if s == top else TRAINED for s, p in marks)
        if all(s == top for s, _ in marks):
            return
        source = [s for s, _ in marks].index(top)
        mine = rdv.world.rank == source
        box = [(trainer.state_dict(), trainer.history[-1], trainer.last_row) if mine else None]
        dist.broadcast_object_list(box, src=source, group=rdv.cpu_group)
        if trainer.step != top:
            state, rec, row = box[0]
            trainer.load_state_dict(state, f"the state of surviving rank {source}")
            trainer.history.append(rec)
            trainer.last_row = row
        log.info("step %d was completed by some survivors: all now continue from it", top)

    def _stop(self, trainer: Any, rdv: Rendezvous, event: Dict[str, Any], why: str) -> None:
        """Checkpoint the last completed step (the new rank 0 writes it, with the step's row
        and the membership event if missing) and stop with code REQUEUE, as a preemption does:
        a Slurm job is requeued and resumes from it. Under FSDP the lost shard is gone: no
        checkpoint is written, the requeue resumes from the last one on disk."""
        if trainer.parallel.sharded:
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
                log_before_stop(trainer, {**event, "stopped": why})
            raise Preempted(step, REQUEUE, why, leader=rdv.world.rank == 0)
        log.warning(
            "step %d: %s: checkpointing step %d and stopping", event["step"], why, trainer.step
        )
        if rdv.world.rank == 0:
            log_before_stop(trainer, {**event, "stopped": why})
        trainer.checkpoints.save_on_rank0(trainer.step, rdv, trainer.state_dict)
        raise Preempted(trainer.step, REQUEUE, why, leader=rdv.world.rank == 0)

    def expect(self, allocation: Any) -> None:
        """A split starts (the first, or a re-formed world's): its predicted step time sets
        the training-step collective timeout (:class:`StepTimeout`)."""
        if self.timeout.predict(predicted_step_s(allocation)):
            self.timeout.apply()

    def observe_step(self, rec: Any) -> None:
        """After a completed step: its time sets the collective timeout of the next steps
        (:class:`StepTimeout`)."""
        longest = max([rec.wall_s, *(s.step_time_s for s in rec.per_rank)])
        if self.timeout.observe(longest):
            self.timeout.apply()

    def _split(self, rdv: Rendezvous, members: Sequence[int]) -> Any:
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
    """``Type: first line of the message`` (at most 200 characters) for a log line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


def drop_groups(trainer: Any, error: BaseException) -> None:
    """Drop this rank's references to the broken process groups (the DDP wrapper, the gloo
    group of the rendezvous, the failed step's frames), so that once they are destroyed their
    sockets close: a survivor still blocked in a collective with this rank (not with the lost
    one: it finished an earlier phase) fails at once instead of after its timeout. Aborting a
    gloo group does not unblock its peers; closing its sockets does. Only outside a training
    step: destroying a group with work in flight (DDP's all-reduce) blocks, GIL held."""
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)
    trainer.parallel.module = trainer.parallel.model  # the bare model; rejoin() wraps it again
    if trainer.rdv is not None:
        trainer.rdv.cpu_group = None  # the worker holds this Rendezvous too


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
    trainer.parallel = build_parallel(
        trainer.run, trainer.task, trainer.parallel.model, trainer.device, "ddp"
    )
    trainer.parallel.start(trainer.grad_path, trainer.hook_state)
    if trainer.on_allocation is not None:
        trainer.on_allocation(allocation, {"members": list(trainer.elastic.membership.members)})
