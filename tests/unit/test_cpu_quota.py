"""The CPU threads of one local rank, in-process. One rank gets every core this process may
compute on (the local launcher needs none while the ranks train); a CFS quota on its cgroup
(a container's ``--cpus``) lowers that, which the affinity mask alone does not show. The quota
is a real cgroup v1 ``cpu`` group with a real thread of this process moved into it (skipped
where the v1 cpu hierarchy cannot be written)."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from hetseq_hpc.balance.placement import placement_for
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.env.cgroups import cpu_quota
from hetseq_hpc.env.hardware import usable_cores

V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.fixture
def thread_in_quota():
    """``(tid, parent group, child group)``: a parked thread of this process in a child cgroup
    without a quota of a parent limited to 1 CPU; moved back and removed afterwards."""
    parent = V1_CPU / f"hetseq-test-quota-{uuid.uuid4().hex[:8]}"
    try:
        parent.mkdir()
    except OSError as exc:
        pytest.skip(f"cgroup v1 cpu hierarchy not writable: {exc}")
    child = parent / "child"
    child.mkdir()
    (parent / "cpu.cfs_quota_us").write_text(str(int((V1_CPU / "cpu.cfs_period_us").read_text())))
    release, ready, box = threading.Event(), threading.Event(), {}

    def park() -> None:
        box["tid"] = threading.get_native_id()
        ready.set()
        release.wait()

    thread = threading.Thread(target=park, daemon=True)
    thread.start()
    ready.wait()
    (child / "tasks").write_text(str(box["tid"]))
    try:
        yield box["tid"], parent, child
    finally:
        (V1_CPU / "tasks").write_text(str(box["tid"]))
        release.set()
        thread.join()
        child.rmdir()
        parent.rmdir()


def test_one_rank_gets_every_core_this_process_may_use():
    run = compose_run_config(["cluster.ranks=1"])
    want = len(os.sched_getaffinity(0))
    if cpu_quota() is not None:
        want = max(1, min(want, int(cpu_quota())))
    assert usable_cores() == want
    assert placement_for(run, 0).threads == want
    assert placement_for(compose_run_config(["cluster.ranks=2"]), 1, cores=4).threads == 2


def test_a_cpu_quota_lowers_the_threads_of_one_rank(thread_in_quota):
    tid, parent, _ = thread_in_quota
    where = f"self/task/{tid}"
    assert cpu_quota(where) == pytest.approx(1.0)  # the parent's quota covers its child
    run = compose_run_config(["cluster.ranks=1"])
    assert placement_for(run, 0, cores=usable_cores(where)).threads == 1
    period = int((parent / "cpu.cfs_period_us").read_text())
    (parent / "cpu.cfs_quota_us").write_text(str(period * 5 // 2))  # 2.5 CPUs: 2 threads
    assert cpu_quota(where) == pytest.approx(2.5)
    assert usable_cores(where) == min(2, len(os.sched_getaffinity(0)))
    (parent / "cpu.cfs_quota_us").write_text("-1")
    assert cpu_quota(where) is None
