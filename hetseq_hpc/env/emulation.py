"""Emulate a slower device class on a CPU: run this rank under a CPU quota.

A rank with speed ``s`` in (0, 1) gets ``s x threads`` CPUs' worth of time through the kernel's
CFS bandwidth control (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``,
https://docs.kernel.org/scheduler/sched-bwc.html): a really slower processor, not a sleep.
Where the cgroup v1 cpu controller cannot be written, cgroup v2's ``cpu.max`` is tried, and
last a duty cycle (a helper process alternately stops and continues the rank with
SIGSTOP/SIGCONT, what ``cpulimit`` does) -- also real CPU throttling, but coarser. The method
that ran is logged and written to ``logs/rank<N>.emulation.json``, so a benchmark or a person
can see which one it was (and change the quota mid-run by writing the cgroup file).

The quota emulates a slower *device*, not a slower network: once the rendezvous has made its
communication threads (gloo's ``gloo_tcp_loop`` / ``pt_gloo_runloop``, the store's
``pt_tcpstore_uv``), :func:`exempt_communication_threads` moves them back out of the throttled
group (cgroup v1 places single threads through its ``tasks`` file). A slower GPU on a real
cluster sends its gradients over the same network as a fast one; without this, a throttled
rank's share of every all-reduce and statistics exchange also waited for its CFS quota, a
cost no real device class has.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from hetseq_hpc.files.atomic import atomic_write_text
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger(__name__)

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2_ROOT = Path("/sys/fs/cgroup")
#: CFS period in microseconds: 10 ms (the kernel default is 100 ms), so a throttled rank runs
#: in short slices and a step of ~0.1-0.3 s sees a steady speed, not a few long stalls
PERIOD_US = 10_000
#: cgroup directory prefix, so stale groups of dead ranks can be found and removed
PREFIX = "hetseq-"
#: name prefixes (``/proc/<pid>/task/<tid>/comm``) of the threads torch.distributed starts for
#: communication: gloo's event loop and work threads, the TCPStore client loop, NCCL's threads
COMM_THREAD_PREFIXES = ("gloo_tcp_loop", "pt_gloo_runloop", "pt_tcpstore", "pt_nccl", "NCCL")
#: duty-cycle period in seconds for the fallback
DUTY_PERIOD_S = 0.02


@dataclass(frozen=True)
class Emulation:
    """How this rank's speed is emulated.

    Attributes:
        speed: the requested speed factor in (0, 1] (1 = full speed, nothing done).
        method: ``none``, ``cgroup-v1``, ``cgroup-v2`` or ``duty-cycle``.
        cpus: CPUs' worth of time allowed per period (``speed x threads``).
        control: the file that sets the quota (cgroups), else None.
        note: why a fallback was used, if one was.
        exempt_threads: names of the communication threads that run outside the quota
            (:func:`exempt_communication_threads`).
    """

    speed: float
    method: str
    cpus: float
    control: Optional[str] = None
    note: str = ""
    exempt_threads: tuple = ()

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def emulated_cpus(speed: float, threads: int) -> float:
    """CPUs' worth of time a rank at ``speed`` (0, 1] with ``threads`` threads may use per
    period: ``speed x threads`` (at least one thread counted). The quota formula the runtime,
    the planner and the benchmark share."""
    return float(speed) * max(int(threads), 1)


def cfs_quota_us(cpus: float) -> int:
    """CFS quota in microseconds per :data:`PERIOD_US` for ``cpus`` CPUs' worth of time (the
    kernel refuses quotas below 1 ms, https://docs.kernel.org/scheduler/sched-bwc.html)."""
    return max(1000, int(cpus * PERIOD_US))


def _sweep_stale(root: Path) -> None:
    """Remove empty cgroups left by ranks that were killed (rmdir fails on non-empty ones)."""
    try:
        for entry in root.iterdir():
            if entry.is_dir() and entry.name.startswith(PREFIX):
                pid = entry.name[len(PREFIX) :]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    try:
                        entry.rmdir()
                    except OSError:
                        pass
    except OSError:
        pass


