"""Checks before a SLURM submission: nothing is submitted unless the cluster can run the job.

``sinfo`` (https://slurm.schedmd.com/sinfo.html) lists every node of every partition with its
CPUs (``%c``), generic resources (``%G``) and the partition's time limit (``%l``, MaxTime,
``[days-]hours:minutes:seconds`` or ``infinite``). A job asking for more than that is not
rejected by ``sbatch`` on every cluster: it may stay PENDING forever (reason
``PartitionTimeLimit``) or fail only inside the job. Checked here: the partition exists, has
enough nodes that carry the GRES type and enough CPUs for ``ranks per node x cpus_per_rank``,
and its MaxTime covers ``cluster.timeout_min``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional

from hetseq_hpc.config import SlurmClusterConfig
from hetseq_hpc.errors import ConfigError, LaunchError
from hetseq_hpc.launch.slurm_commands import run_slurm

#: sinfo columns: partition, node name, GRES, CPUs of the node, partition time limit
SINFO_FORMAT = "%R|%N|%G|%c|%l"
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\Z")


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


def slurm_minutes(text: str) -> Optional[float]:
    """Minutes of a Slurm time string (``30``, ``1:30:00``, ``2-00:00:00``, ``2-12``); None for
    ``infinite``/``UNLIMITED``/unparsable (no limit known).

    Forms from sbatch's ``--time``: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes, days-hours:minutes:seconds.
    """
    match = _TIME.match(text.strip())
    if match is None:
        return None
    days, a, b, c = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # days-hours[:minutes[:seconds]]
        return days * 1440 + a * 60 + (b or 0) + (c or 0) / 60
    if c is not None:  # hours:minutes:seconds
        return a * 60 + b + c / 60
    if b is not None:  # minutes:seconds
        return a + b / 60
    return float(a)


def partition_inventory() -> Dict[str, Dict[str, Any]]:
    """``{partition: {"nodes": int, "gres": [str per node], "cpus": [int per node],
    "max_time_min": float | None}}`` from ``sinfo -N`` (one row per node and partition).

    Raises:
        LaunchError: sinfo fails (controller down, no config).
    """
    try:
        out = run_slurm(["sinfo", "-h", "-N", "-o", SINFO_FORMAT])
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(f"sinfo could not run ({exc}): check the Slurm client setup") from None
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or ["no output"]
        # the last error says why (the first of a failed config fetch is a DNS SRV lookup)
        why = next(
            (line for line in reversed(lines) if "error:" in line or "fatal:" in line), lines[0]
        )
        raise LaunchError(f"sinfo failed ({why.strip()}): is slurmctld reachable (scontrol ping)?")
    return parse_inventory(out.stdout)


def parse_inventory(text: str) -> Dict[str, Dict[str, Any]]:
    """Parse ``sinfo -h -N -o '%R|%N|%G|%c|%l'`` output (see :func:`partition_inventory`)."""
    inventory: Dict[str, Dict[str, Any]] = {}
    seen = set()
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5 or (fields[0], fields[1]) in seen:
            continue
        seen.add((fields[0], fields[1]))
        name, _node, gres, cpus, limit = fields
        entry = inventory.setdefault(
            name, {"nodes": 0, "gres": [], "cpus": [], "max_time_min": slurm_minutes(limit)}
        )
        entry["nodes"] += 1
        entry["gres"].append(gres)
        digits = re.match(r"[0-9]+", cpus)
        entry["cpus"].append(int(digits.group()) if digits else 0)
    return inventory


def _gres_ok(gres: str, gpu_type: Optional[str]) -> bool:
    return not gpu_type or f"gpu:{gpu_type}" in gres


def check_partitions(
    cluster: SlurmClusterConfig, inventory: Dict[str, Dict[str, Any]], spare_nodes: int = 0
) -> None:
    """Every partition exists, has enough nodes (``spare_nodes`` more than ``nodes`` each:
    ``trainer.elastic.spare_nodes``) with the GRES type and the CPUs for its ranks, and allows
    ``cluster.timeout_min``.

    Raises:
        ConfigError: one line naming the setting, what is missing and what exists (the first
            partition's problem of :func:`partition_problems`).
    """
    problems = partition_problems(cluster, inventory, spare_nodes)
    if problems:
        raise ConfigError(next(iter(problems.values())))


def partition_problems(
    cluster: SlurmClusterConfig, inventory: Dict[str, Dict[str, Any]], spare_nodes: int = 0
) -> Dict[str, str]:
    """What stops each configured partition from running, in configuration order.

    Args:
        cluster: the SLURM cluster config (``cluster.partitions``, ``cluster.timeout_min``).
        inventory: :func:`partition_inventory` (or :func:`parse_inventory` of ``sinfo`` text).
        spare_nodes: nodes each partition reserves beyond its ``nodes``
            (``trainer.elastic.spare_nodes``).

    Returns:
        ``{partition key: one-line problem naming the setting and the fix}`` for each partition
        that does not exist, has too few nodes, lacks the GRES type or the CPUs for its ranks, or
        does not allow ``cluster.timeout_min``; empty when all can run.
    """
    problems: Dict[str, str] = {}
    for key, part in cluster.partitions.items():
        problem = _partition_problem(
            f"cluster.partitions.{key}",
            part,
            cluster.timeout_min,
            inventory.get(part.partition),
            sorted(inventory),
            spare_nodes,
        )
        if problem:
            problems[key] = problem
    return problems


def _partition_problem(
    where: str,
    part,
    timeout_min: int,
    info: Optional[Dict[str, Any]],
    names: List[str],
    spare_nodes: int = 0,
) -> Optional[str]:
    if info is None:
        return (
            f"{where}.partition={part.partition!r} does not exist on this cluster (sinfo "
            f"lists {names}): use one of those"
        )
    if info["nodes"] < part.nodes + spare_nodes:
        spare = f" + trainer.elastic.spare_nodes={spare_nodes}" if spare_nodes else ""
        fix = f"lower {where}.nodes" + (" or trainer.elastic.spare_nodes" if spare_nodes else "")
        return (
            f"{where}.nodes={part.nodes}{spare} but partition {part.partition!r} has "
            f"{info['nodes']} node(s): {fix}"
        )
    gres: List[str] = info.get("gres", [])
    if part.gpu_type and not any(_gres_ok(g, part.gpu_type) for g in gres):
        return (
            f"{where}.gpu_type={part.gpu_type!r}: partition {part.partition!r} has no "
            f"gpu:{part.gpu_type} GRES (its nodes offer {sorted(set(gres))}): use the GPU "
            "type sinfo -o '%P %G' shows"
        )
    problem = _cpus_problem(where, part, info, spare_nodes)
    if problem:
        return problem
    limit = info.get("max_time_min")
    if limit is not None and timeout_min > limit:
        return (
            f"cluster.timeout_min={timeout_min} exceeds partition {part.partition!r}'s "
            f"time limit of {limit:g} minutes (sinfo %l): use cluster.timeout_min<={int(limit)}"
        )
    return None


def _cpus_problem(where: str, part, info: Dict[str, Any], spare_nodes: int = 0) -> Optional[str]:
    cpus: List[int] = info.get("cpus") or []
    if not cpus:
        return None
    need = part.cpus_per_rank * part.ranks_per_node_effective
    gres = info.get("gres") or [""] * len(cpus)
    fitting = sum(1 for c, g in zip(cpus, gres) if c >= need and _gres_ok(g, part.gpu_type))
    if fitting >= part.nodes + spare_nodes:
        return None
    per_rank = max(cpus) // max(1, part.ranks_per_node_effective)
    return (
        f"{where}.cpus_per_rank={part.cpus_per_rank} needs {need} CPUs per node "
        f"({part.ranks_per_node_effective} rank(s) per node) but only {fitting} node(s) of "
        f"partition {part.partition!r} have that many (its nodes have {sorted(set(cpus))} "
        f"CPUs): use {where}.cpus_per_rank<={max(1, per_rank)}"
    )


__all__ = [
    "SINFO_FORMAT",
    "check_partitions",
    "parse_inventory",
    "partition_inventory",
    "partition_problems",
    "require_slurm",
    "slurm_minutes",
]
