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
#: 0 s), from the real classes; the main thread exits while they run
SCRIPT = textwrap.dedent(
    """
    import sys, time
    from hetseq_hpc.distributed import membership
    from hetseq_hpc.distributed.fence import GenerationFence
    membership.HEARTBEAT_S = 0.0
    token = "0123456789abcdef0123456789abcdef"
    server, port = membership.serve_job_store("127.0.0.1", token=token)
    env = {"HETSEQ_STORE": f"127.0.0.1:{port}", "HETSEQ_JOB_TOKEN": token}
    beats = [membership.Heartbeat(membership.job_store(30, env), m) for m in range(2)]
    for m, beat in enumerate(beats):
        fence = GenerationFence(membership.fence_store(beat.store, 5.0), m, lease_s=0.0)
        beat.on_beat = fence.renew
    time.sleep(0.5)
    if sys.argv[1] == "close":
        for beat in beats:
            beat.close()
    sys.exit(0)
    """
)


@pytest.mark.parametrize("how", ["exit", "close"])
def test_a_process_exits_0_while_its_store_threads_run(how):
    """Six exits in a row, each while two heartbeats and their fence checks are in flight (it
    aborted 11 times in 12 over dist.PrefixStore): ``exit`` leaves the threads running,
    ``close`` stops them first, as a rank does."""
    codes = []
    for _ in range(6):
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, how],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        codes.append((proc.returncode, proc.stderr.strip()[-300:]))
    assert all(code == 0 for code, _ in codes), codes
