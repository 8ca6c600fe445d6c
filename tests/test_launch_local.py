"""cluster=local launcher: the ranks die with their launcher, the right rank is blamed, the
rendezvous store stays on loopback. Real processes, real signals, real gloo; nothing mocked."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import REPO, SMALL_MODEL, cli_env, wait_rows
from hetseq_hpc.distributed.loopback_store import is_loopback, loopback_store
from hetseq_hpc.env.world import WorldInfo, free_port
from hetseq_hpc.launch.failures import (
    error_line,
    first_failure,
    memory_estimate_gb,
    pick_failure,
    signal_reason,
)

LONG_RUN = ["cluster.ranks=2", "trainer.max_steps=100000", "optim.schedule_steps=100000",
            "trainer.val_every=0", "trainer.checkpoint_every=0"]


# ------------------------------------------------------------------ helpers
def _processes():
    """``(pid, argv, environment, state)`` of every readable process (from /proc)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                environ = dict(item.partition(b"=")[::2]
                               for item in (entry / "environ").read_bytes().split(b"\0"))
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            yield int(entry.name), argv, environ, state


def _ranks_of(run_dir: Path) -> dict:
    """rank -> pid of the live worker processes of ``run_dir`` (zombies count as gone)."""
    return {int(env[b"RANK"]): pid for pid, argv, env, state in _processes()
            if state != "Z" and b"hetseq_hpc.worker" in argv and b"RANK" in env
            and str(run_dir).encode() in b" ".join(argv)}


def _wait_gone(run_dir: Path, timeout_s: float) -> float:
    """Poll until no worker of ``run_dir`` is alive; returns the seconds it took."""
    start = time.monotonic()
    while _ranks_of(run_dir):
        if time.monotonic() - start > timeout_s:
            pids = _ranks_of(run_dir)
            for pid in pids.values():  # do not leave them running after a failed test
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"workers {pids} still alive {timeout_s:.0f} s later")
        time.sleep(0.2)
    return time.monotonic() - start


@contextlib.contextmanager
def _launcher(run_dir: Path, token_cache: Path, *overrides: str, env_extra=None):
    """The CLI running in the background (its own session); killed with its group on exit."""
    env = cli_env(token_cache)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "hetseq_hpc", *SMALL_MODEL, *overrides,
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _checkpoints(run_dir: Path) -> list:
    return sorted((run_dir / "checkpoints").glob("step_*.pt"))


# ------------------------------------------------------------------ the ranks die with the launcher
@pytest.mark.slow
def test_sigterm_to_launcher_checkpoints_and_stops_the_ranks(tmp_path, token_cache):
    """``kill <launcher>`` (what timeout, a CI cancel or a closed terminal send): the ranks
    checkpoint after their current step and exit; nobody keeps training."""
    with _launcher(tmp_path, token_cache, *LONG_RUN) as proc:
        wait_rows(tmp_path, 3, proc)
        assert set(_ranks_of(tmp_path)) == {0, 1}
        os.kill(proc.pid, signal.SIGTERM)
        _wait_gone(tmp_path, 15)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "trainer.resume=auto" in stderr.strip().splitlines()[-1]
    assert _checkpoints(tmp_path), "no checkpoint written on SIGTERM"


@pytest.mark.slow
def test_sigkill_to_launcher_stops_the_ranks_within_seconds(tmp_path, token_cache):
    """SIGKILL cannot be caught: the ranks' parent-death signal (prctl) makes them checkpoint
    and exit on their own."""
    with _launcher(tmp_path, token_cache, *LONG_RUN) as proc:
        wait_rows(tmp_path, 3, proc)
        assert set(_ranks_of(tmp_path)) == {0, 1}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_gone(tmp_path, 20)
    assert _checkpoints(tmp_path), "the orphaned ranks wrote no checkpoint"


