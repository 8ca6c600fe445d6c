"""This process's control groups: the directories of a controller's cgroups
(:func:`cgroup_dirs`, shared with :mod:`hetseq_hpc.env.memcg`) and the CPUs a CFS quota allows
(:func:`cpu_quota`: a container's ``--cpus``, a Kubernetes CPU limit), which the affinity mask
does not show: ranks that take a thread per core of the mask would oversubscribe the quota.

Read: ``/proc/<pid>/cgroup``; cgroup v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max ..."``),
v1 ``cpu.cfs_quota_us`` (-1: none) / ``cpu.cfs_period_us``, of the cgroup and each ancestor.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Union

#: where the cgroup hierarchies are mounted
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_dirs(pid: Union[int, str], controller: str, root: Path = CGROUP_ROOT) -> List[Path]:
    """The ``controller`` (``memory``, ``cpu``) cgroup directories of ``pid`` and their
    ancestors (deepest first): v1's hierarchy of that controller and the v2 unified one, where
    mounted. ``pid`` may be ``"self"`` or ``"self/task/<tid>"`` (a thread's, v1)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    dirs: List[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # the v2 unified hierarchy
            bases = [root, root / "unified"]
        elif controller in controllers.split(","):
            named = root / controller
            bases = [named if named.is_dir() else root / controllers]
        else:
            continue
        for base in bases:
            here = base / rel.lstrip("/")
            while True:
                if here.is_dir():
                    dirs.append(here)
                if here == base or base not in here.parents:
                    break
                here = here.parent
    return dirs


def _group_cpus(folder: Path) -> Optional[float]:
    """CPUs the quota of one cgroup directory allows, or None without one."""
    try:
        text = (folder / "cpu.max").read_text().split()
        if len(text) == 2 and text[0] != "max":
            return int(text[0]) / int(text[1])
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cpu_quota(pid: Union[int, str] = "self", root: Path = CGROUP_ROOT) -> Optional[float]:
    """CPUs the CFS quotas of ``pid``'s cgroups allow (the smallest over its cgroup and its
    ancestors, v1 and v2), e.g. 1.5; None where no quota is set or readable."""
    limits = [c for c in map(_group_cpus, cgroup_dirs(pid, "cpu", root)) if c is not None]
    return min(limits) if limits else None


__all__ = ["CGROUP_ROOT", "cgroup_dirs", "cpu_quota"]
