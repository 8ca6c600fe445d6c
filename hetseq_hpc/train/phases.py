"""One optimizer step and the work after it, in phases that an in-job recovery can redo
(:class:`hetseq_hpc.train.loop.Trainer`, :mod:`hetseq_hpc.train.elastic`).

After step ``k`` is trained every rank goes through the same phases, each of which may hold a
collective: the online re-balancing decision, validation (when due), the step's row in
``metrics.jsonl`` (rank 0), the checkpoint (when due). ``trainer.phase`` says which phase of
``trainer.step`` was completed last; a recovery (:meth:`ElasticWorld.recover
<hetseq_hpc.train.elastic.ElasticWorld.recover>`) agrees on the most advanced step and on the
earliest phase of it that a survivor did not complete, and the survivors redo the phases from
there over the new world: a validation or checkpoint of the last completed step is redone, its
row is written once (rank 0 may have changed: the new one reads the file, also when the
survivors were past the row: a lost rank 0 may not have written it).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from hetseq_hpc.env.preemption import REASONS
from hetseq_hpc.errors import NonFiniteLoss, Preempted
from hetseq_hpc.rundir.events import append_event
from hetseq_hpc.train.loggers import open_loggers
from hetseq_hpc.train.metrics import Progress, read_metrics, step_row
from hetseq_hpc.train.rebalance_step import maybe_rebalance
from hetseq_hpc.train.records import DONE, EVALUATED, LOGGED, REBALANCED, TRAINED

log = logging.getLogger(__name__)


def logged_steps(run_dir: Any) -> set:
    """The steps that have a training row in ``metrics.jsonl`` (empty if there is none)."""
    try:
        rows = read_metrics(run_dir)
    except Exception:  # no file yet, or unreadable: the row is written (again)
        return set()
    return {r.get("step") for r in rows if "loss" in r and r.get("event") is None}


def step_row_of(trainer: Any, rec: Any) -> Dict[str, Any]:
    """The ``metrics.jsonl`` row of the step ``rec`` recorded: the trainer's ``last_row``, the
    run id and the record's extra fields (validation, notes)."""
    return {**trainer.last_row, "run_id": trainer.run_id, **rec.extra}


