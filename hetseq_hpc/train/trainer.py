"""The Trainer: one rank's training with exact gradients for uneven per-rank batches (DDP, or
FSDP2 under ``sharding.mode=fsdp``: :mod:`hetseq_hpc.train.parallel`, the strategies).

One optimizer step on every rank: its slice of global batch ``k``, forward+backward of every
micro-batch on the SUM of its unit losses, the gradients summed across ranks and divided by the
GLOBAL unit count, clipped, then AdamW. After it, in phases an in-job recovery can redo
(:mod:`hetseq_hpc.train.recovery`): the re-balancing decision, validation, the step's row, the
checkpoint (:mod:`hetseq_hpc.train.checkpoint`). The six rules of a step and why they make a
resumed run repeat an uninterrupted one: docs/design/exact-gradients.md, "The training step".
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetseq_hpc.balance.agree import RankReport
from hetseq_hpc.balance.allocation import Allocation
from hetseq_hpc.balance.rebalance import Rebalancer
from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.distributed.admission import join_requests
from hetseq_hpc.distributed.gang import Gang, StatsInFlight
from hetseq_hpc.distributed.membership import is_peer_failure
from hetseq_hpc.distributed.rendezvous import StepStats
from hetseq_hpc.env.preemption import REASONS, StopRequest
from hetseq_hpc.errors import NonFiniteLoss, Preempted
from hetseq_hpc.rundir.events import append_event
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.contract import check_loss, checked_batch, checked_count
from hetseq_hpc.train.batches import BatchKey, BatchPrefetcher
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, require_entries
from hetseq_hpc.train.compile import compiled_graphs, compiles, eager
from hetseq_hpc.train.ddp_hooks import HookState
from hetseq_hpc.train.evaluate import evaluate_task
from hetseq_hpc.train.fsdp_accumulation import agree_on_accumulation
from hetseq_hpc.train.metrics.loggers import first_logged_loss, open_loggers
from hetseq_hpc.train.metrics.rows import run_summary, step_row
from hetseq_hpc.train.metrics.step_log import StepLog, logged_steps
from hetseq_hpc.train.nonfinite import first_nonfinite, gradient_error, nonfinite_error
from hetseq_hpc.train.optim import apply_configured_lr, build_optimizer, peak_lr, step_seed
from hetseq_hpc.train.parallel import Replicated, build_parallel, rank_memory
from hetseq_hpc.train.precision import GradientPath
from hetseq_hpc.train.readout import PendingStep
from hetseq_hpc.train.records import (
    DONE,
    EVALUATED,
    LOGGED,
    REBALANCED,
    TRAINED,
    RankMeta,
    StepHistory,
    StepRecord,
)
from hetseq_hpc.train.recovery.elastic import ElasticWorld
from hetseq_hpc.train.recovery.grow import admit
from hetseq_hpc.train.recovery.sharded import checkpoint_to_reload
from hetseq_hpc.train.sampler import GlobalBatchSampler
from hetseq_hpc.train.state import capture_rng, check_fingerprint, restore_rng, run_fingerprint

log = logging.getLogger(__name__)


class Trainer:
    """Runs optimizer steps ``step+1 .. trainer.max_steps`` on one rank (:meth:`fit`), each
    followed by its phases (:meth:`advance`); the state in-job recovery works on
    (:class:`~hetseq_hpc.train.recovery.state.TrainState`).

    Args:
        run: the validated run configuration.
        run_dir: the run directory (checkpoints, metrics.jsonl).
        rdv: the joined rendezvous (:func:`hetseq_hpc.distributed.rendezvous.single_process_rendezvous`
            makes a one-rank one for tests).
        task: the task (data, batches, unit counts).
        model: the bare model, already on ``device`` and identically initialised on all ranks.
        device: this rank's device.
        allocation: the agreed allocation.
        metas: :class:`RankMeta` of every rank, in rank order.
        autocast: factory of the mixed-precision context.
        rebalancer: optional online re-balancer (``record(per_rank)``, ``observe(step,
            allocation) -> Optional[Allocation]``), consulted every ``balance.rebalance_interval``
            steps.
        on_allocation: called with every new allocation a re-balance switches to (and, after
            a re-formed world, with ``{"members": [...]}``).
        stop_request: a :class:`~hetseq_hpc.env.preemption.StopRequest` (its ``code`` is shared with
            every rank each step).
        sharding: ``ddp`` or ``fsdp``, the same on every rank
            (:func:`hetseq_hpc.balance.agree.agree_on_sharding`), when ``parallel`` is None.
        parallel: the strategy already built by the worker
            (:func:`hetseq_hpc.train.parallel.build_parallel`: the model sharded before the
            contract check and calibration); None = build it here.
        elastic: a :class:`~hetseq_hpc.train.recovery.elastic.ElasticWorld` (in-job recovery
            from a lost rank), or None (a failed collective ends the run).
        joined: a replacement rank's state received from a survivor
            (:func:`hetseq_hpc.train.recovery.grow.join_running_job`): the run goes on from
            it instead of resuming from the run directory.

    Raises:
        CheckpointError: the checkpoint ``trainer.resume`` names is bad, or none of the run
            directory's verifies, or it does not fit this run.
    """

    def __init__(
        self,
        run: RunConfig,
        run_dir: RunDir,
        rdv: Gang,
        task: Task,
        model: nn.Module,
        device: torch.device,
        allocation: Allocation,
        metas: List[RankMeta],
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        rebalancer: Optional[Rebalancer] = None,
        on_allocation: Optional[Callable[..., None]] = None,
        stop_request: Optional[StopRequest] = None,
        sharding: str = "ddp",
        parallel: Optional[Replicated] = None,
        elastic: Optional[ElasticWorld] = None,
        joined: Optional[Dict[str, Any]] = None,
    ):
        # the run, this rank's place in the world, and what it trains
        self.run = run
        self.cfg = run.trainer
        self.run_dir = run_dir
        self.rdv = rdv
        self.world = rdv.world
        self.rank = rdv.world.rank
        self.task = task
        self.model = model
        self.device = device
        self.allocation = allocation
        self.metas = self.metas_by_member = metas  # the latter by original rank, for ever
        self.elastic = elastic
        self.autocast = autocast
        self.rebalancer = rebalancer
        self.on_allocation = on_allocation
        self.stop_request = stop_request
        # what a checkpoint must share with the run that resumes it
        digest = getattr(task, "data_fingerprint", lambda: None)()  # may differ per prepare
        self.fingerprint = {
            **run_fingerprint(run),
            **({"data.fingerprint": digest} if digest else {}),
        }
        # data order -> gradient path -> strategy -> optimizer -> checkpoints
        self.sampler = GlobalBatchSampler(task.num_train, self.cfg.global_batch_size, self.cfg.seed)
        self.reset_gradient_path()
        # DDP or FSDP2 (train/parallel.py); FSDP shards the model in place, before the optimizer
        self.parallel = parallel or build_parallel(
            run, task, model, device, sharding, [m.precision for m in metas]
        )
        # trainer.compile: this rank's units compiled in place (train/compile.py), and whether
        # any rank's are (the same answer on every rank: the first step of a split may compile)
        self.compiled = compiles(self.cfg.compile, device)
        self.graphs = 0  # graphs compiled for this Trainer when the last step ended
        self._graphs_before = compiled_graphs() if self.compiled else 0  # by others before
        self.optimizer, self.scheduler = build_optimizer(model, run)
        self.checkpoints = CheckpointManager(
            self.run_dir,
            self.cfg.keep_checkpoints,
            self.cfg.checkpoint_async,
            run.cluster.collective_timeout_s,
        )
        # events.jsonl marks a checkpoint once its record is in place (a background write's
        # thread marks it when done: an abandoned or failed write is never marked)
        self.checkpoints.on_written = self._mark_checkpoint
        # where the run stands
        self.step = 0  # last completed optimizer step; global batch ``step`` comes next
        self.phase = DONE  # of ``step``: what of the work after it is done (train/records.py)
        self.last_row: Dict[str, Any] = {}  # metrics row of ``step``
        self.history = StepHistory()  # this run's step records, the oldest folded
        self._exchanged_at = 0.0  # perf_counter() when the last step's exchange ended
        self.last_val: Optional[Dict[str, float]] = None
        self.resume_note: Dict[str, Any] = {}
        self.run_id = ""  # this run's id (rundir/history.py), decided by _resume()
        self.resumed_from: Optional[str] = None  # the checkpoint the run started from
        self.saved_step: Optional[int] = None  # the step of the last checkpoint on disk
        self.step_log: Optional[StepLog] = None  # rank 0's rows, while fit() runs
        # step k+1's batches built while step k runs (train/batches.py)
        self.batches = BatchPrefetcher(self._build_batches, pin=device.type == "cuda")
        # a step whose loss and norm are still on the device (read one step late) and the
        # row it owes (train/readout.py, docs/design/exact-gradients.md "No host sync")
        self.pending: Optional[PendingStep] = None
        self.owed_row: Optional[PendingStep] = None
        # the rows of the last two steps, on every rank: a new rank 0 writes those its lost
        # predecessor owed (one step late, the row of the step before too)
        self.recent_rows: Deque[Tuple[StepRecord, Dict[str, Any]]] = deque(maxlen=2)
        self.deferring = False  # fit()'s steps leave their results on the device a step
        # grow back: join requests seen in the last step's exchange; a newcomer's join row
        self.joins_seen = 0
        self.join_event: Optional[Dict[str, Any]] = None
        # resume (or start) the run, or take a survivor's state, then wrap the model
        if joined is None:
            self._resume()
        else:
            self._adopt(joined)
        self.parallel.start(self.grad_path, self.hook_state)

    def reset_gradient_path(self) -> None:
        """The gradient path and hook state of this world (loss scale normaliser: the
        expected units of a global batch)."""
        self.grad_path = GradientPath(
            self.run.comm,
            [m.precision for m in self.metas],
            self.rank,
            self.world.world_size,
            self.cfg.global_batch_size * float(getattr(self.task, "units_per_sample", 1.0)),
        )
        self.hook_state = HookState()

    # ------------------------------------------------------------------ state
    def state_dict(self, tensors: bool = True) -> Dict[str, Any]:
        """Everything a resumed run needs, as plain data (``torch.load(weights_only=True)``
        reads it): model, optimizer and scheduler states, ``step`` (the sampler's position),
        the allocation and rank facts (informative: a resume may use another world), the
        run's :func:`~hetseq_hpc.train.state.run_fingerprint` and this process's RNG states.
        ``tensors=False``: without the model and optimizer (a sharded checkpoint's record)."""
        full = (
            {
                "model": self.parallel.model_state(),  # full, also under FSDP (gathered)
                "optimizer": self.parallel.optimizer_state(self.optimizer),
            }
            if tensors
            else {}
        )
        return {
            **full,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "epoch": self.sampler.epoch_of(max(self.step - 1, 0)),
            "samples_seen": self.step * self.cfg.global_batch_size,
            "world_size": self.world.world_size,
            "allocation": self.allocation.to_dict(),
            "ranks": [dict(m.__dict__) for m in self.metas],
            "config": self.fingerprint,
            "run_id": self.run_id,  # retention and resume consider only this run's checkpoints
            # dropout is re-seeded from (seed, step, rank) every step; these are kept for
            # anything else that draws random numbers
            "rng": capture_rng(),
            "loss_scale": self.grad_path.loss_scale.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any], source: str = "state") -> None:
        """Continue after ``state["step"]`` from a :meth:`state_dict` (of any world size).

        Raises:
            CheckpointError: an entry is missing, the run's fingerprint differs (unless
                ``trainer.allow_resume_mismatch``), or the model has another shape; one line
                naming ``source``.
        """
        require_entries(state, source)
        check_fingerprint(
            state.get("config"), self.fingerprint, source, self.cfg.allow_resume_mismatch
        )
        self.parallel.load_state(self.optimizer, state, source)
        self.scheduler.load_state_dict(state["scheduler"])
        before = apply_configured_lr(self.optimizer, self.scheduler, peak_lr(self.run))
        if before is not None:
            log.info(
                "optim.lr=%g (the checkpoint's was %g): the schedule goes on from step %s "
                "with the new peak",
                peak_lr(self.run),
                before,
                state["step"],
            )
        self.grad_path.loss_scale.load_state_dict(state.get("loss_scale") or {})
        self.step = int(state["step"])
        if self.rank == 0 and "rng" in state:
            restore_rng(state["rng"])

    def _resume(self) -> None:
        path, state, skipped = self.checkpoints.load(self.cfg.resume, self.rdv)
        self.run_id = self.checkpoints.agree_on_run(state, self.rdv)
        if path is None or state is None:
            return
        self.load_state_dict(state, path)
        self.resumed_from, self.saved_step = path, self.step
        if skipped:  # recorded in the first metrics.jsonl row
            self.resume_note = {"resume_fallback": {"bad": skipped, "used": path}}
        if self.rank == 0 and self.step < self.cfg.max_steps:  # the report marks it: the
            # split may change here (a finished run is not resumed: its files stay as they are)
            append_event(
                self.run_dir,
                "resume",
                step=self.step,
                checkpoint=str(path),
                world_size=self.world.world_size,
                allocation=list(self.allocation.samples),
                run_id=self.run_id,
                **({"refused": list(skipped)} if skipped else {}),
            )
        log.info(
            "resumed from %s at step %d (allocation now %s on %d ranks)",
            path,
            self.step,
            self.allocation.samples,
            self.world.world_size,
        )

    def _adopt(self, sent: Dict[str, Any]) -> None:
        """A replacement rank: go on from the state a survivor sent
        (:func:`hetseq_hpc.train.recovery.grow.join_running_job`), as its predecessor would."""
        self.load_state_dict(sent["state"], "the running job's state")
        self.history = sent["history"]
        self.last_row, self.last_val = dict(sent["last_row"]), sent["last_val"]
        self.run_id, self.saved_step = sent["run_id"], sent["saved_step"]
        self.resumed_from = sent["resumed_from"]
        self.metas_by_member = list(sent["metas"])

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, Any]:
        """Train to ``trainer.max_steps``; returns a summary (final loss, validation, throughput).

        With :attr:`elastic`, a collective that fails anywhere in the loop (a step, the
        re-balancing decision, validation, a checkpoint, the summary) is recovered from
        (:meth:`ElasticWorld.recover`): what was interrupted is redone over the survivors.

        Raises:
            Preempted: a stop request arrived; every rank stopped after the same step, which
                was checkpointed (also: fewer than ``trainer.elastic.min_ranks`` survived).
            NonFiniteLoss: the loss of a step was NaN or inf on some rank (the last good step
                was checkpointed first; :mod:`hetseq_hpc.train.nonfinite`).
        """
        cfg = self.cfg
        if self.rank == 0:  # the learning rate, its origin and schedule, on every run
            log.info("optimizer: %s", self.run.optim.describe(cfg.max_steps, self.run.random_init))
        if self.step >= cfg.max_steps:
            log.info(
                "checkpoint is at step %d >= trainer.max_steps=%d: nothing to train",
                self.step,
                cfg.max_steps,
            )
        self.step_log = StepLog(
            self.run,
            self.run_dir,
            self.step,
            self.rank,
            self.resume_note,
            joined=self.join_event is not None,
        )
        if self.join_event is not None:  # a newcomer: its join row goes with its first step
            self.step_log.events.append(self.join_event)
        self._fit_started = (time.perf_counter(), self.step)  # the wall-clock rate's start
        self.deferring = True
        if self.elastic is not None:
            # the step's collective timeout; the first step of a compiled run compiles
            self.elastic.expect(self.allocation, compiling=self.any_compiles())
            self.elastic.arm()  # a lost peer is recovered from now on
        summary = None
        try:
            while summary is None:
                try:
                    if self.step < cfg.max_steps or self.phase < DONE:
                        self.advance()
                    else:
                        summary = self.summary()
                except RuntimeError as exc:  # a peer died or hung (torch's DistError too)
                    if self.elastic is None or not is_peer_failure(exc):
                        raise
                    self.settle_pending(gather=False)  # its values are on this device
                    # re-form, agree on the last completed step and phase, redo from there
                    self._recovered(self.elastic.recover(self, exc))
            self.step_log.flush_events(self.run_id)  # a recovery after the last step
        finally:
            self.deferring = False
            self.batches.close()
            self.step_log.close()
            error = self.checkpoints.drain()  # leaving early: the pending write ends first
            if error:
                log.error("%s", error)
        if self.rank == 0 and self.history:  # the run's first step, also after a resume
            summary["first_loss"] = first_logged_loss(self.run_dir) or summary["first_loss"]
        return summary

    def advance(self) -> None:
        """Train the next step if the last one is done, then do the phases of :attr:`step`
        not done yet, each of which may hold a collective: the re-balancing decision,
        validation (when due), the step's row (rank 0), the checkpoint (when due).
        :attr:`phase` says which was completed last: a recovery redoes from the earliest one
        a survivor did not complete.

        Raises:
            Preempted: a stop request was seen in the step's exchange (after its checkpoint).
            NonFiniteLoss: the step's loss is NaN or inf on some rank; the last good step was
                checkpointed (:meth:`keep_good_steps`).
            RuntimeError: a collective failed (a peer lost: :meth:`fit` recovers).
        """
        cfg, step_log = self.cfg, self._step_log()
        if self.phase == DONE:
            try:
                # the step's statistics exchange (the gloo group) waits the step's timeout,
                # as its gradient all-reduce does: a rank stopped between the two is noticed
                with self.decision_timeout():
                    rec = self.train_step(self.step + 1)  # read late: fit() sets deferring
            except NonFiniteLoss as exc:
                raise NonFiniteLoss(f"{exc}; {self.keep_good_steps()}", exc.step) from None
            self.write_owed_row()  # the previous step's, read during this one
            self.phase = TRAINED
            self.history.append(rec)
            rec.extra.update(step_log.take_note())
            # with the split that ran the step (a re-balance below may change it)
            self.last_row = step_row(
                rec,
                self.metas,
                self.allocation.shares,
                cfg.global_batch_size,
                self.task.tokens_per_sample,
                self.allocation.samples,
                units_per_sample=self.task.units_per_sample,
            )
            if self.elastic is not None:
                self.elastic.observe_step(rec)
            if self.compiled:
                self.count_graphs(rec)
            step_log.flush_events(self.run_id)  # the next completed step after a recovery
        rec, step = self.history[-1], self.step
        is_last = step == cfg.max_steps
        if self.phase < REBALANCED:
            self.maybe_rebalance(rec)
            self.phase = REBALANCED
        if self.phase < EVALUATED:
            if (cfg.val_every and step % cfg.val_every == 0) or is_last:
                self._settle_or_stop()  # validate the model only after a step that was applied
                with self.phase_timeout("validation"):
                    self.last_val = self.evaluate()
                rec.extra.update(self.last_val)
            self.phase = EVALUATED
        if self.phase < LOGGED:
            row = self._row(rec)
            if self.recent_rows and self.recent_rows[-1][0] is rec:  # redone after a recovery
                self.recent_rows.pop()
            self.recent_rows.append((rec, row))
            if self.pending is not None and self.pending.rec is rec:  # read with the next step
                self.pending.row, self.pending.last_val = row, self.last_val
                self.owed_row = self.pending
            else:
                step_log.log(rec, step, row, self.last_val)
            self.phase = LOGGED
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or is_last or rec.stop_code:
            self._settle_or_stop()  # a checkpoint holds an applied step, after its row
            with self.phase_timeout("checkpoint"):
                self._save(step, wait=is_last or bool(rec.stop_code))
        self.phase = DONE
        if (
            self.elastic is not None
            and self.joins_seen > self.elastic.joins_answered
            and not rec.stop_code
            and not is_last
        ):  # a replacement rank asked to join: every rank saw it in this step's exchange
            event = admit(self.elastic, self, self.joins_seen)
            if event is not None:
                self._recovered(event)
        if rec.stop_code and not is_last:
            # every rank saw the same request in the step's exchange: all stop here
            reason = REASONS.get(rec.stop_code, "a stop request")
            if step_log.writer is not None:
                append_event(
                    self.run_dir,
                    "stop",
                    step=step,
                    code=rec.stop_code,
                    reason=reason,
                    run_id=self.run_id,
                )
            raise Preempted(step, rec.stop_code, reason)

    def _settle_or_stop(self) -> None:
        """:meth:`settle_pending`; a bad step checkpoints the last good one and stops.

        Raises:
            NonFiniteLoss: as :meth:`train_step`, with what :meth:`keep_good_steps` kept.
        """
        try:
            self.settle_pending()
        except NonFiniteLoss as exc:
            raise NonFiniteLoss(f"{exc}; {self.keep_good_steps()}", exc.step) from None

    def _step_log(self) -> StepLog:
        """The :class:`StepLog` of the running :meth:`fit`.

        Raises:
            RuntimeError: outside :meth:`fit` (a programming error of the caller).
        """
        if self.step_log is None:
            raise RuntimeError("Trainer.advance() runs inside Trainer.fit() only")
        return self.step_log

    def _row(self, rec: StepRecord) -> Dict[str, Any]:
        """The ``metrics.jsonl`` row of the step ``rec`` recorded: :attr:`last_row`, the run id
        and the record's extra fields (validation, notes)."""
        return {**self.last_row, "run_id": self.run_id, **rec.extra}

    def _recovered(self, event: Dict[str, Any]) -> None:
        """After a recovery: its event waits for the next completed step; the new rank 0's
        loggers open at the agreed step and write the rows a lost rank 0 may have owed
        (:meth:`StepLog.recovered`: the last two steps' rows, each written once)."""
        kept = {id(r) for r in self.history[-2:]}
        owed = [(rec, row) for rec, row in self.recent_rows if id(rec) in kept]
        self._step_log().recovered(event, self.rank, self.step, self.phase >= LOGGED, owed)

    # ------------------------------------------------------------------ one step
    def _compute_seconds(self, t0: float, start_event, late: Optional[PendingStep]) -> float:
        """This step's compute time; on a GPU read with a synchronisation (``late`` None), or
        the previous step's from its CUDA events (read one step late, no synchronisation)."""
        if self.device.type == "cuda" and self.hook_state.events and start_event is not None:
            if late is not None:
                seconds = late.compute_seconds()
                if seconds is not None:
                    return seconds
            else:
                torch.cuda.synchronize(self.device)
                return start_event.elapsed_time(self.hook_state.events[-1]) / 1000.0
        return (self.hook_state.last_ready_s or time.perf_counter()) - t0

    def batch_key(self, step: int) -> BatchKey:
        """What step ``step``'s micro-batches on this rank are built from, under the current
        split: ``(step, epoch, positions of each real micro-batch, zero-weight passes)``."""
        share = self.allocation.shares[self.rank]
        offset = self.allocation.offsets()[self.rank]
        sizes, padding = self.parallel.pass_sizes(share, self.allocation.shares)
        epoch, micro = self.sampler.rank_micro_batches(step - 1, offset, sizes)
        return step, epoch, tuple(tuple(int(i) for i in p) for p in micro), padding

    def _build_batches(self, key: BatchKey) -> Tuple[List[Dict[str, torch.Tensor]], List[int]]:
        """The batches of ``key`` on the CPU and each real one's unit count (the background
        thread of :class:`BatchPrefetcher` runs it)."""
        _, epoch, micro, padding = key
        batches = [checked_batch(self.task, list(p), epoch, "train") for p in micro]
        counts = [checked_count(self.task, b) for b in batches]
        # zero-weight passes (FSDP: the same number of passes on every rank)
        if padding:  # (built only when needed: ``[x] * 0`` still builds x)
            batches += [checked_batch(self.task, list(micro[0][:1]), epoch, "train")] * padding
        return batches, counts

    def can_defer(self) -> bool:
        """Whether a step may leave its loss and norm on the device (read one step late): a
        replicated (DDP) or sharded (FSDP: the norm all-reduced on the device from the shards)
        model on the plain sum path with the fused optimizer, whose ``found_inf`` skips a bad
        update on the device. The fp16 loss scale decides its skip on the host, and FSDP with
        ``sharding.cpu_offload`` keeps its shards (and their norm) on the CPU, the loss on the
        GPU: those read every step."""
        return (
            not self.grad_path.loss_scale.enabled
            and not getattr(self.parallel, "offload", False)
            and bool(self.optimizer.defaults.get("fused"))
        )

    def train_step(self, step: int, settle: Optional[bool] = None) -> StepRecord:
        """Run optimizer step ``step`` (1-based) and return what all ranks agree on.

        ``settle=False`` (the default inside :meth:`fit`, :attr:`deferring`; only when
        :meth:`can_defer`): nothing in the step waits for the device. The step's loss and gradient norm stay on it and its
        record holds NaN for them until the next step (or the step's validation, checkpoint
        or stop) reads them (:attr:`pending`); a non-finite loss or norm skips the update on
        the device. ``settle=True``: they are read before the update, as every step did.

        Raises:
            NonFiniteLoss: some rank's loss was NaN or inf (every rank raises it, at the same
                step): the step's update was not applied, :attr:`step` is still the last
                good one (:mod:`hetseq_hpc.train.nonfinite`). A step read one step late raises
                in the next one, naming itself.
        """
        if settle is None:
            settle = not self.deferring
        settle = settle or not self.can_defer()
        late = self.pending  # the previous step's results, read below (kept until then)
        share = self.allocation.shares[self.rank]
        t0 = time.perf_counter()
        key = self.batch_key(step)
        prepared = self.batches.take(key)
        if step < self.cfg.max_steps:  # built while this step runs
            self.batches.prefetch(self.batch_key(step + 1))
        data_s = time.perf_counter() - t0
        joins = (  # grow back: rank 0 looks for join requests (one store round trip)
            join_requests(self.elastic.store)
            if self.elastic is not None and self.cfg.elastic.restarts and self.rank == 0
            else 0
        )
        n_real = len(key[2])
        count = sum(prepared.counts)  # known on the CPU before any copy
        torch.manual_seed(step_seed(self.cfg.seed, step, self.rank))
        self.hook_state.reset()
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        module = self.parallel.module
        module.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        global_sum = loss_sum
        reduced: Any = None
        posted: List[StatsInFlight] = []
        losses: List[torch.Tensor] = []  # each micro-batch's, to name a non-finite one

        def stats() -> StepStats:
            total = loss_sum.item() if settle else 0.0  # deferred: read with the step
            return StepStats(
                loss_sum=total,
                count=count,
                samples=share.samples,
                compute_time_s=self._compute_seconds(t0, start_event, None if settle else late),
                step_time_s=time.perf_counter() - t0,
                data_time_s=data_s,
                stop_code=self.stop_request.code if self.stop_request is not None else 0,
                tail_time_s=t0 - self._exchanged_at if self._exchanged_at else 0.0,
                bad_micro=0 if math.isfinite(total) else first_nonfinite(losses),
                joins=joins,
            )

        units = 0
        for j, batch in enumerate(prepared.batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            real = j < n_real
            units += prepared.counts[j] if real else 0
            sync = j == len(prepared.batches) - 1
            with self.parallel.sync(sync), self.autocast():
                loss = check_loss(self.task, module(**batch))
            if real:
                loss_sum += loss.detach().double()
                losses.append(loss.detach())
            else:
                loss = loss * 0.0  # a pass only for FSDP's collectives: the gradient adds 0
            if sync and not settle and self.world.world_size > 1:
                # the global loss sum on the device (its non-finite check skips the update
                # there), reduced while the last backward pass runs
                global_sum = loss_sum.clone()
                reduced = dist.all_reduce(
                    global_sum, group=self.hook_state.process_group, async_op=True
                )
            if sync and self.device.type == "cpu":
                # post the statistics when the last gradient bucket is ready, so that their
                # exchange overlaps the gradient all-reduce (on a GPU the compute time is known
                # only after a synchronisation: they go after the backward pass there)
                self.hook_state.on_last = lambda: posted.append(self.rdv.post_step_stats(stats()))
            self.grad_path.backward(loss, step, self.hook_state, units)
        if not self.parallel.sharded and not self.parallel.wrapped:
            self.hook_state.mark_ready(loss_sum)  # one rank, no DDP hook: the backward ended
        self.hook_state.on_last = None
        table = (posted[0] if posted else self.rdv.post_step_stats(stats())).result()
        self._exchanged_at = time.perf_counter()
        self.joins_seen = max(self.joins_seen, *(s.joins for s in table))
        if late is not None:  # the previous step, read now that this one is queued
            self.pending = None
            self._read_pending(late)
        if settle and not all(math.isfinite(s.loss_sum) for s in table):
            # every rank sees it: all stop
            self.optimizer.zero_grad(set_to_none=True)  # the update is not applied
            raise nonfinite_error(
                step,
                table,
                step - 1,
                peak_lr(self.run),
                self.run.optim.warmup_steps,
                [m.precision or "fp32" for m in self.metas],
            )
        if reduced is not None:
            reduced.wait()
        global_count = sum(s.count for s in table)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # one multi-tensor kernel per op instead of a Python loop over the parameters: the
        # per-step fixed cost every rank pays, a slow one at its own speed
        factor = self.grad_path.unscale_factor(global_count)
        if self.grad_path.loss_scale.enabled:  # fp16: the scaled sums' norm might overflow
            torch._foreach_mul_(grads, factor)
            norm = self.parallel.grad_norm_tensor(self.cfg.grad_clip, grads)
        else:  # 1 / N and the clip coefficient in one pass over the gradients
            norm = self.parallel.scale_and_clip(factor, self.cfg.grad_clip, grads)
        lr = float(self.scheduler.get_last_lr()[0])
        restore = (
            self.scheduler.state_dict(),
            [float(g["lr"]) for g in self.optimizer.param_groups],
        )
        if self.grad_path.loss_scale.enabled:  # fp16: the host decides the skip
            if self.grad_path.step_ok(float(norm), step):  # False: overflow, on all ranks
                self.optimizer.step()
        else:
            if self.can_defer():  # a bad update is skipped on the device, in the kernel
                bad = ~(torch.isfinite(global_sum) & torch.isfinite(norm))
                # the fused kernel reads the optimizer's ``found_inf`` attribute (as GradScaler sets)
                setattr(self.optimizer, "found_inf", bad.to(torch.float32))  # noqa: B010
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        rec = StepRecord(
            step=step,
            epoch=key[1],
            loss=math.nan,
            lr=lr,
            grad_norm=math.nan,
            per_rank=table,
            wall_s=time.perf_counter() - t0,
            stop_code=max(s.stop_code for s in table),
            grad_path=self.grad_path.row(self.hook_state),
            ended_s=time.perf_counter(),
        )
        self.step = step
        if not settle:
            self.pending = PendingStep.capture(
                rec,
                global_sum,
                loss_sum,
                norm,
                losses,
                restore,
                (start_event, self.hook_state.events[-1] if self.hook_state.events else None),
            )
            return rec
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        rec.loss = sum(s.loss_sum for s in table) / global_count
        rec.grad_norm = float(norm)
        if not math.isfinite(rec.grad_norm) and self.can_defer():  # skipped on the device
            self._undo(rec, restore)
            raise gradient_error(step, rec.grad_norm, step - 1, peak_lr(self.run))
        rec.wall_s, rec.ended_s = time.perf_counter() - t0, time.perf_counter()
        return rec

    def _read_pending(self, late: PendingStep, gather: bool = True) -> None:
        """Fill ``late``'s record (and its row) with the values read from the host copy; a
        non-finite loss or norm (its update was skipped on the device) undoes the step's host
        state and raises.

        ``gather``: the world is whole, so every rank, which read the same global values,
        gathers every rank's loss sum for the error line (False: during a recovery, without).

        Raises:
            NonFiniteLoss: naming ``late``'s step, as a step read at once would.
        """
        rec = late.rec
        global_count = sum(s.count for s in rec.per_rank)
        rec.loss = late.global_loss_sum / max(global_count, 1)
        rec.grad_norm = late.norm
        mine = rec.per_rank[self.rank]
        rec.per_rank[self.rank] = replace(mine, loss_sum=late.local_loss_sum)
        if late.row is not None:
            late.row.update(loss=rec.loss, grad_norm=rec.grad_norm)
        if self.last_row.get("step") == rec.step:
            self.last_row.update(loss=rec.loss, grad_norm=rec.grad_norm)
        if math.isfinite(late.global_loss_sum) and math.isfinite(late.norm):
            return
        self._undo(rec, late.restore)
        if late is self.owed_row:
            self.owed_row = None  # a bad step has no row, as when it is read at once
        if gather:
            sums = self.rdv.all_gather_objects((late.local_loss_sum, late.bad_micro()))
            rec.per_rank = [
                replace(stats, loss_sum=value, bad_micro=bad)
                for stats, (value, bad) in zip(rec.per_rank, sums)
            ]
        else:
            rec.per_rank[self.rank] = replace(rec.per_rank[self.rank], bad_micro=late.bad_micro())
        if math.isfinite(late.global_loss_sum):
            raise gradient_error(rec.step, rec.grad_norm, rec.step - 1, peak_lr(self.run))
        raise nonfinite_error(
            rec.step,
            rec.per_rank,
            rec.step - 1,
            peak_lr(self.run),
            self.run.optim.warmup_steps,
            [m.precision or "fp32" for m in self.metas],
        )

    def _undo(self, rec: StepRecord, restore: Tuple[Dict[str, Any], List[float]]) -> None:
        """The host side of a step the device did not apply: gradients dropped, the scheduler
        and learning rates as before it, :attr:`step` the step before, its record gone."""
        self.optimizer.zero_grad(set_to_none=True)
        state, lrs = restore
        if state:
            self.scheduler.load_state_dict(state)
            for group, value in zip(self.optimizer.param_groups, lrs):
                group["lr"] = value
        self.step = rec.step - 1
        if self.history and self.history[-1] is rec:
            self.history.pop()

    def settle_pending(self, gather: bool = True) -> None:
        """Read the step left on the device now (before its validation, checkpoint, stop or a
        recovery) and write the row it owes (rank 0). ``gather``: see :meth:`_read_pending`.

        Raises:
            NonFiniteLoss: that step was bad (it was not applied).
        """
        late, self.pending = self.pending, None
        if late is not None:
            self._read_pending(late, gather)
        self.write_owed_row()

    def write_owed_row(self) -> None:
        """Write the row (and progress line) of a step that was read one step late."""
        owed, self.owed_row = self.owed_row, None
        if owed is not None and owed.row is not None and self.step_log is not None:
            self.step_log.log(owed.rec, owed.rec.step, owed.row, owed.last_val)

    # ------------------------------------------------------------------ the phases after a step
    def maybe_rebalance(self, rec: StepRecord) -> None:
        """Feed the re-balancer; every ``balance.rebalance_interval`` steps, or at once when
        it sees a speed change (:meth:`~hetseq_hpc.balance.rebalance.Rebalancer.speed_changed`,
        the same verdict on every rank), all ranks check they decided alike and switch
        together to its new allocation from the next step
        (:meth:`~hetseq_hpc.balance.rebalance.Rebalancer.due` also calls for a follow-up
        decision a few steps after a move that the evidence supported only in part). Nothing
        is decided after the last step or a stop request's step: no step would run the new
        split."""
        every = self.run.balance.rebalance_interval
        if self.rebalancer is None or not every:
            return
        self.rebalancer.record(rec.per_rank)
        if rec.step >= self.cfg.max_steps or rec.stop_code:
            # no step follows (the same on every rank): a switch now would leave an allocation
            # that never ran in allocation.json and its measured sync
            return
        if not self.rebalancer.due(rec.step, every, self.allocation):
            return
        new = self.rebalancer.observe(rec.step, self.allocation)
        with self.decision_timeout():
            self.rdv.check_agreement(
                new.digest() if new else "unchanged", f"re-balancing decision at step {rec.step}"
            )
        if new is None:
            return
        why = self.rebalancer.decisions[-1]
        log.info(
            "step %d: straggle %.2f -> re-balancing %s -> %s from step %d (predicted gain "
            "%.1f %%, %.1f %% at the cautious end of the rates' intervals)",
            rec.step,
            why["straggle"],
            self.allocation.samples,
            new.samples,
            rec.step + 1,
            100 * why["gain"],
            100 * why.get("supported_gain", why["gain"]),
        )
        rec.extra["reallocation"] = {
            "from": self.allocation.samples,
            "to": new.samples,
            "at_step": rec.step + 1,
            **{k: why[k] for k in ("gain", "supported_gain", "errors") if k in why},
        }
        self.allocation = new
        if self.elastic is not None and self.any_compiles():
            self.elastic.expect(new, compiling=True)  # a new micro-batch may compile a graph
        if self.on_allocation is not None:
            self.on_allocation(new)

    def evaluate(self) -> Dict[str, float]:
        """The task's validation metrics, the split shared by the ranks (:func:`evaluate_task`);
        under FSDP on the shards if the task evaluates in fixed passes, else gathered whole."""
        self.batches.wait()  # make_batch never runs in two threads at once
        fixed = self.task.evaluates_in_fixed_passes()
        # eager under trainer.compile: validation's shapes would compile more graphs, and a
        # first validation compiling on some ranks only would look like a stuck peer
        with self.parallel.for_evaluation(fixed) as model, eager():
            return evaluate_task(
                self.task,
                model,
                self.rdv,
                self.allocation.shares[self.rank].micro_batch,
                self.device,
                self.autocast,
                same_passes=self.parallel.sharded and fixed,
                before_gather=self._first_validation_wait,
            )

    def any_compiles(self) -> bool:
        """Whether ``trainer.compile`` compiles on any rank of the world (each rank says so in
        its :attr:`metas`: the same answer on every rank)."""
        return any(bool(m.compiled) for m in self.metas)

    def count_graphs(self, rec: StepRecord) -> None:
        """After a step on a compiled rank: log the graphs its passes compiled, if any (the
        first step; a re-balance's new micro-batch), with the total in the step's row
        (``compiled_graphs``). At most :data:`~hetseq_hpc.train.compile.RECOMPILE_LIMIT` per
        unit; past it torch runs new shapes eagerly (exact either way)."""
        graphs = compiled_graphs() - self._graphs_before
        if graphs > self.graphs:
            log.info(
                "step %d: compiled %d graph(s) (%d in all; micro-batches %s)",
                rec.step,
                graphs - self.graphs,
                graphs,
                self.allocation.shares[self.rank].micro_batch,
            )
            rec.extra["compiled_graphs"] = graphs
            self.graphs = graphs

    def _first_validation_wait(self, local_s: float) -> Optional[float]:
        """With in-job recovery, the first validation's gather waits an estimate from this
        rank's pass (:meth:`ElasticWorld.first_validation_wait`); returns the timeout set."""
        if self.elastic is None:
            return None
        return self.elastic.first_validation_wait(
            self.rdv, self.history, self.rank, self.world.world_size, local_s
        )

    def phase_timeout(self, phase: str) -> contextlib.AbstractContextManager:
        """With in-job recovery, the collectives of ``phase`` (``"validation"``,
        ``"checkpoint"``) wait the phase's own measured time (:meth:`ElasticWorld.phase_timeout`);
        without, nothing changes."""
        if self.elastic is None:
            return contextlib.nullcontext()
        return self.elastic.phase_timeout(phase, self.rdv)

    def decision_timeout(self) -> contextlib.AbstractContextManager:
        """With in-job recovery, the gloo group's collectives of a step (its statistics
        exchange) and of a decision right after it (re-balancing) wait at most the step's
        timeout (:meth:`ElasticWorld.step_timeout`); without, nothing changes."""
        if self.elastic is None:
            return contextlib.nullcontext()
        return self.elastic.step_timeout(self.rdv)

    def _save(self, step: int, wait: bool = False) -> None:
        """Checkpoint ``step`` (a collective): the strategy writes the model and optimizer
        state its way (:meth:`~hetseq_hpc.train.parallel.Replicated.save_state`), the manager
        the files (in the background with ``trainer.checkpoint_async``; ``wait``: the run
        stops after this step, so the write ends first, :meth:`CheckpointManager.finish`)."""
        self.checkpoints.save(step, self.rdv, self.parallel, self.optimizer, self.state_dict)
        self.saved_step = step
        if wait:
            self.checkpoints.finish(self.rdv)

    def _mark_checkpoint(self, step: int) -> None:
        """Record the checkpoint of ``step`` in ``events.jsonl`` (the report marks it): called
        by the checkpoint manager where the record was written (rank 0, maybe its background
        thread)."""
        append_event(self.run_dir, "checkpoint", step=step, run_id=self.run_id)

    def keep_good_steps(self) -> str:
        """After a non-finite loss (the model is still that of :attr:`step`): checkpoint that
        step unless it is on disk already (also with ``trainer.checkpoint_every=0``: no trained
        step is lost); returns what was kept and how to go on, for the error line."""
        if self.step == 0:
            return "nothing was trained yet"
        if self.saved_step != self.step:
            self._save(self.step, wait=True)
            kept = f"checkpoint of step {self.step} written"
        else:
            self.checkpoints.finish(self.rdv)  # it may still be written in the background
            kept = f"the checkpoint of step {self.step} is kept"
        return (
            f"{kept}: after the fix, continue from it with hetseq-hpc hydra.run.dir="
            f"{self.run_dir} trainer.resume=auto"
        )

    # ------------------------------------------------------------------ in-job recovery
    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (FSDP)."""
        return self.parallel.sharded

    def drop_groups(self) -> None:
        """Drop the references to the broken process groups: the DDP wrapper (the bare model
        again; :meth:`rejoin` wraps it anew) and the gloo group of the rendezvous (the worker
        holds this Rendezvous too)."""
        self.parallel.module, self.parallel.wrapped = self.parallel.model, False
        if self.rdv is not None:
            self.rdv.cpu_group = None

    def rejoin(self, rdv: Gang, metas: List[RankMeta], allocation: Allocation) -> None:
        """Go on in a re-formed world (:mod:`hetseq_hpc.train.recovery.elastic`): its
        rendezvous, the survivors' metas and split, a new DDP on the new group; gradients
        zeroed, the re-balancer dropped (its history is of the old world)."""
        self.rdv, self.world, self.rank = rdv, rdv.world, rdv.world.rank
        self.metas, self.allocation, self.rebalancer = metas, allocation, None
        self.batches.drop()  # built for the old split
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.grad_path.loss_scale.state_dict()
        self.reset_gradient_path()
        self.grad_path.loss_scale.load_state_dict(scale)
        self.parallel = build_parallel(self.run, self.task, self.parallel.model, self.device, "ddp")
        self.parallel.start(self.grad_path, self.hook_state)
        self._announce(allocation)

    def reload(
        self,
        rdv: Gang,
        metas: List[RankMeta],
        allocation: Allocation,
        rebuild: Callable[[], nn.Module],
        reports: Sequence[RankReport] = (),
        state: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        """Go on in a re-formed world from the last checkpoint (every survivor calls this, after
        :func:`~hetseq_hpc.distributed.membership.join_generation`; collectives over ``rdv``):
        the FSDP model lost a shard (:mod:`hetseq_hpc.train.recovery.sharded`). With
        ``state``, from that instead: the whole training state (:meth:`state_dict`, gathered
        over the old world before it grew) that a survivor sent with a newcomer's admission
        (:func:`~hetseq_hpc.train.recovery.grow.admit`); nothing is read from disk and no step
        is redone.

        Args:
            rdv: the new world's rendezvous; metas: the survivors' rank facts (new rank order);
            allocation: the global batch split over the survivors.
            rebuild: a fresh, seeded model on the CPU (the start-up model before it was sharded).
            reports: the survivors' :class:`~hetseq_hpc.balance.agree.RankReport` the split was
                made from (caps for the larger shards): what FSDP does between micro-batches is
                agreed again from them (:func:`~hetseq_hpc.train.fsdp_accumulation.
                agree_on_accumulation`; without them the rebuilt model reshards, the safe
                default).
            state: a survivor's whole training state (a join), or None (a loss: the newest
                checkpoint).

        Returns:
            ``{"reloaded": {"checkpoint": path or None, "step": s}, "steps_redone": n}`` for the
            membership event; :attr:`step` is ``s`` and :attr:`phase` DONE afterwards
            (``{}`` with ``state``: the step is the state's).

        Raises:
            CheckpointError: the newest checkpoint does not verify (the run cannot go on
                in-job; one line naming it, as a resume would).
        """
        watch = getattr(self.parallel, "memory_watch", None)
        grouped = self.parallel.grouped  # as agreed at start-up
        was = self.step
        # the broken model and optimizer hold DTensors of the old group: gone before the new ones
        del self.parallel, self.model, self.optimizer, self.scheduler
        self.pending = self.owed_row = None
        self.batches.drop()
        gc.collect()
        self.rdv, self.world, self.rank = rdv, rdv.world, rdv.world.rank
        self.metas, self.allocation, self.rebalancer = metas, allocation, None
        self.parallel = build_parallel(
            self.run,
            self.task,
            rebuild(),
            self.device,
            "fsdp",
            [m.precision for m in metas],
            grouped,
        )
        self.parallel.memory_watch = watch
        if reports:  # every survivor: one small all-gather when there is a choice
            agree_on_accumulation(self.run.sharding, self.parallel, allocation, reports, rdv)
        self.model = self.parallel.model
        self.optimizer, self.scheduler = build_optimizer(self.model, self.run)
        self.reset_gradient_path()
        if state is not None:  # a join: the state a survivor sent, every rank alike
            self.load_state_dict(state, "the running job's state")
            self.optimizer.zero_grad(set_to_none=True)
            self.parallel.start(self.grad_path, self.hook_state)
            self._announce(allocation)
            return {}
        self.checkpoints.finish(rdv)  # a checkpoint still being written is the one to reload
        path, state = checkpoint_to_reload(self.checkpoints, rdv, self.resumed_from)
        if path is not None and state is not None:
            self.load_state_dict(state, path)
        else:
            self.step = 0  # the seeded model is the run's start
        self.phase = DONE
        self.history.truncate(self.step)
        self.last_row = {}
        self.optimizer.zero_grad(set_to_none=True)
        self.parallel.start(self.grad_path, self.hook_state)
        log.warning(
            "sharding.mode=fsdp: the lost rank's shard is gone: reloaded %s and re-sharded "
            "it over %d rank(s); steps %d-%d are trained again",
            path or "the seeded start model (no checkpoint yet)",
            rdv.world.world_size,
            self.step + 1,
            was,
        )
        self._announce(allocation)
        return {
            "reloaded": {"checkpoint": path, "step": self.step},
            "steps_redone": max(0, was - self.step),
        }

    def _announce(self, allocation: Allocation) -> None:
        """Tell the worker the re-formed world's split and members (``allocation.json``)."""
        if self.on_allocation is not None and self.elastic is not None:
            self.on_allocation(allocation, {"members": list(self.elastic.membership.members)})

    def log_before_stop(self, event: Dict[str, Any]) -> None:
        """Rank 0 of survivors that stop (too few of them): the row of :attr:`step` if no
        rank 0 wrote it yet, then the membership ``event`` (its ``recovery_s`` absent)."""
        writer = open_loggers(self.run, self.run_dir, self.step)
        try:
            if self.history and self.step not in logged_steps(self.run_dir):
                writer.write(self._row(self.history[-1]))
            writer.write(
                {k: v for k, v in event.items() if k != "lost_monotonic"} | {"run_id": self.run_id}
            )
        finally:
            writer.close()

    def summary(self) -> Dict[str, Any]:
        """Final figures (see :func:`~hetseq_hpc.train.metrics.run_summary`), with the ranks'
        precisions and the gradient combine (:meth:`GradientPath.summary`), the sharding mode,
        ``trainer.compile`` (``compile``: the mode, each rank compiled or not) and
        every rank's memory (:func:`~hetseq_hpc.train.parallel.rank_memory`; a collective)."""
        out = run_summary(
            self.history,
            self.metas,
            self.cfg.global_batch_size,
            self.step,
            self.last_val,
            self.allocation.samples,
        )
        started = getattr(self, "_fit_started", None)
        if started is not None and self.step > started[1]:  # validation, checkpoints included
            seconds = time.perf_counter() - started[0]
            out["fit_samples_per_s"] = (
                (self.step - started[1]) * self.cfg.global_batch_size / seconds
            )
            out["fit_s"] = seconds
        out.update(self.grad_path.summary())
        out["sharding"] = self.parallel.describe()
        # trainer.compile: the mode asked and whether each rank compiled its units
        out["compile"] = {
            "mode": self.cfg.compile,
            "ranks": [bool(m.compiled) for m in self.metas],
        }
        out["memory"] = self.rdv.all_gather_objects(  # every rank's, in rank order
            rank_memory(self.model, self.optimizer, self.device, self.parallel.memory_watch)
        )
        return out
