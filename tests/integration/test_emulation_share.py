"""Emulated device classes really slow a rank: measured as CPU share, not elapsed time.

A child process throttles itself with :func:`emulate_speed` and spins; its CPU time divided by
its wall time is its CPU share. The CFS quota caps that share however busy the machine is, so
the upper bound is a property of the kernel, not of this machine's speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetseq_hpc.env.emulation import CGROUP_V1_CPU

CHILD = """
import json, signal, sys, time
from pathlib import Path
from hetseq_hpc.env import emulation
speed, mode = float(sys.argv[1]), sys.argv[2]
if mode == "duty":
    emu = emulation._duty_cycle(speed, "forced by the test")
else:
    emu = emulation.emulate_speed(speed, 1)
if emu.method == "duty-cycle":  # measure once the helper process stops and continues this one
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCONT})
    assert signal.sigtimedwait({signal.SIGCONT}, 30), "the duty cycle never continued this process"
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCONT})
c0, w0 = time.process_time(), time.perf_counter()
x = 0
while time.perf_counter() - w0 < 1.5:
    x += 1
share = (time.process_time() - c0) / (time.perf_counter() - w0)
throttled = None
if emu.control and emu.control.endswith("cfs_quota_us"):
    stat = Path(emu.control).with_name("cpu.stat").read_text().split()
    throttled = int(stat[stat.index("nr_throttled") + 1])
print(json.dumps({"share": share, "method": emu.method, "throttled": throttled}))
"""


def _share(speed: float, mode: str = "auto") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(speed), mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cgroup_writable() -> str:
    try:
        probe = CGROUP_V1_CPU / "hetseq-writable-probe"
        probe.mkdir(exist_ok=True)
        probe.rmdir()
        return ""
    except OSError as exc:
        return f"cgroup v1 cpu controller not writable here ({exc}); the duty-cycle test covers it"


@pytest.mark.skipif(bool(_cgroup_writable()), reason=_cgroup_writable() or "writable")
def test_cgroup_quota_caps_the_cpu_share():
    slow = _share(0.3)
    assert slow["method"] == "cgroup-v1"
    assert slow["share"] <= 0.4, slow  # quota 0.3 CPU: the kernel enforces the ceiling
    assert slow["throttled"] and slow["throttled"] > 0, "the CFS throttled the rank"
    full = _share(1.0)
    assert full["method"] == "none"
    # nothing throttles the full-speed rank (its share is the machine's load: not asserted)
    assert full["throttled"] is None, full


def test_duty_cycle_fallback_slows_too():
    slow = _share(0.3, "duty")
    assert slow["method"] == "duty-cycle"
    assert slow["share"] <= 0.5, slow


def test_no_stale_cgroups_are_left_behind():
    _share(0.5)
    if CGROUP_V1_CPU.is_dir():
        left = [
            p.name
            for p in CGROUP_V1_CPU.iterdir()
            if p.name.startswith("hetseq-")
            and p.name[7:].isdigit()
            and not Path(f"/proc/{p.name[7:]}").exists()
        ]
        assert not left, left


COMM_CHILD = """
import json
from pathlib import Path
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.env import emulation
emu = emulation.emulate_speed(0.3, 1)
with single_process_rendezvous():
    comm = emulation.communication_threads()
    emu = emulation.exempt_communication_threads(emu)
    group = {int(t) for t in Path(emu.control).with_name("tasks").read_text().split()}
    main = emulation.os.getpid()
    print(json.dumps({"comm": sorted(comm.values()), "in_group": sorted(comm.keys() & group),
                      "main_in_group": main in group, "exempt": list(emu.exempt_threads),
                      "record": emu.to_dict()}))
"""


@pytest.mark.skipif(bool(_cgroup_writable()), reason=_cgroup_writable() or "writable")
def test_communication_threads_run_outside_the_quota():
    """A slower device, not a slower network: after a real gloo rendezvous, gloo's and the
    store's threads leave the throttled cgroup; the main (compute) thread stays in it."""
    out = subprocess.run(
        [sys.executable, "-c", COMM_CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert any(name.startswith("gloo") or name.startswith("pt_gloo") for name in got["comm"]), got
    assert got["main_in_group"], got
    assert got["in_group"] == [], got
    # the names: gloo may start or end one more of its loop threads between the two listings
    # (CI run 25: a sixth pt_gloo_runloop); every kind listed was moved out
    assert set(got["exempt"]) == set(got["comm"]), got
    assert json.loads(json.dumps(got["record"]))["exempt_threads"] == got["exempt"]
