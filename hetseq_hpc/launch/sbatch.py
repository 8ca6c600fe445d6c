"""Render the sbatch script of a heterogeneous job: one het component per partition, one
``srun --het-group=0-K`` step that starts one task per rank across all of them.

Syntax from Slurm's heterogeneous-job documentation
(https://slurm.schedmd.com/heterogeneous_jobs.html): components are separated by
``#SBATCH hetjob``; options such as ``--job-name``, ``--output`` and ``--error`` propagate from
the first component, while ``--partition``, ``--nodes``, ``--ntasks-per-node``, ``--mem`` and
``--gres`` are given for every component. The script runs on the first node of component 0.

Each task's stdout/stderr go to ``<folder>/<job id>_<rank>_log.{out,err}`` by redirection
inside the step, not by ``srun --output``: in a het step ``%j`` expands to each component's own
job id and ``%t`` restarts per component, and a folder holding ``%j`` made tasks of component
>= 1 fail to launch (measured with submitit 1.5.4, ../shared/slurm-facts.md). The names are the
ones submitit's ``JobPaths`` expects (``SLURM_JOB_ID`` is the leader id in every task).
"""

from __future__ import annotations

import re
import shlex
from typing import List

from hetseq_hpc.config.schema import PartitionConfig, SlurmClusterConfig
from hetseq_hpc.errors import ConfigError

#: signal Slurm sends ``signal_delay_s`` before the time limit (submitit's default, USR2:
#: NCCL may catch USR1)
PREEMPT_SIGNAL = "USR2"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _mem(mem_gb: float) -> str:
    return f"{int(mem_gb)}G" if float(mem_gb).is_integer() else f"{int(mem_gb * 1024)}M"


def component_options(part: PartitionConfig, timeout_min: int) -> List[str]:
    """``#SBATCH`` options of one het component (one partition)."""
    opts = [
        f"--partition={part.partition}",
        f"--nodes={part.nodes}",
        f"--ntasks-per-node={part.ranks_per_node_effective}",
        f"--cpus-per-task={part.cpus_per_rank}",
        f"--mem={_mem(part.mem_gb)}",
        f"--time={timeout_min}",
    ]
    if part.gpu_type:
        opts.append(f"--gres=gpu:{part.gpu_type}:{part.gpus_per_node}")
    for name in ("account", "qos", "constraint"):
        value = getattr(part, name)
        if value:
            opts.append(f"--{name}={value}")
    for key, value in part.extra_sbatch.items():
        opts.append(f"--{key.replace('_', '-')}={value}")
    return opts


def srun_command(cluster: SlurmClusterConfig, folder: str, python: str) -> str:
    """The one step over every component; each task runs submitit's entry point."""
    k = len(cluster.partitions)
    het = [f"--het-group=0-{k - 1}"] if k > 1 else []
    inner = ('exec "$0" -u -m submitit.core._submit "$1" '
             '>>"$1/${SLURM_JOB_ID}_${SLURM_PROCID}_log.out" '
             '2>>"$1/${SLURM_JOB_ID}_${SLURM_PROCID}_log.err"')
    parts = ["srun", "--unbuffered", *het, "--kill-on-bad-exit=1", "bash", "-c", inner, python,
             folder]
    return " ".join(shlex.quote(p) for p in parts)


def render_sbatch(cluster: SlurmClusterConfig, folder: str, python: str) -> str:
    """The complete sbatch script.

    Args:
        cluster: a validated SLURM cluster config (``partitions`` in het-component order).
        folder: submitit's folder (absolute, shared with the compute nodes).
        python: the Python interpreter the tasks run (absolute path).

    Raises:
        ConfigError: an environment variable name or value in ``cluster.env`` is unsafe.
    """
    for opt_value in (folder, python):
        if "\n" in opt_value:
            raise ConfigError(f"path {opt_value!r} holds a newline: use a path without one")
    k = len(cluster.partitions)
    world = cluster.world_size
    lines = [
        "#!/bin/bash",
        f"# hetseq_hpc: {k} het component(s), {world} rank(s); written by hetseq_hpc.launch.sbatch",
        f"#SBATCH --job-name={cluster.job_name}",
        f"#SBATCH --signal={PREEMPT_SIGNAL}@{cluster.signal_delay_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={folder}/%j_batch.out",
        f"#SBATCH --error={folder}/%j_batch.err",
    ]
    for index, (key, part) in enumerate(cluster.partitions.items()):
        if index:
            lines.append("#SBATCH hetjob")
        lines.append(f"# het component {index}: {key} = partition {part.partition}, "
                     f"{part.gpu_type or 'CPU'}, {part.nodes} node(s) x "
                     f"{part.ranks_per_node_effective} rank(s)")
        lines.extend(f"#SBATCH {opt}" for opt in component_options(part, cluster.timeout_min))
    lines += ["", "# setup"]
    lines += list(cluster.setup)
    lines.append("export SUBMITIT_EXECUTOR=slurm")
    for name, value in cluster.env.items():
        if not _ENV_NAME.match(str(name)):
            raise ConfigError(f"cluster.env key {name!r} is not a variable name: use [A-Za-z_][A-Za-z0-9_]*")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    lines += ["", "# one step over all het components, one task per rank",
              srun_command(cluster, folder, python), ""]
    return "\n".join(lines)


__all__ = ["PREEMPT_SIGNAL", "component_options", "render_sbatch", "srun_command"]
