"""Which run a run directory's records belong to, and starting over without losing the old one.

A run directory can hold several runs in time: ``trainer.resume=never`` (or a start with no
checkpoint to resume) begins a NEW run there. Each run has an id (a random hex string):

* ``<run dir>/run.json`` names the current run (``{"run_id": ..., "started_at": ...}``);
* every checkpoint stores the ``run_id`` it was written by, and every ``metrics.jsonl`` row too;
* resume and checkpoint retention consider only checkpoints of the current run, so an earlier
  run's higher step numbers can neither be resumed by mistake nor outrank the new run's
  checkpoints in retention.

Before a new run starts in a directory that holds an earlier run's records, those records
(``checkpoints/``, ``metrics.jsonl``, ``events.jsonl``, ``metrics.csv``, ``tb/``,
``summary.json``, ``allocation.json``, ``ranks.png``, ``wandb_id.txt``, ``run.json``) are
MOVED to ``<run dir>/previous/<earlier run id>/`` and the move is logged in one line: nothing
of either run is deleted or mixed. Logs (``logs/``, ``cli.log``) are appended to, as before.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import List, Optional, Tuple

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.rundir.events import append_event
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger(__name__)

#: the current run's identity file in a run directory
RUN_FILE = RunDir.RUN_FILE
#: where an earlier run's records go when a new run starts in the same directory
PREVIOUS_DIR = RunDir.PREVIOUS_NAME
#: the records of one run (relative to the run directory), moved together on start-over
RUN_RECORDS = RunDir.RUN_RECORDS


def new_run_id() -> str:
    """A fresh run id: 12 random hex digits."""
    return uuid.uuid4().hex[:12]


def current_run_id(run_dir: RunDir) -> Optional[str]:
    """The id in ``<run dir>/run.json``, or None when there is none (a new directory, or one
    written before run ids existed) or it cannot be read."""
    try:
        data = json.loads(run_dir.run_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("run_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


def write_run_id(run_dir: RunDir, run_id: str) -> None:
    """Record ``run_id`` as the run directory's current run (atomically)."""
    atomic_write_json(
        run_dir.run_file,
        {"run_id": run_id, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")},
    )


def earlier_records(run_dir: RunDir) -> List[Path]:
    """The records of an earlier run present in ``run_dir`` (an empty ``checkpoints/`` does not
    count, nor ``events.jsonl`` alone: a run stopped before its first step leaves only that,
    and the next run's ``start`` row follows it there)."""
    found = []
    for path in run_dir.records():
        if path.is_dir() and not path.is_symlink():
            if any(path.iterdir()):
                found.append(path)
        elif path.exists() or path.is_symlink():
            found.append(path)
    return found if any(p != run_dir.events for p in found) else []


def archive_earlier_run(run_dir: RunDir) -> Optional[Path]:
    """Move an earlier run's records to ``<run dir>/previous/<its run id>/``.

    Returns:
        The folder they went to, or None when there was nothing to move.

    Raises:
        CheckpointError: a record cannot be moved (permissions, another file system); what was
            already moved is named, nothing is deleted.
    """
    records = earlier_records(run_dir)
    if not records:
        return None
    label = current_run_id(run_dir) or time.strftime("run-%Y%m%d-%H%M%S")
    target = run_dir.previous / label
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir.previous / f"{label}-{suffix}"
    target.mkdir(parents=True)
    moved: List[str] = []
    for path in records:
        try:
            os.rename(path, target / path.name)
        except OSError as exc:
            raise CheckpointError(
                f"cannot move the earlier run's {path} to {target} to start over "
                f"({exc.strerror or exc}; moved so far: {', '.join(moved) or 'nothing'}): fix "
                "the permissions, or start the new run in another hydra.run.dir"
            ) from None
        moved.append(path.name)
    return target


def start_or_continue(run_dir: RunDir, resumed_run_id: Optional[str]) -> Tuple[str, Optional[Path]]:
    """The current run's id, on rank 0 under the run lock, before anything is written.

    Args:
        run_dir: the run directory.
        resumed_run_id: the ``run_id`` of the checkpoint being resumed, ``""`` for a
            checkpoint written before run ids existed, or None when the run starts at step 0.

    Returns:
        ``(run id, folder the earlier run's records were moved to or None)``. A resumed run
        keeps its id (a pre-run-id checkpoint adopts the directory's, or a new one); a run that
        starts at step 0 gets a new id, and an earlier run's records are archived first; its
        ``start`` row in ``events.jsonl`` names where.

    Raises:
        CheckpointError: the earlier run's records cannot be moved.
    """
    if resumed_run_id is not None:
        run_id = resumed_run_id or current_run_id(run_dir) or new_run_id()
        if current_run_id(run_dir) != run_id:
            write_run_id(run_dir, run_id)
        return run_id, None
    archived = archive_earlier_run(run_dir)
    run_id = new_run_id()
    write_run_id(run_dir, run_id)
    where = str(archived.relative_to(run_dir.root)) if archived is not None else None
    append_event(run_dir, "start", step=0, run_id=run_id, archived=where)
    if archived is not None:
        log.warning(
            "starting a new run (%s) in %s: the earlier run's records (%s) were moved to %s",
            run_id,
            run_dir,
            ", ".join(sorted(p.name for p in archived.iterdir())),
            archived,
        )
    return run_id, archived


__all__ = [
    "PREVIOUS_DIR",
    "RUN_FILE",
    "RUN_RECORDS",
    "archive_earlier_run",
    "current_run_id",
    "earlier_records",
    "new_run_id",
    "start_or_continue",
    "write_run_id",
]
