"""Render the sbatch script of a heterogeneous job: one het component per partition, one
``srun --het-group=0-K`` step that starts one task per rank across all of them.

Each task's stdout/stderr go to ``<folder>/<job id>_<rank>_log.{out,err}`` by redirection inside
the step (the names submitit's ``JobPaths`` expects); :func:`save_hand_submission` lets
``sbatch <run dir>/job.sbatch`` run the same job by hand. Slurm's syntax, why not
``srun --output`` (submitit's het-job issue #1741) and how a hand submission finds its job:
docs/design/slurm-launch.md, "The het-job sbatch script".
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, List, Optional

from hetseq_hpc.config.schema import PartitionConfig, SlurmClusterConfig
from hetseq_hpc.env.world import HET_NTASKS_ENV
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.rundir.paths import RunDir

#: the job function a dry run saves for a submission by hand (in submitit's folder)
HAND_PICKLE = "hand_submitted.pkl"
#: what each task of the step runs: submitit's job process, ended without the interpreter's
#: teardown once the result is written (:mod:`hetseq_hpc.launch.slurm_task`)
TASK_MODULE = "hetseq_hpc.launch.slurm_task"
#: signal Slurm sends ``signal_delay_s`` before the time limit (submitit's default, USR2:
#: NCCL may catch USR1)
PREEMPT_SIGNAL = "USR2"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: characters that would end a line of the script (or hide text from a reader): never written
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029\x85]")


def _clean(where: str, value: object) -> str:
    """``value`` as text without control characters (a newline would start a new shell line).

    Raises:
        ConfigError: ``value`` holds a newline or another control character.
    """
    text = str(value)
    if _CONTROL.search(text):
        raise ConfigError(
            f"{where}={text!r} holds a newline or control character, which is not "
            "allowed in an sbatch script: remove it"
        )
    return text


def _opt(name: str, value: object, where: str) -> str:
    """``--name=value`` with the value shell-quoted (sbatch reads ``#SBATCH`` lines with shell
    quoting rules: a path with spaces or quotes survives, measured on Slurm 22.05)."""
    return f"--{name}={shlex.quote(_clean(where, value))}"


def _mem(mem_gb: float) -> str:
    return f"{int(mem_gb)}G" if float(mem_gb).is_integer() else f"{int(mem_gb * 1024)}M"


def component_options(
    part: PartitionConfig, timeout_min: int, where: str = "partition", spare_nodes: int = 0
) -> List[str]:
    """``#SBATCH`` options of one het component (one partition); every value shell-quoted.
    ``spare_nodes`` (``trainer.elastic.spare_nodes``) more nodes than ``part.nodes`` are
    reserved for replacements of lost ranks.

    Raises:
        ConfigError: a value holds a newline or control character (``where`` names it).
    """
    opts = [
        _opt("partition", part.partition, f"{where}.partition"),
        _opt("nodes", int(part.nodes) + int(spare_nodes), f"{where}.nodes"),
        _opt("ntasks-per-node", int(part.ranks_per_node_effective), f"{where}.ranks_per_node"),
        _opt("cpus-per-task", int(part.cpus_per_rank), f"{where}.cpus_per_rank"),
        _opt("mem", _mem(part.mem_gb), f"{where}.mem_gb"),
        _opt("time", int(timeout_min), "cluster.timeout_min"),
    ]
    if part.gpu_type:
        gres = f"gpu:{_clean(f'{where}.gpu_type', part.gpu_type)}:{int(part.gpus_per_node)}"
        opts.append(_opt("gres", gres, f"{where}.gpu_type"))
    for name in ("account", "qos", "constraint"):
        value = getattr(part, name)
        if value:
            opts.append(_opt(name, value, f"{where}.{name}"))
    for key, value in part.extra_sbatch.items():
        flag = _clean(f"{where}.extra_sbatch key", key).replace("_", "-")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", flag):
            raise ConfigError(
                f"{where}.extra_sbatch key {key!r} is not an sbatch option name: "
                "use letters, digits and '-' (e.g. exclude)"
            )
        opts.append(_opt(flag, value, f"{where}.extra_sbatch.{key}"))
    return opts


def srun_command(
    cluster: SlurmClusterConfig,
    folder: str,
    python: str,
    elastic: bool = False,
    spare_nodes: int = 0,
) -> str:
    """The one step over every component; each task runs submitit's job process
    (:data:`TASK_MODULE`). With ``elastic`` (in-job recovery) the step survives a task's death:
    ``--kill-on-bad-exit=0`` (a task that exits non-zero does not end the step) and
    ``--no-kill`` (nor does a lost node), https://slurm.schedmd.com/srun.html. With
    ``spare_nodes`` each component's part of the step names its node and task counts
    (``srun ... : ...``, one part per component), so the spare nodes stay idle (Slurm places a
    step on the first nodes of the allocation)."""
    k = len(cluster.partitions)
    inner = (
        f'exec "$0" -u -m {TASK_MODULE} "$1" '
        '>>"$1/${SLURM_JOB_ID}_${SLURM_PROCID}_log.out" '
        '2>>"$1/${SLURM_JOB_ID}_${SLURM_PROCID}_log.err"'
    )
    survive = ["--kill-on-bad-exit=0", "--no-kill"] if elastic else ["--kill-on-bad-exit=1"]
    task = ["bash", "-c", inner, python, folder]
    if not spare_nodes:
        het = [f"--het-group=0-{k - 1}"] if k > 1 else []
        parts = ["srun", "--unbuffered", *het, *survive, *task]
    else:
        parts = ["srun"]
        for index, part in enumerate(cluster.partitions.values()):
            counts = [f"--nodes={int(part.nodes)}", f"--ntasks={int(part.num_ranks)}"]
            het = [f"--het-group={index}"] if k > 1 else []
            parts += [":"] if index else []
            parts += ["--unbuffered", *het, *counts, *survive, *task]
    return " ".join(p if p == ":" else shlex.quote(p) for p in parts)


def regrow_command(python: str, run_dir: RunDir, folder: str, srun: str) -> str:
    """The step of an elastic job with ``trainer.elastic.restarts``, run through the
    supervisor of :mod:`hetseq_hpc.launch.slurm_regrow`: it starts ``srun`` (the main step)
    and starts a new step for each rank the others left out, on its node or a spare one."""
    head = [
        python,
        "-m",
        "hetseq_hpc.launch.slurm_regrow",
        "--config",
        str(run_dir.config),
        "--run-dir",
        str(run_dir),
        "--folder",
        folder,
        "--",
    ]
    return " ".join(shlex.quote(_clean("run_dir", p)) for p in head) + " " + srun


def store_lines(python: str, folder: str, nodes: int = 1) -> List[str]:
    """The batch script's part of in-job recovery: serve the job's store on the batch host
    (:mod:`hetseq_hpc.distributed.store_server`, listening on one address of that host that
    the other ``nodes`` reach: ``--host auto``, never ``$(hostname)``, which Debian-style hosts
    resolve to 127.0.1.1), give the ranks its address and a fresh token in their environment
    (the token never on a command line), end it on exit; the job fails at once when the store
    does not start."""
    where = shlex.quote(folder) + '/"${SLURM_JOB_ID}_store.address"'
    return [
        "",
        "# in-job recovery (trainer.elastic): the job's store, here on the batch host, in no rank",
        'HETSEQ_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d " \\n")',
        "export HETSEQ_JOB_TOKEN",
        f"rm -f {where}",
        f"{shlex.quote(python)} -m hetseq_hpc.distributed.store_server --host auto "
        f"--nodes {int(nodes)} --address-file {where} &",
        "store_pid=$!",
        "trap 'kill $store_pid 2>/dev/null' EXIT",
        f"for _ in $(seq 1 600); do [ -s {where} ] && break; kill -0 $store_pid 2>/dev/null || break; "
        "sleep 0.1; done",
        f"if [ ! -s {where} ]; then echo \"hetseq-hpc: error: the job's store did not start "
        f'(its error is above)" >&2; exit 1; fi',
        f'export HETSEQ_STORE="$(cat {where})"',
    ]


#: seconds a step may go on after the run's summary.json was written before the batch script
#: ends it (``HETSEQ_END_GRACE_S`` in the job's environment overrides): the survivors have
#: exited by then; a task still there was stopped or hung and left out of the run
END_GRACE_S = 20


def survived_lines(srun: str, summary: str) -> List[str]:
    """The step of an elastic job and its exit code. ``srun`` fails when a task was lost
    (killed, its node gone) even though the survivors finished the run, so the script exits 0
    when the run's ``summary.json`` was written after the script started (a whole run done in
    this job; rank 0, or the survivors when it was lost, write it at the very end: the file
    ``summary``), else with
    srun's code: Slurm then records COMPLETED, and ``--dependency=afterok`` chains go on.

    A task the others left out because it was stopped or hung (SIGSTOP, a stuck driver) never
    exits, so srun would hold the job until its time limit: srun runs in the background and,
    :data:`END_GRACE_S` after ``summary.json`` appeared with srun still running, the script
    ends the step (two SIGINTs within a second: srun's own "terminate the step",
    https://slurm.schedmd.com/srun.html, signals) and exits 0 as above."""
    return [
        f"summary={shlex.quote(summary)}",
        "started=$(date +%s)",
        f"{srun} &",
        "srun_pid=$!",
        "finished() {  # the run's summary.json, written in this job (by rank 0, or the survivors)",
        '  [ -f "$summary" ] && [ "$(stat -c %Y "$summary")" -ge "$started" ]',
        "}",
        "finished_at=",
        f"grace=${{HETSEQ_END_GRACE_S:-{END_GRACE_S}}}",
        'while kill -0 "$srun_pid" 2>/dev/null; do',
        '  if [ -z "$finished_at" ] && finished; then finished_at=$(date +%s); fi',
        '  if [ -n "$finished_at" ] && [ $(( $(date +%s) - finished_at )) -ge "$grace" ]; then',
        '    echo "hetseq-hpc: the run finished ($summary) but a task was still running $grace s '
        'later (stopped or hung, left out of the run): ending the step" >&2',
        '    kill -INT "$srun_pid"; sleep 0.3; kill -INT "$srun_pid"',
        "    break",
        "  fi",
        "  sleep 2",
        "done",
        "status=0",
        'wait "$srun_pid" || status=$?',
        '[ "$status" = 0 ] && exit 0',
        "if finished; then",
        '  echo "hetseq-hpc: srun exited $status (a task was lost), but the others finished the '
        'run: $summary" >&2',
        "  exit 0",
        "fi",
        'exit "$status"',
    ]


def render_sbatch(
    cluster: SlurmClusterConfig,
    folder: str,
    python: str,
    elastic: bool = False,
    run_dir: Optional[RunDir] = None,
    restarts: int = 0,
    spare_nodes: int = 0,
) -> str:
    """The complete sbatch script.

    Args:
        cluster: a validated SLURM cluster config (``partitions`` in het-component order).
        folder: submitit's folder (absolute, shared with the compute nodes).
        python: the Python interpreter the tasks run (absolute path).
        elastic: in-job recovery from a lost rank (``trainer.elastic`` of a DDP run): the
            script serves the job's store (:func:`store_lines`) and the step survives a
            task's death (:func:`srun_command`).
        run_dir: the run directory (elastic only): the script exits 0 when the survivors of a
            lost task finished the run there (:func:`survived_lines`).
        restarts: ``trainer.elastic.restarts`` (elastic with ``run_dir`` only): the step runs
            under the grow-back supervisor (:func:`regrow_command`).
        spare_nodes: ``trainer.elastic.spare_nodes`` (with ``restarts``): nodes reserved in
            every component beyond its ``nodes`` (:func:`component_options`).

    Raises:
        ConfigError: an environment variable name in ``cluster.env`` is unsafe, or a value
            written into the script holds a newline or control character (defence in depth:
            config validation rejects them first; every value is also shell-quoted).
    """
    _clean("cluster.folder", folder)
    _clean("python", python)
    grow = elastic and run_dir is not None and restarts > 0
    spare_nodes = spare_nodes if grow else 0
    k = len(cluster.partitions)
    world = cluster.world_size
    lines = [
        "#!/bin/bash",
        f"# hetseq_hpc: {k} het component(s), {world} rank(s); written by hetseq_hpc.launch.sbatch",
        f"#SBATCH {_opt('job-name', cluster.job_name, 'cluster.job_name')}",
        f"#SBATCH --signal={PREEMPT_SIGNAL}@{int(cluster.signal_delay_s)}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH {_opt('output', f'{folder}/%j_batch.out', 'cluster.folder')}",
        f"#SBATCH {_opt('error', f'{folder}/%j_batch.err', 'cluster.folder')}",
    ]
    for index, (key, part) in enumerate(cluster.partitions.items()):
        where = f"cluster.partitions.{_clean('cluster.partitions key', key)}"
        if index:
            lines.append("#SBATCH hetjob")
        opts = component_options(part, cluster.timeout_min, where, spare_nodes)
        lines.append(
            f"# het component {index}: {key} = partition {_clean(where, part.partition)}, "
            f"{_clean(where, part.gpu_type or 'CPU')}, {int(part.nodes)} node(s) x "
            f"{int(part.ranks_per_node_effective)} rank(s)"
            + (f" + {spare_nodes} spare node(s)" if spare_nodes else "")
        )
        lines.extend(f"#SBATCH {opt}" for opt in opts)
    # cluster.env first, so that cluster.setup sees it
    lines += ["", "# environment (cluster.env)", "export SUBMITIT_EXECUTOR=slurm"]
    for name, value in cluster.env.items():
        if not _ENV_NAME.match(str(name)):
            raise ConfigError(
                f"cluster.env key {name!r} is not a variable name: use [A-Za-z_][A-Za-z0-9_]*"
            )
        lines.append(f"export {name}={shlex.quote(str(value))}")
    lines += ["", "# setup (cluster.setup)"]
    lines += list(cluster.setup)
    hand = shlex.quote(f"{folder}/{HAND_PICKLE}")
    mine = shlex.quote(folder) + '/"${SLURM_JOB_ID}_submitted.pkl"'
    lines += [
        "",
        "# submitted by hand (sbatch job.sbatch after hetseq-hpc render): run the job "
        "function saved with this script",
        f"if [ -e {hand} ] && [ ! -e {mine} ]; then",
        f"  cp {hand} {mine}",
        "fi",
    ]
    if elastic:
        nodes = sum(int(p.nodes) + spare_nodes for p in cluster.partitions.values())
        lines += store_lines(python, folder, nodes)
    srun = srun_command(cluster, folder, python, elastic, spare_nodes)
    lines += ["", "# one step over all het components, one task per rank"]
    if spare_nodes and k > 1:  # Slurm's SLURM_NTASKS_HET_GROUP_<k> count the spares' tasks
        counts = ",".join(str(int(p.num_ranks)) for p in cluster.partitions.values())
        lines.append(f"export {HET_NTASKS_ENV}={counts}")
    if elastic and run_dir is not None:
        _clean("run_dir", run_dir)
        if grow:  # a lost rank is replaced by a new step (trainer.elastic.restarts)
            srun = regrow_command(python, run_dir, folder, srun)
        lines += survived_lines(srun, str(run_dir.summary))
    else:
        lines.append(srun)
    lines.append("")
    return "\n".join(lines)


def save_hand_submission(folder: Path, function: Any) -> Path:
    """Create submitit's ``folder`` (the script's ``--output`` folder) and save ``function`` as
    :data:`HAND_PICKLE` (submitit's ``DelayedSubmission``, cloudpickled, written atomically),
    so the script :func:`render_sbatch` wrote can be submitted by hand with ``sbatch``."""
    import cloudpickle
    from submitit.core.utils import DelayedSubmission

    from hetseq_hpc.files.atomic import atomic_write

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return atomic_write(
        folder / HAND_PICKLE, lambda fh: cloudpickle.dump(DelayedSubmission(function), fh)
    )


__all__ = [
    "HAND_PICKLE",
    "PREEMPT_SIGNAL",
    "TASK_MODULE",
    "component_options",
    "regrow_command",
    "render_sbatch",
    "save_hand_submission",
    "srun_command",
    "store_lines",
    "survived_lines",
]
