"""Emulated device classes, in-process: full speed does nothing, and under a duty cycle or a
cgroup v2 quota no thread can leave the throttle (said, not pretended). (A throttled child's
measured CPU share: tests/integration/test_emulation_share.py.)
"""

from __future__ import annotations

from hetseq_hpc.env.emulation import emulate_speed


def test_full_speed_does_nothing():
    emu = emulate_speed(1.0, 4)
    assert emu.method == "none" and emu.control is None and emu.cpus == 4.0


def test_exempt_needs_per_thread_cgroups():
    """Under the duty cycle or cgroup v2 no single thread can leave: said, not pretended."""
    from hetseq_hpc.env.emulation import Emulation, exempt_communication_threads

    emu = exempt_communication_threads(
        Emulation(speed=0.5, method="cgroup-v2", cpus=0.5, control="/nonexistent/cpu.max")
    )
    assert emu.exempt_threads == () and "throttled too" in emu.note
    assert exempt_communication_threads(emulate_speed(1.0, 1)).method == "none"
