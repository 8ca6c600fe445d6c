"""What this process's memory cgroup says: how much memory is left under its limit
(:func:`cgroup_memory_room`), and whether a process was killed by the kernel's OOM killer or by
someone's ``kill -9`` (:func:`oom_evidence`).

A SIGKILL does not say who sent it. The kernel does, in two places this module reads:

* the memory cgroup's OOM-kill counter: ``memory.events`` (``oom_kill N``, cgroup v2) or
  ``memory.oom_control`` (``oom_kill N``, cgroup v1), of this process's cgroup and its
  ancestors. :func:`oom_kill_counts` is taken when the ranks start (they inherit the
  launcher's cgroup) and again when one died: a count that rose means the OOM killer acted;
* the kernel log (``/dev/kmsg``, where readable): ``Killed process <pid>`` /
  ``oom-kill:...,pid=<pid>`` names the victim.

:func:`oom_evidence` says OOM only on such evidence; without it a SIGKILL is "killed by SIGKILL
(by a user, the scheduler, or the OOM killer)" (:func:`hetseq_hpc.launch.failures.signal_reason`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Union

from hetseq_hpc.env.cgroups import CGROUP_ROOT, cgroup_dirs

#: the kernel log, one record per read
KMSG = Path("/dev/kmsg")
#: at most this many kernel-log records are read (the ring buffer is bounded anyway)
_MAX_RECORDS = 200_000


def _memory_cgroup_dirs(pid: Union[int, str], root: Path) -> List[Path]:
    """The memory cgroup directories of ``pid`` and their ancestors (deepest first)."""
    return cgroup_dirs(pid, "memory", root)


def _oom_kill_line(path: Path) -> Optional[int]:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def oom_kill_counts(pid: Union[int, str] = "self", root: Path = CGROUP_ROOT) -> Dict[str, int]:
    """``{counter file: OOM kills so far}`` for the memory cgroups of ``pid`` (and ancestors);
    empty where none is readable."""
    counts: Dict[str, int] = {}
    for folder in _memory_cgroup_dirs(pid, root):
        for name in ("memory.events", "memory.oom_control"):
            value = _oom_kill_line(folder / name)
            if value is not None:
                counts[str(folder / name)] = value
    return counts


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory_room(pid: Union[int, str] = "self", root: Path = CGROUP_ROOT) -> Optional[int]:
    """Bytes the memory cgroups of ``pid`` (and their ancestors) still allow: the smallest
    ``limit - usage`` (v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``, v2
    ``memory.max`` / ``memory.current``); None where no limit is set or readable."""
    room: Optional[int] = None
    for folder in _memory_cgroup_dirs(pid, root):
        for limit_name, usage_name in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
            if limit is None or usage is None or limit >= 2**60:  # "max" or v1's "unlimited"
                continue
            left = max(limit - usage, 0)
            room = left if room is None else min(room, left)
    return room


def kernel_log(path: Path = KMSG) -> Optional[List[str]]:
    """The kernel log's messages (``/dev/kmsg``), or None where it cannot be read (no
    permission, not Linux)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    messages: List[str] = []
    try:
        for _ in range(_MAX_RECORDS):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten while reading: go on
                continue
            except OSError:
                return messages or None
            if not record:
                break
            messages.append(record.decode("utf-8", "replace").split(";", 1)[-1].strip())
    finally:
        os.close(fd)
    return messages


def _names_pid(messages: List[str], pid: int) -> bool:
    pattern = re.compile(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)")
    return any(pattern.search(m) for m in messages)


def oom_evidence(
    before: Dict[str, int],
    pid: Optional[int] = None,
    after: Optional[Dict[str, int]] = None,
    log: Optional[List[str]] = None,
    read_log: bool = True,
) -> Optional[str]:
    """Why we believe the OOM killer ended process ``pid``, or None when nothing says so.

    Args:
        before: :func:`oom_kill_counts` when the process started.
        pid: the process (as the kernel log names it).
        after: the counts now (default: read them).
        log: the kernel log's messages (default: :func:`kernel_log` when ``read_log``).
    """
    after = oom_kill_counts() if after is None else after
    for path, count in after.items():
        if path in before and count > before[path]:
            return f"{path} counts oom_kill {before[path]} -> {count}"
    if log is None and read_log and pid is not None:
        log = kernel_log()
    if log and pid is not None and _names_pid(log, pid):
        return f"the kernel log names pid {pid}"
    return None


__all__ = [
    "CGROUP_ROOT",
    "KMSG",
    "cgroup_memory_room",
    "kernel_log",
    "oom_evidence",
    "oom_kill_counts",
]
