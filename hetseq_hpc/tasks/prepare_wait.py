"""Rank 0 prepares the task's caches while the other ranks wait OUTSIDE any collective.

A gloo barrier gives up after ``cluster.collective_timeout_s``, and tokenising a real corpus
takes longer than that. So the waiting ranks poll a marker file in the (shared) run directory
instead: rank 0 writes it when ``task.prepare()`` ended, with its error if it failed, and only
then do all ranks meet in a barrier. A rank 0 that dies without writing it is seen by the
launcher (the local launcher stops the others; ``srun --kill-on-bad-exit`` ends the step).

Run ``hetseq-hpc prepare <overrides>`` before submitting, and no GPU waits at all.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from hetseq_hpc.atomic import atomic_write_json
from hetseq_hpc.errors import DataError

log = logging.getLogger(__name__)

#: seconds between two looks at the marker file
POLL_S = 0.5
#: a waiting rank logs that it still waits every this many seconds
NOTE_EVERY_S = 60.0
#: test hook: seconds rank 0 sleeps before preparing (a slow prepare without a big corpus)
DELAY_ENV = "HETSEQ_INJECT_PREPARE_DELAY_S"


def marker_path(run_dir: Path, token: str) -> Path:
    """``<run dir>/logs/.prepared-<token>.json``: rank 0's word that ``prepare()`` ended."""
    return Path(run_dir) / "logs" / f".prepared-{token}.json"


def prepare_on_rank0(task: Any, rdv: Any, run_dir: Path, poll_s: float = POLL_S) -> None:
    """``task.prepare()`` on rank 0; the other ranks wait for its marker file, then all meet.

    Args:
        task: the task (its ``prepare()`` builds caches; cheap when they exist).
        rdv: the joined :class:`~hetseq_hpc.distributed.Rendezvous`.
        run_dir: the run directory (shared by every rank).
        poll_s: seconds between looks at the marker.

    Raises:
        DataError: on the waiting ranks, when rank 0's ``prepare()`` failed (its reason).
        Whatever ``prepare()`` raises, on rank 0.
    """
    token = rdv.broadcast_object(uuid.uuid4().hex if rdv.world.rank == 0 else None)
    marker = marker_path(run_dir, token)
    if rdv.world.rank == 0:
        started = time.monotonic()
        try:
            delay = float(os.environ.get(DELAY_ENV) or 0)
            if delay > 0:
                time.sleep(delay)
            task.prepare()
        except BaseException as exc:
            atomic_write_json(marker, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            raise
        atomic_write_json(marker, {"ok": True})
        took = time.monotonic() - started
        if took > 30:
            log.info("preparing the data took %.0f s while the other ranks waited: run "
                     "`hetseq-hpc prepare` with the same overrides before the job next time", took)
    else:
        _wait(marker, poll_s)
    rdv.barrier()
    if rdv.world.rank == 0:
        marker.unlink(missing_ok=True)


def _wait(marker: Path, poll_s: float) -> None:
    started = last_note = time.monotonic()
    while True:
        try:
            result = json.loads(marker.read_text())
        except (OSError, ValueError):
            result = None
        if result is not None:
            if not result.get("ok"):
                raise DataError(f"rank 0 could not prepare the data ({result.get('error')}): "
                                "see rank 0's log; fix it, or run `hetseq-hpc prepare` first")
            return
        now = time.monotonic()
        if now - last_note >= NOTE_EVERY_S:
            log.info("still waiting for rank 0 to prepare the data (%.0f s)", now - started)
            last_note = now
        time.sleep(poll_s)
