"""``cluster=<slurm cluster>``: the run as ONE heterogeneous SLURM job, through submitit.

submitit 1.5.4 has no het-job support (its issue #1741). Measured on a real Slurm 22.05, three
things break for a het job, and the subclasses here fix them:

1. ``srun --output .../%j_%t_log.out`` expands ``%j`` per component: tasks of component >= 1
   fail to launch. -> :func:`~hetseq_hpc.launch.sbatch.render_sbatch` redirects inside the step.
2. ``_num_tasks()`` counts component 0 only, so ``results()`` returns rank 0 only.
   -> :meth:`HetSlurmExecutor._num_tasks` counts every rank of every component.
3. The state watcher reads ``sacct`` rows ``17+0``, ``17+1``: the leader id stays UNKNOWN and a
   cancelled het job never finishes (and without accounting there is no ``sacct`` at all).
   -> :class:`~hetseq_hpc.launch.slurm_watch.HetSlurmInfoWatcher` asks ``squeue -t all``
   (jobs stay listed for MinJobAge) and folds the components' states into the leader's.

Pre-submission checks (:mod:`~hetseq_hpc.launch.slurm_checks`: partitions exist, carry the GRES
type, have enough nodes and CPUs, allow the time limit) use ``sinfo``; on any problem nothing is
submitted. ``sbatch`` itself is bounded and its answer read safely
(:mod:`~hetseq_hpc.launch.submit`). Waiting and naming the failed rank:
:mod:`~hetseq_hpc.launch.slurm_watch`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmExecutor

from hetseq_hpc.config import RunConfig, SlurmClusterConfig, load_run_config, save_run_config
from hetseq_hpc.env.preemption import REQUEUE
from hetseq_hpc.env.rank_guard import exit_at_shutdown, report_failure
from hetseq_hpc.errors import (
    ConfigError,
    LaunchError,
    Preempted,
    RankExcluded,
    RankFenced,
    StoreLost,
)
from hetseq_hpc.files.atomic import atomic_write_text
from hetseq_hpc.launch.command import CommandJobFunction
from hetseq_hpc.launch.failures import (
    StopWatch,
    note_stopped,
    pick_failure,
    write_stop_record,
)
from hetseq_hpc.launch.sbatch import render_sbatch, save_hand_submission
from hetseq_hpc.launch.slurm_checks import check_partitions, partition_inventory, require_slurm
from hetseq_hpc.launch.slurm_watch import (
    EXCLUDED_RESULT,
    TERMINAL_STATES,
    HetSlurmInfoWatcher,
    HetSlurmJob,
    fold_states,
    summary_stamp,
    task_outcomes,
    wait_for_job,
)
from hetseq_hpc.launch.submit import submit_script
from hetseq_hpc.rundir.lock import let_go, lock_run_dir
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.rundir.storage import reported

log = logging.getLogger(__name__)


class HetSlurmExecutor(SlurmExecutor):
    """submitit's Slurm executor for one het job over the partitions of a cluster config.

    Args:
        folder: submitit's folder (shared with the compute nodes); no ``%j`` in it.
        cluster: the SLURM cluster config (one het component per partition, in order).
        python: interpreter the tasks run (default: this one).
    """

    job_class = HetSlurmJob

    def __init__(
        self,
        folder: Path,
        cluster: SlurmClusterConfig,
        python: Optional[str] = None,
        elastic: bool = False,
        run_dir: Optional[RunDir] = None,
        restarts: int = 0,
        spare_nodes: int = 0,
    ):
        if "%" in str(folder):
            raise ConfigError(
                f"cluster.folder={str(folder)!r} must not hold '%' patterns: give a plain directory"
            )
        super().__init__(folder, max_num_timeout=cluster.max_num_timeout, python=python)
        self.cluster = cluster
        self.elastic, self.run_dir = elastic, run_dir
        self.restarts, self.spare_nodes = restarts, spare_nodes  # trainer.elastic: grow back
        self.python_path = python or sys.executable
        self.update_parameters(time=cluster.timeout_min, job_name=cluster.job_name)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(
            self.cluster,
            str(self.folder),
            self.python_path,
            self.elastic,
            self.run_dir,
            self.restarts,
            self.spare_nodes,
        )

    def _num_tasks(self) -> int:
        return self.cluster.world_size

    def _submit_command(self, command: str) -> HetSlurmJob:
        """submitit's ``_submit_command`` with the ``sbatch`` call bounded and read safely
        (:func:`~hetseq_hpc.launch.submit.submit_script`): the submission file (its name
        unique to this submission), sbatch, then the job and submitit's file layout.

        Raises:
            LaunchError: sbatch cannot run, refuses, hangs or answers without a job id (one
                line; any job of this submission found in the queue is cancelled first).
        """
        uid = uuid.uuid4().hex
        folder = submitit_utils.JobPaths.get_first_id_independent_folder(self.folder)
        script = folder / f".submission_file_{uid}.sh"
        script.write_text(self._make_submission_file_text(command, uid))
        try:
            job_id = submit_script(script, self.cluster.submit_timeout_s, self.cluster.job_name)
        except LaunchError:
            script.unlink(missing_ok=True)
            raise
        job = self.job_class(
            folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks()))
        )
        job.paths.move_temporary_file(script, "submission_file", keep_as_symlink=True)
        self._write_job_id(job.job_id, uid)
        self._set_job_permissions(job.paths.folder)
        return job


# ------------------------------------------------------------------------------ the job itself
@dataclass
class HetseqJobFunction:
    """What every task of the het job runs (pickled by submitit): one hetseq_hpc rank.

    Each (re)start reads the run's config, so a requeued job resumes from the run directory's
    latest checkpoint (``trainer.resume=auto``). A failed rank writes its own
    ``logs/rank<N>.error.json`` (:func:`~hetseq_hpc.env.rank_guard.report_failure`) for the
    launcher to name the cause, with how long the rank stood still if it was stopped
    (:class:`~hetseq_hpc.launch.failures.StopWatch`). A rank stopped after a checkpoint exits 3
    with no result (the requeued job writes them), and rank 0 records the stop in
    ``logs/stop.json`` (:func:`~hetseq_hpc.launch.failures.write_stop_record`). A rank the
    others left out (``RankExcluded``, in-job recovery; ``RankFenced`` when it found out at a
    write or as it came back) ends quietly: a log line, no error file, exit 0, and a result that
    says so (:data:`~hetseq_hpc.launch.slurm_watch.EXCLUDED_RESULT`); one cut off from the
    job's store (``StoreLost``) fails, writing nothing into the run directory.
    """

    config_path: str
    run_dir: str

    def __call__(self) -> Dict[str, Any]:
        from hetseq_hpc.worker import handle_preempted, run_worker

        run_dir = RunDir(self.run_dir)  # a plain string in the pickle: earlier jobs' too
        rank = int(os.environ.get("SLURM_PROCID", "0") or 0)
        watch = StopWatch().start()
        try:
            run = load_run_config(self.config_path)
            return run_worker(run, run_dir)
        except Preempted as exc:
            if exc.leads(rank):
                restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
                limit = run.cluster.max_requeues
                requeued = exc.code == REQUEUE and restarts < limit
                write_stop_record(
                    run_dir,
                    os.environ.get("SLURM_JOB_ID", ""),
                    exc.step,
                    exc.code,
                    restarts,
                    limit,
                    requeued,
                )
            handle_preempted(exc, run)
            if exc.after_lost_rank:  # no teardown of the broken world (rank_guard.FAILED)
                exit_at_shutdown(exc, 3)
            raise SystemExit(3) from None
        except StoreLost as exc:  # cut off from the job's store: a failure; nothing written
            exit_at_shutdown(exc, 1)  # no teardown of its broken group (rank_guard.FAILED)
            log.warning("rank %d: %s", rank, exc)
            raise
        except (RankExcluded, RankFenced) as exc:  # the others went on without this rank
            exit_at_shutdown(exc, 0)  # no teardown of its broken group (rank_guard.FAILED)
            log.warning("rank %d: %s", rank, exc)
            return {EXCLUDED_RESULT: True, "rank": rank}
        except Exception as exc:
            exit_at_shutdown(exc, 1)
            shown = reported(exc, run_dir)  # a full or read-only run directory: one line
            report_failure(shown, rank, run_dir.error_file(rank))
            note_stopped(run_dir.error_file(rank), watch.stopped_s)
            if shown is not exc:  # its result's last line: what the launcher names
                raise shown from None
            raise
        finally:
            watch.stop()


# ------------------------------------------------------------------------------ launch
def elastic_job(run: RunConfig) -> bool:
    """Whether the job recovers from a lost rank in-job (``trainer.elastic.enabled``, more than
    one rank; under FSDP by reloading the last checkpoint; never for a ``cluster.command``
    script): its script then serves the job's store and its step survives a task."""
    return bool(
        run.trainer.elastic.enabled and run.cluster.world_size > 1 and not run.cluster.command
    )


