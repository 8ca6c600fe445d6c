"""``cluster=<slurm cluster>``: the run as ONE heterogeneous SLURM job, through submitit.

submitit 1.5.4 has no het-job support (its issue #1741). Measured on a real Slurm 22.05, three
things break for a het job, and the subclasses here fix them:

1. ``srun --output .../%j_%t_log.out`` expands ``%j`` per component: tasks of component >= 1
   fail to launch. -> :func:`~hetseq_hpc.launch.sbatch.render_sbatch` redirects inside the step.
2. ``_num_tasks()`` counts component 0 only, so ``results()`` returns rank 0 only.
   -> :meth:`HetSlurmExecutor._num_tasks` counts every rank of every component.
3. The state watcher reads ``sacct`` rows ``17+0``, ``17+1``: the leader id stays UNKNOWN and a
   cancelled het job never finishes (and without accounting there is no ``sacct`` at all).
   -> :class:`HetSlurmInfoWatcher` asks ``squeue -t all`` (jobs stay listed for MinJobAge)
   and folds the components' states into the leader's, falling back to ``sacct``.

Pre-submission checks (partitions exist, carry the GRES type, have enough nodes) use ``sinfo``;
on any problem nothing is submitted.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from hetseq_hpc.config import RunConfig, SlurmClusterConfig, load_run_config, save_run_config
from hetseq_hpc.errors import ConfigError, LaunchError
from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.worker import CONFIG_NAME

log = logging.getLogger(__name__)

#: Slurm states after which a job will not produce more results
TERMINAL_STATES = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}
#: precedence when folding component states into one (first match wins)
_FOLD_ORDER = ["FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "DEADLINE",
               "CANCELLED", "PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING",
               "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "COMPLETED"]


def fold_states(states: List[str]) -> str:
    """One state for a het job from its components' states (a failure anywhere wins; the job
    is COMPLETED only when every component is)."""
    clean = [s.split()[0].upper() for s in states if s]
    if not clean:
        return "UNKNOWN"
    for state in _FOLD_ORDER:
        if state in clean:
            return state
    return clean[0]


class HetSlurmInfoWatcher(SlurmInfoWatcher):
    """State of (het) jobs from ``squeue -t all``, with ``sacct`` as fallback."""

    def _make_command(self) -> Optional[List[str]]:
        to_check = {x.split("_")[0] for x in self._registered - self._finished}
        if not to_check:
            return None
        return ["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", ",".join(sorted(to_check))]

    def read_info(self, string: Any) -> Dict[str, Dict[str, str]]:
        """Parse ``id|STATE`` rows; ``12+1`` rows are folded into job ``12``."""
        if not isinstance(string, str):
            string = string.decode()
        per_job: Dict[str, List[str]] = {}
        for line in string.splitlines():
            if "|" not in line:
                continue
            job, state = line.strip().split("|", 1)
            per_job.setdefault(job.split("+")[0], []).append(state)
        return {job: {"State": fold_states(states), "JobID": job} for job, states in per_job.items()}

    def update(self) -> None:
        """Refresh every registered job's state (squeue, then sacct for jobs squeue forgot)."""
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        try:
            output = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
            info = self.read_info(output)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("squeue failed (%s): job states may lag", exc)
            info = {}
        missing = [j for j in command[-1].split(",") if j not in info]
        if missing and shutil.which("sacct"):
            info.update(self._sacct(missing))
        self._info_dict.update(info)
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _sacct(self, jobs: List[str]) -> Dict[str, Dict[str, str]]:
        try:
            out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(jobs)],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return {}
        if out.returncode != 0:
            return {}
        return self.read_info(out.stdout)


class HetSlurmJob(SlurmJob):
    """A submitit job whose state comes from :class:`HetSlurmInfoWatcher`."""

    watcher = HetSlurmInfoWatcher(delay_s=30)


class HetSlurmExecutor(SlurmExecutor):
    """submitit's Slurm executor for one het job over the partitions of a cluster config.

    Args:
        folder: submitit's folder (shared with the compute nodes); no ``%j`` in it.
        cluster: the SLURM cluster config (one het component per partition, in order).
        python: interpreter the tasks run (default: this one).
    """

    job_class = HetSlurmJob

    def __init__(self, folder: Path, cluster: SlurmClusterConfig, python: Optional[str] = None):
        if "%" in str(folder):
            raise ConfigError(f"cluster.folder={str(folder)!r} must not hold '%' patterns: give a "
                              "plain directory")
        super().__init__(folder, max_num_timeout=cluster.max_num_timeout, python=python)
        self.cluster = cluster
        self.python_path = python or sys.executable
        self.update_parameters(time=cluster.timeout_min, job_name=cluster.job_name)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(self.cluster, str(self.folder), self.python_path)

    def _num_tasks(self) -> int:
        return self.cluster.world_size