# ------------------------------------------------------------------ the right rank is blamed
@pytest.mark.slow
def test_failing_rank_is_named_and_peers_tracebacks_stay_in_their_logs(tmp_path, token_cache):
    """Rank 1 fails on its own; rank 0 only sees it disconnect. Rank 1 is named with its
    reason, and rank 0's traceback is in its log, not on the console."""
    with _launcher(tmp_path, token_cache, "cluster.ranks=2", "trainer.max_steps=5",
                  env_extra={"HETSEQ_INJECT_FAILURE": "1"}) as proc:
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "injected failure on rank 1" in last, last
    assert "[rank 0] ERROR" not in stderr, stderr[-3000:]
    assert stderr.count("Traceback") <= 1, stderr[-3000:]
    _wait_gone(tmp_path, 5)


@pytest.mark.slow
def test_sigkilled_rank_is_reported_as_probably_out_of_memory(tmp_path, token_cache):
    """A SIGKILL nobody in hetseq_hpc sent is what the kernel's OOM killer does: say so, with
    the rank's planned memory from allocation.json."""
    with _launcher(tmp_path, token_cache, *LONG_RUN) as proc:
        wait_rows(tmp_path, 2, proc)
        os.kill(_ranks_of(tmp_path)[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    last = stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "SIGKILL" in last and "out of memory" in last, last
    assert "GiB" in last, last
    _wait_gone(tmp_path, 5)


@pytest.mark.slow
def test_stopped_rank_is_named_not_the_peer_that_timed_out(tmp_path, token_cache):
    """SIGSTOP on rank 1: rank 0 times out in a collective and exits first. The old launcher
    blamed rank 0 (the first to exit); the cause is the stopped rank 1."""
    with _launcher(tmp_path, token_cache, *LONG_RUN, "cluster.collective_timeout_s=10") as proc:
        wait_rows(tmp_path, 2, proc)
        os.kill(_ranks_of(tmp_path)[1], signal.SIGSTOP)
        _, stderr = proc.communicate(timeout=180)
    last = stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "stopped (SIGSTOP" in last, last
    _wait_gone(tmp_path, 15)


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
        0: _error_file(logs, 0, "DistBackendError",
                       "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4", 1.0),
        1: _error_file(logs, 1, "DataError", "train file data.txt is empty: give a file with text",
                       2.0),
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
    timed_out = {"type": "DistBackendError", "time": 3.0,
                 "message": "Timed out waiting 10000ms for recv operation to complete"}
    assert first_failure({0: 1}, {0: timed_out, 1: None}, stopped=[1]) == 1
    with pytest.raises(ValueError):
        first_failure({0: 0}, {0: None})


def test_oom_reason_gives_the_planned_memory(tmp_path):
    alloc = {"ranks": [
        {"calibration": {"static_bytes": 2**30, "activation_bytes_per_sample": 2**28},
         "share": {"micro_batch": 4}},
    ]}
    (tmp_path / "allocation.json").write_text(json.dumps(alloc))
    assert memory_estimate_gb(tmp_path, 0) == pytest.approx(2.0)
    reason = signal_reason(-signal.SIGKILL, tmp_path, 0)
    assert "out of memory" in reason and "2.00 GiB" in reason and "\n" not in reason
    assert signal_reason(-signal.SIGKILL, tmp_path / "none", 0).endswith("dmesg names it)")
    assert signal_reason(-signal.SIGSEGV, tmp_path, 0) == "killed by signal SIGSEGV"


DDP_TRACE = """Traceback (most recent call last):
  File "/x/submitit/core/submission.py", line 55, in process_job
    result = delayed.result()
torch.distributed.DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41000
Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:672 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in libc10.so)
frame #56: /x/torch/distributed/algorithms/ddp_comm_hooks/ddp_hooks.py(53): <lambda>
"""
OWN_TRACE = """Traceback (most recent call last):
  File "/x/hetseq_hpc/worker.py", line 182, in run_worker
    raise RuntimeError(f"injected failure on rank 2")
RuntimeError: injected failure on rank 2 (HETSEQ_INJECT_FAILURE=2): unset it to train
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
