"""A finished run: the checkpoint a run would resume from is at ``trainer.max_steps`` or later.

Re-running a finished run (``hetseq-hpc hydra.run.dir=<it>``) has nothing to train. The
command line recognises it before any rank starts (:func:`finished_run`) and says so in one
line (:meth:`FinishedRun.line`: the steps, the final loss, where the summary is, how to train
further); nothing is started or rewritten and the exit code is 0. Ranks that reach a finished
run all the same (a second SLURM job queued on the same run directory, a job script submitted
by hand after the run ended) stop once they agreed on the checkpoint, before writing anything
(:mod:`hetseq_hpc.worker`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hetseq_hpc.errors import CheckpointError, HetseqError
from hetseq_hpc.rundir.history import current_run_id
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.files import (
    checkpoints_in,
    step_of,
    stored_entry,
    stored_run_id,
    verify_checksum,
)
from hetseq_hpc.train.metrics import read_metrics


@dataclass(frozen=True)
class FinishedRun:
    """A run with nothing left to train.

    Attributes:
        run_dir: the run directory the command names.
        checkpoint: the checkpoint the run would resume from.
        step: its optimizer step (``>= max_steps``).
        max_steps: ``trainer.max_steps`` of the command.
        final_loss: the training loss of ``step`` (``summary.json``, else ``metrics.jsonl``),
            or None when neither records it.
        summary: ``summary.json`` when it records ``step``, else None.
    """

    run_dir: RunDir
    checkpoint: Path
    step: int
    max_steps: int
    final_loss: Optional[float]
    summary: Optional[Path]

    @property
    def in_run_dir(self) -> bool:
        """Whether the checkpoint is one of ``run_dir``'s own (else a ``trainer.resume`` file
        of another run)."""
        return self.checkpoint.resolve().parent == self.run_dir.checkpoints.resolve()

    def line(self) -> str:
        """The one line that says so (without the program's name): what is there and the
        command that trains further."""
        loss = f"{self.final_loss:.4f}" if self.final_loss is not None else "not recorded"
        more = f"trainer.max_steps=<more than {self.step}>"
        if not self.in_run_dir:
            return (
                f"nothing to train: trainer.resume={self.checkpoint} is at step {self.step} "
                f"and trainer.max_steps={self.max_steps}; nothing was started or written; "
                f"to train further from it, add {more}"
            )
        where = (
            f"summary {self.summary}"
            if self.summary is not None
            else f"no summary.json of that step (see {self.run_dir.metrics})"
        )
        return (
            f"{self.run_dir} is complete: {self.step} steps (trainer.max_steps="
            f"{self.max_steps}), final loss {loss}, {where}; nothing was started or "
            f"rewritten; to train further: hydra.run.dir={self.run_dir} {more}"
        )


def _number(value: object) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def describe_finished(run_dir: RunDir, checkpoint: Path, step: int, max_steps: int) -> FinishedRun:
    """A :class:`FinishedRun` with its final loss and summary read from ``run_dir`` (only
    read: a missing, damaged or older ``summary.json`` or ``metrics.jsonl`` leaves them None)."""
    summary, loss = None, None
    path = run_dir.summary
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict) and data.get("final_step") == step:
        summary, loss = path, _number(data.get("final_loss"))
    if loss is None and run_dir.metrics.is_file():
        try:
            rows = read_metrics(run_dir.metrics)
        except (HetseqError, UnicodeDecodeError, RecursionError):
            rows = []
        at_step = [r for r in rows if r.get("step") == step and _number(r.get("loss")) is not None]
        loss = _number(at_step[-1]["loss"]) if at_step else None
    return FinishedRun(run_dir, Path(checkpoint), step, max_steps, loss, summary)


def _verified_run_id(path: Path) -> str:
    """:func:`~hetseq_hpc.train.checkpoint.manager.verified_run_id` as a command line needs
    it, without importing torch (~3 CPU-s per command) for a one-file checkpoint: its SHA-256
    against its sidecar, then its plain ``run_id`` entry
    (:func:`~hetseq_hpc.train.checkpoint.files.stored_run_id`). A sharded checkpoint (its shard
    files to check too) goes through the manager's, with torch. The ranks load and judge the
    checkpoint they resume again, in full.

    Raises:
        CheckpointError: the checkpoint does not verify or cannot be read.
    """
    verify_checksum(path)
    if stored_entry(path, "shards") is not None:
        from hetseq_hpc.train.checkpoint.manager import verified_run_id  # torch: its shards

        return verified_run_id(path)
    return stored_run_id(path)


def _newest_resumable(run_dir: RunDir, at_least: int) -> Optional[Path]:
    """The newest checkpoint of ``run_dir``'s current run (``run.json``) that verifies, as the
    ranks choose it under ``trainer.resume=auto``
    (:meth:`~hetseq_hpc.train.checkpoint.manager.CheckpointManager.choose`), if its step is ``at_least`` or
    more; only checkpoints of such steps are read (a checksum), so this costs a directory
    listing when there are none."""
    current = current_run_id(run_dir)
    for path in reversed(checkpoints_in(run_dir.checkpoints)):
        if step_of(path) < at_least:
            return None  # the ranks resume this one, or an older one
        try:
            owner = _verified_run_id(path)
        except (CheckpointError, OSError):
            continue  # the ranks skip it too
        if current and owner and owner != current:
            continue  # another run's: never resumed
        return path
    return None


def finished_run(resume: str, max_steps: int, run_dir: RunDir) -> Optional[FinishedRun]:
    """The finished run a command would resume, or None when there is something to train.

    ``trainer.resume=auto``: the checkpoint the ranks would choose, if it is at ``max_steps``
    or later. A checkpoint path: its stored step, if it verifies. ``never``: None. A
    checkpoint that does not verify is left to the ranks, which name it.

    Args:
        resume: ``trainer.resume``.
        max_steps: ``trainer.max_steps``.
        run_dir: the run directory.
    """
    if resume == "never":
        return None
    if resume == "auto":
        path = _newest_resumable(run_dir, max_steps)
        return None if path is None else describe_finished(run_dir, path, step_of(path), max_steps)
    path = Path(resume).expanduser()
    try:
        _verified_run_id(path)
        step = stored_entry(path, "step")
    except (CheckpointError, OSError):
        return None
    if not isinstance(step, int) or step < max_steps:
        return None
    return describe_finished(run_dir, path, step, max_steps)


def completed_run(run_dir: RunDir) -> Optional[FinishedRun]:
    """The run of ``run_dir`` as it ended, when it ended complete: its ``summary.json`` records
    the step of the checkpoint ``trainer.resume=auto`` would resume (a run stopped early writes
    no summary); else None."""
    try:
        data = json.loads(run_dir.summary.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    step = data.get("final_step") if isinstance(data, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    path = _newest_resumable(run_dir, step)
    if path is None or step_of(path) != step:
        return None
    return describe_finished(run_dir, path, step, step)


__all__ = ["FinishedRun", "completed_run", "describe_finished", "finished_run"]