# ------------------------------------------------------------------------------ the job itself
@dataclass
class HetseqJobFunction:
    """What every task of the het job runs (pickled by submitit): one hetseq_hpc rank.

    Each (re)start reads the run's config, so a requeued job resumes from the run directory's
    latest checkpoint (``trainer.resume=auto``).
    """

    config_path: str
    run_dir: str

    def __call__(self) -> Dict[str, Any]:
        from hetseq_hpc.worker import run_in_job

        return run_in_job(load_run_config(self.config_path), self.run_dir)


# ------------------------------------------------------------------------------ preflight
def require_slurm() -> None:
    """Raise if the Slurm client commands are missing.

    Raises:
        LaunchError: names the missing command and suggests ``cluster=local``.
    """
    missing = [cmd for cmd in ("sbatch", "srun", "squeue", "sinfo") if shutil.which(cmd) is None]
    if missing:
        raise LaunchError(
            f"Slurm is not available here ({', '.join(missing)} not found): run this on a login "
            "node of a SLURM cluster, use cluster.dry_run=true to only write the sbatch script, "
            "or use cluster=local"
        )


def partition_inventory() -> Dict[str, Dict[str, Any]]:
    """``{partition: {"nodes": int, "gres": [str, ...]}}`` from ``sinfo``.

    Raises:
        LaunchError: sinfo fails (controller down, no config).
    """
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R|%D|%G"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(f"sinfo could not run ({exc}): check the Slurm client setup") from None
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["no output"])[0]
        raise LaunchError(f"sinfo failed ({first}): is slurmctld reachable (scontrol ping)?")
    inventory: Dict[str, Dict[str, Any]] = {}
    for line in out.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3:
            continue
        name, nodes, gres = fields
        entry = inventory.setdefault(name, {"nodes": 0, "gres": []})
        entry["nodes"] += int(nodes) if nodes.isdigit() else 0
        entry["gres"].append(gres)
    return inventory


def check_partitions(cluster: SlurmClusterConfig, inventory: Dict[str, Dict[str, Any]]) -> None:
    """Every partition exists, has the nodes asked for and carries the GRES type.

    Raises:
        ConfigError: one line naming the partition, what is missing and what exists.
    """
    for key, part in cluster.partitions.items():
        where = f"cluster.partitions.{key}"
        info = inventory.get(part.partition)
        if info is None:
            raise ConfigError(
                f"{where}.partition={part.partition!r} does not exist on this cluster (sinfo lists "
                f"{sorted(inventory)}): use one of those"
            )
        if info["nodes"] < part.nodes:
            raise ConfigError(
                f"{where}.nodes={part.nodes} but partition {part.partition!r} has {info['nodes']} "
                f"node(s): lower {where}.nodes"
            )
        if part.gpu_type:
            wanted = f"gpu:{part.gpu_type}"
            if not any(wanted in g for g in info["gres"]):
                raise ConfigError(
                    f"{where}.gpu_type={part.gpu_type!r}: partition {part.partition!r} has no "
                    f"{wanted} GRES (its nodes offer {sorted(set(info['gres']))}): use the GPU "
                    "type sinfo -o '%P %G' shows"
                )


# ------------------------------------------------------------------------------ waiting
def task_outcomes(folder: Path, job_id: str, num_tasks: int) -> Dict[int, Tuple[str, Any]]:
    """Result pickles present so far: ``rank -> ("success", summary) | ("error", traceback)``."""
    out = {}
    for rank in range(num_tasks):
        path = Path(folder) / f"{job_id}_{rank}_result.pkl"
        if path.exists():
            try:
                out[rank] = submitit_utils.pickle_load(path)
            except (EOFError, OSError):
                continue  # being written
    return out


#: error text of a rank that only saw a peer die (the effect, not the cause)
_PEER_ERRORS = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
                "Broken pipe", "gloo", "NCCL communicator was aborted")


def pick_failure(errors: Dict[int, str]) -> int:
    """The rank whose error is the cause: the lowest rank whose traceback is not a peer's
    disconnection (those follow any failure), else the lowest rank."""
    causes = [r for r, trace in errors.items()
              if not any(marker in _last_line(trace) for marker in _PEER_ERRORS)]
    return min(causes or errors)


def _last_line(trace: str) -> str:
    lines = [l for l in str(trace).strip().splitlines() if l.strip()]
    return lines[-1].strip() if lines else "unknown error"