class StepPhases:
    """Rank-local driver of :meth:`Trainer.fit <hetseq_hpc.train.loop.Trainer.fit>`: rank 0's
    loggers and progress line, the resume note for the first row, and the membership events
    waiting for the next completed step."""

    def __init__(self, trainer: Any):
        self.t = trainer
        cfg = trainer.cfg
        self.writer = (
            open_loggers(trainer.run, trainer.run_dir, trainer.step) if trainer.rank == 0 else None
        )
        self.progress = Progress(cfg.max_steps, trainer.step, enabled=trainer.rank == 0)
        self.pending: Dict[str, Any] = dict(trainer.resume_note)  # goes into the first row
        self.events: List[Dict[str, Any]] = []
        self.check_logged: Optional[int] = None  # after a recovery: row of this step written?
        if trainer.elastic is not None:
            trainer.elastic.expect(trainer.allocation)  # the step's collective timeout
            trainer.elastic.arm()  # a lost peer is recovered from now on

    def more(self) -> bool:
        """Whether a step or a phase of the last one is left to do."""
        return self.t.step < self.t.cfg.max_steps or self.t.phase < DONE

    def advance(self) -> None:
        """Train the next step if the last one is done, then do the phases of ``trainer.step``
        not done yet.

        Raises:
            Preempted: a stop request was seen in the step's exchange (after its checkpoint).
            NonFiniteLoss: the step's loss is NaN or inf on some rank; the last good step was
                checkpointed (:meth:`keep_good_steps`).
            RuntimeError: a collective failed (a peer lost: the caller recovers).
        """
        t, cfg = self.t, self.t.cfg
        if t.phase == DONE:
            try:
                rec = t.train_step(t.step + 1)
            except NonFiniteLoss as exc:
                raise NonFiniteLoss(f"{exc}; {self.keep_good_steps()}", exc.step) from None
            t.phase = TRAINED
            t.history.append(rec)
            rec.extra.update(self.pending)
            self.pending = {}
            # with the split that ran the step (a re-balance below may change it)
            t.last_row = step_row(
                rec,
                t.metas,
                t.allocation.shares,
                cfg.global_batch_size,
                t.task.tokens_per_sample,
                t.allocation.samples,
                units_per_sample=t.task.units_per_sample,
            )
            if t.elastic is not None:
                t.elastic.observe_step(rec)
            self.flush_events()  # the next completed step after a recovery
        rec, step = t.history[-1], t.step
        is_last = step == cfg.max_steps
        if t.phase < REBALANCED:
            maybe_rebalance(t, rec)
            t.phase = REBALANCED
        if t.phase < EVALUATED:
            if (cfg.val_every and step % cfg.val_every == 0) or is_last:
                with t.phase_timeout("validation"):
                    t.last_val = t.evaluate()
                rec.extra.update(t.last_val)
            t.phase = EVALUATED
        if t.phase < LOGGED:
            self._log(rec, step)
            t.phase = LOGGED
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or is_last or rec.stop_code:
            with t.phase_timeout("checkpoint"):
                t._save(step)
            if self.writer is not None:  # rank 0: the report marks it
                append_event(t.run_dir, "checkpoint", step=step, run_id=t.run_id)
        t.phase = DONE
        if rec.stop_code and not is_last:
            # every rank saw the same request in the step's exchange: all stop here
            reason = REASONS.get(rec.stop_code, "a stop request")
            if self.writer is not None:
                append_event(
                    t.run_dir, "stop", step=step, code=rec.stop_code, reason=reason, run_id=t.run_id
                )
            raise Preempted(step, rec.stop_code, reason)

    def keep_good_steps(self) -> str:
        """After a non-finite loss (the model is still that of ``trainer.step``): checkpoint
        that step unless it is on disk already (also with ``trainer.checkpoint_every=0``: no
        trained step is lost); returns what was kept and how to go on, for the error line."""
        t = self.t
        if t.step == 0:
            return "nothing was trained yet"
        if t.saved_step != t.step:
            t._save(t.step)
            kept = f"checkpoint of step {t.step} written"
        else:
            kept = f"the checkpoint of step {t.step} is kept"
        return (
            f"{kept}: after the fix, continue from it with hetseq-hpc hydra.run.dir={t.run_dir} "
            "trainer.resume=auto"
        )

    def _row_due(self, rec: Any, step: int) -> bool:
        """Whether step ``step`` (record ``rec``) gets a row: every ``trainer.log_every`` steps,
        the last one, and any with extra fields (validation, notes)."""
        cfg = self.t.cfg
        return bool(step % cfg.log_every == 0 or step == cfg.max_steps or rec.extra)

    def _log(self, rec: Any, step: int) -> None:
        cfg = self.t.cfg
        due = self._row_due(rec, step)
        if due and self.writer is not None and self.check_logged == step:
            due = step not in logged_steps(self.t.run_dir)  # by a rank 0 before the recovery?
        self.check_logged = None
        if self.writer is not None and due:
            self.writer.write(step_row_of(self.t, rec))
        self.progress.update(
            step,
            rec.loss,
            cfg.global_batch_size / max(rec.wall_s, 1e-9),
            extra=(
                f"val_loss {self.t.last_val['val_loss']:.4f}" if "val_loss" in rec.extra else None
            ),
        )

    def recovered(self, event: Dict[str, Any]) -> None:
        """After a recovery: keep its event for the next completed step; the new rank 0 opens
        the loggers at the agreed step (a row cut off by a lost rank 0 is dropped)."""
        t = self.t
        self.events.append(event)
        if self.writer is not None:
            self.writer.close()
        self.writer = open_loggers(t.run, t.run_dir, t.step) if t.rank == 0 else None
        self.check_logged = t.step if t.phase < LOGGED else None
        if t.phase >= LOGGED and self.writer is not None:
            self._write_row_a_lost_rank0_owed()
        self.progress.enabled = t.rank == 0

    def _write_row_a_lost_rank0_owed(self) -> None:
        """The row of ``trainer.step`` when the survivors are past its phase but the file has
        none: rank 0 writes a row without a collective, so the other ranks go on to the
        checkpoint (or the next step) while it writes; a rank 0 lost in between never wrote
        it. Written once: a row already in the file is not repeated."""
        t = self.t
        if not t.history or t.history[-1].step != t.step:
            return
        rec = t.history[-1]
        if self._row_due(rec, t.step) and t.step not in logged_steps(t.run_dir):
            log.warning(
                "step %d: its row was not in %s (rank 0 was lost before writing it): written now",
                t.step,
                "metrics.jsonl",
            )
            self.writer.write(step_row_of(t, rec))

    def flush_events(self) -> None:
        """Write the membership rows waiting for a completed step, with ``recovery_s``: seconds
        from the loss (the lost rank's last heartbeat, or the failed collective) to now."""
        now = time.monotonic()
        for event in self.events:
            event["recovery_s"] = round(now - event.pop("lost_monotonic"), 3)
            if self.writer is not None:
                self.writer.write({**event, "run_id": self.t.run_id})
        self.events = []

    def close(self) -> None:
        """Close the progress line and rank 0's loggers."""
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
