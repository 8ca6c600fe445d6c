"""Rank 0's record of a run as it trains: each completed step's row (``metrics.jsonl`` and the
other ``trainer.loggers``), the progress line, the resume note of the first row and the
membership events of a recovery, written with the next completed step.

A recovery may change rank 0: the new one opens the loggers at the agreed step and writes the
rows its lost predecessor owed, once (it reads the file: a row already there is not repeated).
The phases the rows belong to: :class:`hetseq_hpc.train.trainer.Trainer`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.metrics.loggers import RunLoggers, open_loggers
from hetseq_hpc.train.metrics.rows import Progress, read_metrics
from hetseq_hpc.train.records import StepRecord

log = logging.getLogger(__name__)


def logged_steps(run_dir: RunDir) -> Set[Any]:
    """The steps that have a training row in ``metrics.jsonl`` (empty if there is none)."""
    try:
        rows = read_metrics(run_dir.metrics)
    except Exception:  # no file yet, or unreadable: the row is written (again)
        return set()
    return {r.get("step") for r in rows if "loss" in r and r.get("event") is None}


class StepLog:
    """Rank 0's loggers and progress line, the resume note for the first row, and the
    membership events waiting for the next completed step (the other ranks write nothing).

    Args:
        run: the run configuration (``trainer.loggers``, ``log_every``, ``max_steps``).
        run_dir: the run directory.
        step: the step the run continues after (the loggers drop rows past it).
        rank: this rank in the current world (0 writes).
        note: fields for the first row (a resume's fallback past bad checkpoints).
        joined: this process joined the running job (its membership rows are kept:
            :func:`~hetseq_hpc.train.metrics.loggers.open_loggers`).
    """

    def __init__(
        self,
        run: RunConfig,
        run_dir: RunDir,
        step: int,
        rank: int,
        note: Dict[str, Any],
        joined: bool = False,
    ):
        self.run, self.cfg, self.run_dir = run, run.trainer, run_dir
        self.writer: Optional[RunLoggers] = (
            open_loggers(run, self.run_dir, step, keep_membership=joined) if rank == 0 else None
        )
        self.progress = Progress(self.cfg.max_steps, step, enabled=rank == 0)
        self.pending: Dict[str, Any] = dict(note)  # goes into the first row
        self.events: List[Dict[str, Any]] = []
        self.check_logged: Optional[int] = None  # after a recovery: row of this step written?

    def take_note(self) -> Dict[str, Any]:
        """The fields for the first completed step's row (once; empty after)."""
        note, self.pending = self.pending, {}
        return note

    def row_due(self, rec: StepRecord, step: int) -> bool:
        """Whether step ``step`` (record ``rec``) gets a row: every ``trainer.log_every``
        steps, the last one, and any with extra fields (validation, notes)."""
        cfg = self.cfg
        return bool(step % cfg.log_every == 0 or step == cfg.max_steps or rec.extra)

    def log(
        self,
        rec: StepRecord,
        step: int,
        row: Dict[str, Any],
        last_val: Optional[Dict[str, float]],
    ) -> None:
        """The row of step ``step`` (``row``: its record's metrics) when due, and the progress
        line (``last_val``: the last validation, shown when the step ran one)."""
        due = self.row_due(rec, step)
        if due and self.writer is not None and self.check_logged == step:
            due = step not in logged_steps(self.run_dir)  # by a rank 0 before the recovery?
        self.check_logged = None
        if self.writer is not None and due:
            self.writer.write(row)
        self.progress.update(
            step,
            rec.loss,
            self.cfg.global_batch_size / max(rec.wall_s, 1e-9),
            extra=(
                f"val_loss {last_val['val_loss']:.4f}"
                if last_val is not None and "val_loss" in rec.extra
                else None
            ),
        )

    def recovered(
        self,
        event: Dict[str, Any],
        rank: int,
        step: int,
        past_row: bool,
        owed: Sequence[Tuple[StepRecord, Dict[str, Any]]],
    ) -> None:
        """After a recovery: keep its ``event`` for the next completed step; the new rank 0
        (``rank``) opens the loggers at the agreed ``step`` (a row cut off by a lost rank 0 is
        dropped). ``owed``: the records and rows of the last steps up to ``step``, oldest
        first, that a rank 0 lost in between may not have written: a row is read one step late
        (:mod:`hetseq_hpc.train.readout`), so the lost rank 0 may owe the row of ``step - 1``
        as well as that of ``step``. ``past_row``: the survivors were past the row of
        ``step`` (False: its phase is redone, and :meth:`log` checks the file then). The job's
        membership rows past ``step`` are kept (a loss's, after an FSDP reload)."""
        self.events.append(event)
        if self.writer is not None:
            self.writer.close()
        self.writer = (
            open_loggers(self.run, self.run_dir, step, keep_membership=True) if rank == 0 else None
        )
        self.check_logged = step if not past_row else None
        if self.writer is not None:
            for rec, row in owed:
                if rec.step < step or (rec.step == step and past_row):
                    self._write_owed_row(self.writer, rec.step, rec, row)
        self.progress.enabled = rank == 0

    def _write_owed_row(
        self, writer: RunLoggers, step: int, rec: StepRecord, row: Dict[str, Any]
    ) -> None:
        """The row of ``step`` when the survivors are past its phase but the file has none:
        rank 0 writes a row without a collective, so the other ranks go on to the checkpoint
        (or the next step) while it writes; a rank 0 lost in between never wrote it. Written
        once: a row already in the file is not repeated."""
        if self.row_due(rec, step) and step not in logged_steps(self.run_dir):
            log.warning(
                "step %d: its row was not in %s (rank 0 was lost before writing it): written now",
                step,
                self.run_dir.metrics.name,
            )
            writer.write(row)

    def flush_events(self, run_id: str) -> None:
        """Write the membership rows waiting for a completed step, with ``recovery_s``: seconds
        from the loss (the lost rank's last heartbeat, or the failed collective) to now; a
        join's (``joined``) with ``join_s``: seconds from its request to now."""
        now = time.monotonic()
        for event in self.events:
            since = "join_s" if event.get("joined") else "recovery_s"
            event[since] = round(now - event.pop("lost_monotonic"), 3)
            if self.writer is not None:
                self.writer.write({**event, "run_id": run_id})
        self.events = []

    def close(self) -> None:
        """Close the progress line and rank 0's loggers."""
        self.progress.close()
        if self.writer is not None:
            self.writer.close()


__all__ = ["StepLog", "logged_steps"]