def _cgroup_v1(speed_cpus: float) -> Emulation:
    if not (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
        raise OSError("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    _sweep_stale(CGROUP_V1_CPU)
    group = CGROUP_V1_CPU / f"{PREFIX}{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(cfs_quota_us(speed_cpus)))
    parent_procs = CGROUP_V1_CPU / "cgroup.procs"
    (group / "cgroup.procs").write_text(str(os.getpid()))

    def leave() -> None:
        try:
            parent_procs.write_text(str(os.getpid()))
            group.rmdir()
        except OSError:
            pass

    atexit.register(leave)
    return Emulation(
        speed=0.0, method="cgroup-v1", cpus=speed_cpus, control=str(group / "cpu.cfs_quota_us")
    )


def _own_v2_group() -> Optional[Path]:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return CGROUP_V2_ROOT / line[3:].lstrip("/")
    except OSError:
        pass
    return None


def _cgroup_v2(speed_cpus: float) -> Emulation:
    own = _own_v2_group()
    if own is None or not (own / "cgroup.controllers").exists():
        raise OSError("no cgroup v2 hierarchy")
    parent = own.parent if own != CGROUP_V2_ROOT else own
    if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
        raise OSError("cgroup v2 cpu controller not enabled for child groups")
    _sweep_stale(parent)
    group = parent / f"{PREFIX}{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "cpu.max").write_text(f"{cfs_quota_us(speed_cpus)} {PERIOD_US}")
    (group / "cgroup.procs").write_text(str(os.getpid()))

    def leave() -> None:
        try:
            (own / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()
        except OSError:
            pass

    atexit.register(leave)
    return Emulation(speed=0.0, method="cgroup-v2", cpus=speed_cpus, control=str(group / "cpu.max"))


_DUTY_SCRIPT = """
import os, signal, sys, time
pid, run_s, stop_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
while True:
    try:
        os.kill(pid, signal.SIGCONT); time.sleep(run_s)
        os.kill(pid, signal.SIGSTOP); time.sleep(stop_s)
    except ProcessLookupError:
        break
"""


def _duty_cycle(speed: float, note: str) -> Emulation:
    run_s = DUTY_PERIOD_S * speed
    helper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _DUTY_SCRIPT,
            str(os.getpid()),
            str(run_s),
            str(DUTY_PERIOD_S - run_s),
        ],
        start_new_session=True,
    )

    def stop() -> None:
        helper.kill()
        os.kill(os.getpid(), signal.SIGCONT)

    atexit.register(stop)
    return Emulation(speed=speed, method="duty-cycle", cpus=speed, note=note)


def emulate_speed(speed: float, threads: int) -> Emulation:
    """Throttle this process to ``speed`` of its ``threads`` CPUs.

    Args:
        speed: factor in (0, 1]; 1 does nothing.
        threads: CPU threads this rank computes with.

    Returns:
        What was done (also logged); the throttle lasts until the process exits.
    """
    if speed >= 1.0:
        return Emulation(speed=1.0, method="none", cpus=float(threads))
    cpus = emulated_cpus(speed, threads)
    reasons = []
    for attempt in (_cgroup_v1, _cgroup_v2):
        try:
            emu = attempt(cpus)
            emu = Emulation(speed=speed, method=emu.method, cpus=cpus, control=emu.control)
            log.info(
                "emulating speed %.2f: %s quota of %.2f CPU(s) (%s)",
                speed,
                emu.method,
                cpus,
                emu.control,
            )
            return emu
        except OSError as exc:
            reasons.append(f"{attempt.__name__.lstrip('_')}: {exc}")
    note = "cgroups not writable (" + "; ".join(reasons) + ")"
    log.warning("emulating speed %.2f with a SIGSTOP/SIGCONT duty cycle: %s", speed, note)
    return _duty_cycle(speed, note)


def set_quota(control: str, cpus: float) -> None:
    """Change a running rank's quota (``control`` from :class:`Emulation`) to ``cpus`` CPUs."""
    path = Path(control)
    quota = cfs_quota_us(cpus)
    path.write_text(f"{quota} {PERIOD_US}" if path.name == "cpu.max" else str(quota))


def communication_threads(pid: Optional[int] = None) -> dict:
    """Thread ids of process ``pid`` (default: this one) whose name starts with one of
    :data:`COMM_THREAD_PREFIXES`, mapped to that name; ``{}`` where ``/proc`` cannot tell."""
    out = {}
    try:
        for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
            except OSError:  # the thread ended meanwhile
                continue
            if name.startswith(COMM_THREAD_PREFIXES):
                out[int(task.name)] = name
    except OSError:
        pass
    return out


def exempt_communication_threads(emu: Emulation) -> Emulation:
    """Move this process's communication threads (:func:`communication_threads`) out of the
    throttled cgroup, so that only computation runs at the emulated speed. Call it after the
    rendezvous (the threads exist from then on).

    Only cgroup v1 can place single threads (its ``tasks`` file); under cgroup v2 (a domain
    group holds whole processes) and the duty cycle (SIGSTOP stops every thread) the whole rank
    stays throttled and the returned note says so.

    Returns:
        ``emu`` with ``exempt_threads`` (the names moved) or a ``note`` on why none were.
    """
    if emu.method == "none":
        return emu
    if emu.method != "cgroup-v1" or emu.control is None:
        return replace(
            emu,
            note=(emu.note + "; " if emu.note else "") + "communication threads "
            f"throttled too ({emu.method} cannot place single threads)",
        )
    moved = []
    parent_tasks = CGROUP_V1_CPU / "tasks"  # where _cgroup_v1 took the rank from
    for tid, name in sorted(communication_threads().items()):
        try:
            parent_tasks.write_text(str(tid))
            moved.append(name)
        except OSError as exc:  # e.g. the thread ended; the rest still move
            log.debug("could not move thread %d (%s) out of the quota: %s", tid, name, exc)
    log.info(
        "emulation: %d communication thread(s) run unthrottled (%s)",
        len(moved),
        ", ".join(sorted(set(moved))) or "none found",
    )
    return replace(emu, exempt_threads=tuple(moved))


def record(emu: Emulation, run_dir: RunDir, rank: int) -> Path:
    """Write ``logs/rank<N>.emulation.json``."""
    return atomic_write_text(run_dir.emulation_file(rank), json.dumps(emu.to_dict(), indent=1))