def wait_for_job(job: HetSlurmJob, run_dir: Path, num_tasks: int, poll_s: float = 1.0,
                 stream: bool = False, timeout_s: Optional[float] = None) -> Dict[str, Any]:
    """Wait until every rank returned, a rank failed, or Slurm ended the job.

    Args:
        job: the submitted job.
        run_dir: the run directory (rank 0's log is streamed from ``logs/rank0.log``).
        num_tasks: ranks in the job.
        poll_s: seconds between checks.
        stream: copy rank 0's log to stderr while waiting.
        timeout_s: give up after this long (None = wait as long as the job lives).

    Returns:
        rank 0's summary.

    Raises:
        LaunchError: a rank raised (its rank and last error line are named), or the job ended
            without results (CANCELLED, TIMEOUT, ...), or ``timeout_s`` passed.
    """
    folder = Path(job.paths.folder)
    log_path = Path(run_dir) / "logs" / "rank0.log"
    offset = 0
    start = time.monotonic()
    ended_at: Optional[float] = None
    while True:
        if stream and log_path.exists():
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset = fh.tell()
            if chunk:
                sys.stderr.write(chunk)
                sys.stderr.flush()
        outcomes = task_outcomes(folder, job.job_id, num_tasks)
        errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error"}
        if errors:
            time.sleep(poll_s)  # let the other ranks' results land, then pick the cause
            outcomes = task_outcomes(folder, job.job_id, num_tasks)
            errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error"}
            rank = pick_failure(errors)
            raise LaunchError(
                f"job {job.job_id}: rank {rank} failed: {_last_line(errors[rank])} (log: "
                f"{folder / f'{job.job_id}_{rank}_log.err'})"
            )
        if len(outcomes) == num_tasks:
            return outcomes[0][1]
        state = job.watcher.get_state(job.job_id, mode="force")
        if state in TERMINAL_STATES:
            # results may still be landing on a shared filesystem: give them a moment
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 5.0:
                raise LaunchError(
                    f"job {job.job_id} ended {state} before every rank finished ({len(outcomes)}/"
                    f"{num_tasks} results): see {folder} and {Path(run_dir) / 'logs'}"
                )
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise LaunchError(f"job {job.job_id} still {state} after {timeout_s:.0f} s: "
                              f"scancel {job.job_id} to stop it")
        time.sleep(poll_s)


# ------------------------------------------------------------------------------ launch
def launch_slurm(run: RunConfig, run_dir: Path) -> Dict[str, Any]:
    """Submit ``run`` as one het job (or, with ``cluster.dry_run``, only write ``job.sbatch``).

    Returns:
        ``{"job_id", "folder", "run_dir", ...}``, plus rank 0's summary when waiting.

    Raises:
        LaunchError: Slurm missing, sinfo failing, submission refused, or (waiting) a failed job.
        ConfigError: a partition does not exist or lacks the GRES type / nodes.
    """
    cluster: SlurmClusterConfig = run.cluster
    run_dir = Path(run_dir).resolve()
    folder = Path(cluster.folder or run_dir / "submitit").expanduser().resolve()
    config_path = save_run_config(run, run_dir / CONFIG_NAME)
    if cluster.dry_run:
        script = render_sbatch(cluster, str(folder), sys.executable)
        path = run_dir / "job.sbatch"
        path.write_text(script)
        print(f"dry run: wrote {path} ({cluster.world_size} ranks over "
              f"{len(cluster.partitions)} het component(s)); nothing was submitted")
        return {"dry_run": True, "sbatch": str(path), "config": str(config_path)}
    require_slurm()
    check_partitions(cluster, partition_inventory())
    folder.mkdir(parents=True, exist_ok=True)
    executor = HetSlurmExecutor(folder, cluster)
    try:
        job = executor.submit(HetseqJobFunction(str(config_path), str(run_dir)))
    except submitit_utils.FailedJobError as exc:
        first = _last_line(str(exc))
        raise LaunchError(f"sbatch refused the job ({first}): check the partitions' limits") from None
    info = {
        "job_id": job.job_id, "folder": str(folder), "run_dir": str(run_dir),
        "ranks": cluster.world_size, "partitions": list(cluster.partitions),
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (run_dir / "job.json").write_text(json.dumps(info, indent=2))
    print(f"submitted het job {job.job_id}: {cluster.world_size} ranks over "
          f"{', '.join(cluster.partitions)}")
    print(f"  follow:  tail -f {run_dir / 'logs' / 'rank0.log'}   (squeue -j {job.job_id})")
    print(f"  metrics: {run_dir / 'metrics.jsonl'}")
    print(f"  cancel:  scancel {job.job_id}")
    sys.stdout.flush()
    if not cluster.wait:
        return info
    summary = wait_for_job(job, run_dir, cluster.world_size, stream=True)
    info["summary"] = summary
    return info


def job_from_run_dir(run_dir: Path) -> Tuple[HetSlurmJob, int]:
    """Re-attach to the job a run directory's ``job.json`` names: ``(job, ranks)``."""
    info = json.loads((Path(run_dir) / "job.json").read_text())
    job = HetSlurmJob(folder=info["folder"], job_id=str(info["job_id"]),
                      tasks=list(range(int(info["ranks"]))))
    return job, int(info["ranks"])


__all__ = ["HetSlurmExecutor", "HetSlurmInfoWatcher", "HetSlurmJob", "HetseqJobFunction",
           "check_partitions", "fold_states", "launch_slurm", "partition_inventory",
           "require_slurm", "task_outcomes", "wait_for_job", "job_from_run_dir"]
