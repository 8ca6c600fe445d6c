"""Which rank failed, from what the ranks left (error files, exit codes, tracebacks), and the
local rendezvous store on loopback only: in-process. (The launcher with real processes and
signals: tests/integration/test_launch_local.py.)"""

from __future__ import annotations

import datetime
import json
import signal
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from hetseq_hpc.distributed.loopback_store import is_loopback, loopback_store
from hetseq_hpc.env.world import WorldInfo, free_port
from hetseq_hpc.launch.failures import (
    error_line,
    first_failure,
    memory_estimate_gb,
    pick_failure,
    signal_reason,
)
from hetseq_hpc.rundir.paths import RunDir


def _error_file(path: Path, rank: int, type_: str, message: str, when: float, peer=None) -> dict:
    data = {"rank": rank, "type": type_, "message": message, "time": when}
    if peer is not None:
        data["peer"] = peer
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{rank}.error.json").write_text(json.dumps(data))
    return data


def test_genuine_error_wins_over_an_earlier_peer_disconnect(tmp_path):
    """Rank 0 saw rank 1 disconnect and wrote its error FIRST; rank 1's own error is later.
    The old launcher named rank 0 (first to exit); the cause is rank 1."""
    logs = tmp_path / "logs"
    errors = {
        0: _error_file(
            logs,
            0,
            "DistBackendError",
            "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4",
            1.0,
        ),
        1: _error_file(
            logs, 1, "DataError", "train file data.txt is empty: give a file with text", 2.0
        ),
    }
    assert first_failure({0: 1}, errors) == 1
    assert first_failure({0: 1, 1: 1}, errors) == 1


def test_foreign_signal_wins_over_peer_disconnect_and_time_orders_genuine_errors():
    peer = {"type": "RuntimeError", "message": "Connection reset by peer", "time": 1.0}
    assert first_failure({0: 1, 1: -9}, {0: peer, 1: None}) == 1
    early = {"type": "ValueError", "message": "bad value", "time": 5.0}
    late = {"type": "OSError", "message": "cache dir unwritable", "time": 9.0}
    assert first_failure({0: 1, 1: 1}, {0: late, 1: early}) == 1
    assert first_failure({0: 1}, {0: None, 1: None}) == 0
    timed_out = {
        "type": "DistBackendError",
        "time": 3.0,
        "message": "Timed out waiting 10000ms for recv operation to complete",
    }
    assert first_failure({0: 1}, {0: timed_out, 1: None}, stopped=[1]) == 1
    with pytest.raises(ValueError):
        first_failure({0: 0}, {0: None})


def test_oom_reason_gives_the_planned_memory_only_on_evidence(tmp_path):
    alloc = {
        "ranks": [
            {
                "calibration": {"static_bytes": 2**30, "activation_bytes_per_sample": 2**28},
                "share": {"micro_batch": 4},
            },
        ]
    }
    (tmp_path / "allocation.json").write_text(json.dumps(alloc))
    assert memory_estimate_gb(RunDir(tmp_path), 0) == pytest.approx(2.0)
    # issue 27: out of memory only on evidence (the cgroup's oom_kill count, the kernel log)
    reason = signal_reason(
        -signal.SIGKILL, RunDir(tmp_path), 0, oom="memory.events oom_kill 0 -> 1"
    )
    assert "out of memory" in reason and "2.00 GiB" in reason and "\n" not in reason
    unknown = signal_reason(-signal.SIGKILL, RunDir(tmp_path), 0)
    assert (
        "out of memory" not in unknown and "by a user, the scheduler, or the OOM killer" in unknown
    )
    assert signal_reason(-signal.SIGSEGV, RunDir(tmp_path), 0) == "killed by signal SIGSEGV"


DDP_TRACE = """Traceback (most recent call last):
  File "/x/submitit/core/submission.py", line 55, in process_job
    result = delayed.result()
torch.distributed.DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41000
Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:672 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in libc10.so)
frame #56: /x/torch/distributed/algorithms/ddp_comm_hooks/ddp_hooks.py(53): <lambda>
"""
OWN_TRACE = """Traceback (most recent call last):
  File "/x/tests/helpers/fault_tasks.py", line 62, in load
    raise RuntimeError(f"injected failure on rank {this_rank()}")
RuntimeError: injected failure on rank 2
"""


def test_slurm_attribution_skips_ddp_frame_lines():
    """On Slurm rank 0 was named with ``…ddp_hooks.py(53): <lambda>``: the error line of a
    torch C++ error is its exception line, and it is a peer disconnection."""
    assert error_line(DDP_TRACE).startswith("torch.distributed.DistBackendError: ")
    assert pick_failure({0: DDP_TRACE, 1: DDP_TRACE, 2: OWN_TRACE}) == 2
    assert pick_failure({0: DDP_TRACE, 1: DDP_TRACE}) == 0
    assert error_line(OWN_TRACE).startswith("RuntimeError: injected failure on rank 2")
    assert error_line("") == "unknown error"


# ------------------------------------------------------------------ rendezvous store on loopback
def _listen_addresses(port: int) -> set:
    """Local addresses of LISTEN sockets on ``port`` (/proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(addr)
    return found


def test_local_rendezvous_store_listens_on_loopback_only():
    port = free_port()
    world = WorldInfo(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    store = loopback_store(world, 30)
    try:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert _listen_addresses(port) == {"0100007F"}, "store not bound to 127.0.0.1 only"
    finally:
        del store


def test_negative_control_plain_tcpstore_listens_on_every_interface():
    """Why the store is built by hand: torch's own binds all interfaces whatever host_name."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
    try:
        addresses = _listen_addresses(port)
        assert addresses and not addresses <= {"0100007F"}, addresses
    finally:
        del store


def test_store_for_a_remote_master_is_left_to_torch():
    world = WorldInfo(rank=0, local_rank=0, world_size=2, master_addr="n1", master_port=29500)
    assert loopback_store(world, 1) is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback(socket.gethostname() + ".invalid") and not is_loopback("10.0.0.1")
