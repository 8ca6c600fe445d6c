"""A rank that finished its run exits 0 while its heartbeat and write-fence threads are talking
to the job's store: real processes, a real store server, real threads.

Found in CI: every rank of a finished 3-rank run ended by SIGABRT ("terminate called without an
active exception"), reported lost. A ``dist.PrefixStore`` call in a daemon thread releases the
GIL in C++ and takes it back in a destructor; at the interpreter's exit that ends the thread
inside the destructor and aborts the process. The daemon threads now talk to the store in
Python only (membership.PrefixedClient), and ``Heartbeat.close`` waits for a beat in flight.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.runs import REPO

#: beats as fast as they go (HEARTBEAT_S 0), each followed by the fence's question (a lease of
#: 0 s), from the real classes; the main thread exits while they run. torch and the classes are
#: imported once (~3.5 CPU-s); each exit is a child forked before any thread starts, whose
#: ``sys.exit`` runs the interpreter's whole finalization as a fresh process's does
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from hetseq_hpc.distributed import membership
    from hetseq_hpc.distributed.fence import GenerationFence

    def exit_while_the_threads_run(how):
        membership.HEARTBEAT_S = 0.0
        token = "0123456789abcdef0123456789abcdef"
        server, port = membership.serve_job_store("127.0.0.1", token=token)
        env = {"HETSEQ_STORE": f"127.0.0.1:{port}", "HETSEQ_JOB_TOKEN": token}
        beats = [membership.Heartbeat(membership.job_store(30, env), m) for m in range(2)]
        for m, beat in enumerate(beats):
            fence = GenerationFence(membership.fence_store(beat.store, 5.0), m, lease_s=0.0)
            beat.on_beat = fence.renew
        time.sleep(0.5)
        if how == "close":
            for beat in beats:
                beat.close()
        sys.exit(0)

    codes = []
    for _ in range(int(sys.argv[2])):
        pid = os.fork()
        if pid == 0:
            exit_while_the_threads_run(sys.argv[1])
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(codes)
    """
)


@pytest.mark.parametrize("how", ["exit", "close"])
def test_a_process_exits_0_while_its_store_threads_run(how):
    """Six exits in a row, each while two heartbeats and their fence checks are in flight (it
    aborted 11 times in 12 over dist.PrefixStore): ``exit`` leaves the threads running,
    ``close`` stops them first, as a rank does. An exit status of -6 is such an abort."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, how, "6"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stderr[-2000:])
    assert lines[-1] == str([0] * 6), (lines[-1], proc.stderr[-2000:])
