"""Rank 0 prepares the task's caches while the other ranks wait OUTSIDE any collective.

A gloo barrier gives up after ``cluster.collective_timeout_s``, and tokenising a real corpus
takes longer than that. So the waiting ranks poll a marker file in the (shared) run directory
instead: rank 0 writes it when ``task.prepare()`` ended, with its error if it failed, and only
then do all ranks meet in a barrier. A rank 0 that dies without writing it is seen by the
launcher (the local launcher stops the others; ``srun --kill-on-bad-exit`` ends the step).

A rank 0 that is alive but makes no progress (stopped with SIGSTOP or Ctrl-Z, hung) is caught
by a heartbeat: while it prepares, a thread of rank 0 rewrites a counter in
``logs/.preparing-<token>.heartbeat`` every :func:`beat_interval` seconds, and a waiting rank
that sees the counter unchanged for ``cluster.collective_timeout_s`` (by its own monotonic
clock: no clock of two machines is compared) fails with a :class:`DataError` naming rank 0's
heartbeat. The launcher then stops every rank, the stopped rank 0 included.

Run ``hetseq-hpc prepare <overrides>`` before submitting, and no GPU waits at all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.errors import DataError
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks.prepare_errors import prepare_task

log = logging.getLogger(__name__)

#: seconds between two looks at the marker file
POLL_S = 0.5
#: a waiting rank logs that it still waits every this many seconds
NOTE_EVERY_S = 60.0
#: rank 0 renews its heartbeat at least this often (seconds), more often for short timeouts
BEAT_EVERY_S = 5.0


def beat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats: ``min(BEAT_EVERY_S, timeout_s / 4)``, so a waiting rank
    sees about four beats per timeout."""
    return min(BEAT_EVERY_S, max(float(timeout_s), 0.04) / 4)


class Heartbeat:
    """A daemon thread that rewrites a counter in ``path`` every ``interval_s`` seconds while
    the ``with`` block runs (the file is removed at the end).

    The counter is written in place (``pwrite`` of a fixed-width line at offset 0: no new file,
    no new disk block after the first beat), so a full disk does not stop the heartbeat. A beat
    that fails is retried at the next interval; rank 0's own failure is reported by its marker.

    Args:
        path: the heartbeat file (its folder must exist or be creatable).
        interval_s: seconds between beats.
    """

    def __init__(self, path: Path, interval_s: float):
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self.beats = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def beat(self) -> None:
        """Write the next counter value now (errors are logged once and otherwise ignored)."""
        self.beats += 1
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, f"{self.beats:20d}\n".encode(), 0)
            finally:
                os.close(fd)
        except OSError as exc:
            if self.beats == 1:
                log.warning(
                    "cannot write the prepare heartbeat %s (%s): the waiting ranks may "
                    "give up on rank 0",
                    self.path,
                    exc.strerror,
                )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread = threading.Thread(target=self._run, name="prepare-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


def prepare_on_rank0(
    task: Any, rdv: Gang, run_dir: RunDir, timeout_s: float, poll_s: float = POLL_S
) -> None:
    """``task.prepare()`` on rank 0; the other ranks wait for its marker file, then all meet.

    Args:
        task: the task (its ``prepare()`` builds caches; cheap when they exist).
        rdv: the joined rendezvous (:class:`~hetseq_hpc.distributed.gang.Gang`).
        run_dir: the run directory (shared by every rank).
        timeout_s: ``cluster.collective_timeout_s``: a waiting rank gives up when rank 0's
            heartbeat has not changed for this many seconds.
        poll_s: seconds between looks at the marker (the first four, a ramp that adds up to
            one poll, sooner).

    Raises:
        DataError: on the waiting ranks, when rank 0's ``prepare()`` failed (its reason) or its
            heartbeat stopped for ``timeout_s``; on rank 0, a file-system error of ``prepare()``
            (:func:`~hetseq_hpc.tasks.prepare_errors.prepare_task`).
        Whatever else ``prepare()`` raises, on rank 0.
    """
    token = rdv.broadcast_object(uuid.uuid4().hex if rdv.world.rank == 0 else None)
    marker = run_dir.prepared_marker(token)
    heartbeat = run_dir.prepare_heartbeat(token)
    if rdv.world.rank == 0:
        started = time.monotonic()
        try:
            with Heartbeat(heartbeat, beat_interval(timeout_s)):
                prepare_task(task)
        except BaseException as exc:
            try:
                atomic_write_json(marker, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            except OSError as write_exc:  # e.g. the full disk prepare() failed on: exc matters
                log.warning("cannot write %s (%s)", marker, write_exc.strerror)
            raise
        atomic_write_json(marker, {"ok": True})
        took = time.monotonic() - started
        if took > 30:
            log.info(
                "preparing the data took %.0f s while the other ranks waited: run "
                "`hetseq-hpc prepare` with the same overrides before the job next time",
                took,
            )
    else:
        wait_for_rank0(run_dir, token, timeout_s, poll_s)
    rdv.barrier()
    if rdv.world.rank == 0:
        marker.unlink(missing_ok=True)


def _read(path: Path) -> Optional[bytes]:
    try:
        with open(path, "rb") as fh:  # open() revalidates the file on NFS (close-to-open)
            return fh.read(64) + str(os.fstat(fh.fileno()).st_mtime_ns).encode()
    except OSError:
        return None


def wait_for_rank0(
    run_dir: RunDir,
    token: str,
    timeout_s: float,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait (a rank other than 0) until rank 0's marker of ``token``
    (:meth:`~hetseq_hpc.rundir.paths.RunDir.prepared_marker`) says its ``prepare()`` ended.

    Rank 0 is alive while the content (or modification time) of its heartbeat changes; the
    time since the last change is measured on ``clock`` (this rank's, seconds), starting when
    the wait starts.

    Raises:
        DataError: the marker reports rank 0's error, or the heartbeat did not change for
            ``timeout_s`` seconds (rank 0 stopped, hung, or the run directory is not shared).
    """
    marker, heartbeat = run_dir.prepared_marker(token), run_dir.prepare_heartbeat(token)
    started = last_note = last_change = clock()
    last_seen: Optional[bytes] = None
    # the first looks come sooner: a prepared cache is checked in ~0.1 s, and every rank (rank
    # 0 in its barrier) would wait out a whole poll; the ramp adds up to one poll, so the later
    # looks fall on whole polls from the start
    delays = iter((poll_s / 8, poll_s / 8, poll_s / 4, poll_s / 2))
    while True:
        try:
            result = json.loads(marker.read_text())
        except (OSError, ValueError):
            result = None
        if result is not None:
            if not result.get("ok"):
                raise DataError(
                    f"rank 0 could not prepare the data ({result.get('error')}): "
                    "see rank 0's log; fix it, or run `hetseq-hpc prepare` first"
                )
            return
        seen = _read(heartbeat)
        now = clock()
        if seen is not None and seen != last_seen:
            last_seen, last_change = seen, now
        elif now - last_change > timeout_s:
            raise DataError(
                f"rank 0 sent no heartbeat for {now - last_change:.0f} s while preparing the "
                f"data (stopped or hung, or {run_dir} not shared by every node?): see "
                f"{run_dir.rank_log(0)}; run `hetseq-hpc prepare` with the same overrides before "
                f"the job, or raise cluster.collective_timeout_s (now {timeout_s:g})"
            )
        if now - last_note >= NOTE_EVERY_S:
            log.info("still waiting for rank 0 to prepare the data (%.0f s)", now - started)
            last_note = now
        sleep(next(delays, poll_s))