def job_function(run: RunConfig, config_path: str, run_dir: str) -> Any:
    """What every task runs: the worker, or the user's ``cluster.command``."""
    if run.cluster.command:
        return CommandJobFunction(list(run.cluster.command), run_dir)
    return HetseqJobFunction(config_path, run_dir)


def launch_slurm(run: RunConfig, run_dir: RunDir) -> Dict[str, Any]:
    """Submit ``run`` as one het job (or, with ``cluster.dry_run``, only write ``job.sbatch``).

    Returns:
        ``{"job_id", "folder", "run_dir", ...}``, plus rank 0's summary when waiting.

    Raises:
        LaunchError: Slurm missing, sinfo failing, submission refused, or (waiting) a failed job.
        ConfigError: a value unsafe for the sbatch script, or a partition that does not exist
            or lacks the GRES type, nodes, CPUs or time limit (nothing is submitted).
    """
    cluster: SlurmClusterConfig = run.cluster
    run_dir = run_dir.resolve()
    folder = Path(cluster.folder or run_dir.submitit).expanduser().resolve()
    elastic = elastic_job(run)
    grow = run.trainer.elastic.restarts if elastic else 0  # a lost rank replaced by a new step
    spare = run.trainer.elastic.spare_nodes if grow else 0
    script = render_sbatch(
        cluster, str(folder), sys.executable, elastic, run_dir, grow, spare
    )  # refuses unsafe values
    if not cluster.dry_run:
        require_slurm()
        check_partitions(cluster, partition_inventory(), spare)
    # the launcher holds the run-directory lock while it writes; rank 0 of the job takes it for
    # the run (hetseq_hpc.rundir.lock.claim_run_dir), so it is released before submitting
    with lock_run_dir(run_dir):
        config_path = save_run_config(run, run_dir.config)
        # an earlier job's errors and stop record must not be read as this job's
        for stale in [*run_dir.error_files(), run_dir.stop_record]:
            stale.unlink(missing_ok=True)
        if cluster.dry_run:
            path = run_dir.sbatch
            save_hand_submission(folder, job_function(run, str(config_path), str(run_dir)))
            atomic_write_text(path, script)
            print(
                f"dry run: wrote {path} ({cluster.world_size} ranks over "
                f"{len(cluster.partitions)} het component(s)); nothing was submitted; "
                f"submit it by hand with: sbatch {path}"
            )
            return {"dry_run": True, "sbatch": str(path), "config": str(config_path)}
        folder.mkdir(parents=True, exist_ok=True)
    let_go(run_dir)  # also the command line's hold: the job's rank 0 takes the lock
    executor = HetSlurmExecutor(
        folder, cluster, elastic=elastic, run_dir=run_dir, restarts=grow, spare_nodes=spare
    )
    before = summary_stamp(run_dir)  # a summary.json written from here on is this job's
    job = executor.submit(job_function(run, str(config_path), str(run_dir)))
    info = {
        "job_id": job.job_id,
        "folder": str(folder),
        "run_dir": str(run_dir),
        "ranks": cluster.world_size,
        "partitions": list(cluster.partitions),
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    atomic_write_text(run_dir.job, json.dumps(info, indent=2))
    print(
        f"submitted het job {job.job_id}: {cluster.world_size} ranks over "
        f"{', '.join(cluster.partitions)}"
    )
    print(f"  follow:  tail -f {run_dir.rank_log(0)}   (squeue -j {job.job_id})")
    print(f"  metrics: {run_dir.metrics}")
    print(f"  cancel:  scancel {job.job_id}")
    sys.stdout.flush()
    if not cluster.wait:
        return info
    summary = wait_for_job(
        job, run_dir, cluster.world_size, stream=True, elastic=elastic, summary_before=before
    )
    # a script's result is its exit, not a training summary of hetseq_hpc's worker
    info["command_result" if cluster.command else "summary"] = summary
    return info


def job_from_run_dir(run_dir: RunDir) -> Tuple[HetSlurmJob, int]:
    """Re-attach to the job a run directory's ``job.json`` names: ``(job, ranks)``."""
    info = json.loads(run_dir.job.read_text())
    job = HetSlurmJob(
        folder=info["folder"], job_id=str(info["job_id"]), tasks=list(range(int(info["ranks"])))
    )
    return job, int(info["ranks"])


__all__ = [
    "TERMINAL_STATES",
    "HetSlurmExecutor",
    "HetSlurmInfoWatcher",
    "HetSlurmJob",
    "HetseqJobFunction",
    "check_partitions",
    "fold_states",
    "job_from_run_dir",
    "launch_slurm",
    "partition_inventory",
    "pick_failure",
    "require_slurm",
    "task_outcomes",
    "wait_for_job",
]
