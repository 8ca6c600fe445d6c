"""Starting a loaded run (:func:`hetseq_hpc.cli.load.load_run`): a resumed one without Hydra,
a new one through Hydra, each under its run directory's lock, taken before anything is
written; a run with nothing left to train says so in one line and starts nothing."""

from __future__ import annotations

import logging
import sys

from hetseq_hpc.cli.dispatch import dispatch_or_exit
from hetseq_hpc.cli.hydra_entry import NewRunJob, start_with_hydra
from hetseq_hpc.cli.load import LoadedRun
from hetseq_hpc.cli.preflight import (
    check_resume,
    refuse_rewinding_a_finished_run,
    say_if_finished,
)
from hetseq_hpc.rundir.lock import acquire, lock_run_dir
from hetseq_hpc.rundir.logs import open_run_log
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger("hetseq_hpc")

#: Hydra's default console/file log format (hydra/conf/hydra/job_logging/default.yaml)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def start_run(loaded: LoadedRun) -> int:
    """Start ``loaded``: :func:`continue_saved_run` or :func:`start_new_run`; returns the exit
    code.

    Raises:
        CheckpointError: rewinding a finished run, or a checkpoint that does not fit.
        LaunchError: another run holds the run directory (nothing is written).
    """
    return start_new_run(loaded) if loaded.hydra is not None else continue_saved_run(loaded)


def start_new_run(loaded: LoadedRun) -> int:
    """Start a new run through Hydra from its one composition (:class:`NewRunJob`).

    The run directory's lock (:func:`hetseq_hpc.rundir.lock.acquire`) is taken before Hydra
    makes the directory or writes ``.hydra/``; a directory in use by another run is refused in
    one line, and the launcher then holds the same lock. A run with nothing left to train (a
    finished run re-run: :func:`~hetseq_hpc.cli.preflight.say_if_finished`) says so and starts
    nothing.

    Raises:
        CheckpointError, LaunchError: as :func:`start_run`.
    """
    assert loaded.hydra is not None
    run, run_dir = loaded.run, loaded.run_dir
    # a new directory can only hold nothing to train through a trainer.resume file: said
    # before the directory is created
    if not loaded.existed and say_if_finished(run, run_dir):
        return 0
    lock = acquire(run_dir)
    try:
        if loaded.existed:
            refuse_rewinding_a_finished_run(run, run_dir)
            if say_if_finished(run, run_dir):
                return 0
        job = NewRunJob(run, new_dir=not loaded.existed)
        start_with_hydra(loaded.hydra.composer, loaded.hydra.overrides, job)
    finally:
        lock.release()
    return 0


def _log_to(run_dir: RunDir) -> None:
    """Console and ``<run dir>/cli.log`` (appended), as Hydra sets them up for a new run."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    formatter = logging.Formatter(LOG_FORMAT)
    for handler in (logging.StreamHandler(sys.stdout), open_run_log(run_dir.cli_log)):
        if handler is not None:  # cli.log that cannot be opened: one warning, console only
            handler.setFormatter(formatter)
            root.addHandler(handler)


def continue_saved_run(loaded: LoadedRun) -> int:
    """Start the resumed run ``loaded`` (:func:`hetseq_hpc.cli.load.load_saved_run`) without
    Hydra, so the earlier run's ``.hydra/`` stays as it was and ``cli.log`` is appended to.

    The run directory is locked (:func:`hetseq_hpc.rundir.lock.lock_run_dir`) before anything
    is written; the checkpoint it resumes from must fit it; a finished run (the checkpoint at
    ``trainer.max_steps``) says so in one line, exit 0, and nothing starts.

    Raises:
        CheckpointError, LaunchError: as :func:`start_run`.
    """
    run, run_dir = loaded.run, loaded.run_dir
    with lock_run_dir(run_dir):  # before anything is written: a run turned away writes nothing
        check_resume(run, run_dir)
        refuse_rewinding_a_finished_run(run, run_dir)
        if say_if_finished(run, run_dir):  # a finished run: nothing started or rewritten
            return 0
        _log_to(run_dir)
        log.info(
            "continuing %s from its saved %s%s",
            run_dir,
            RunDir.CONFIG_NAME,
            f" with {' '.join(loaded.overrides)}" if loaded.overrides else "",
        )
        if loaded.task_code:
            log.info("task code imported from %s", loaded.task_code)
        dispatch_or_exit(run, run_dir)
    return 0
