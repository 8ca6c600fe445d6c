"""SLURM faults named right, in-process: a killed or stopped rank, not the first peer that
complained; a job that stopped after a checkpoint with its requeues used up, not "FAILED (0/3
results)".

The tests replay what the project's test cluster left behind in such jobs (result tracebacks,
``logs/rank<N>.error.json``, ``logs/stop.json``: the texts below were recorded there). The same
for real on that cluster: tests/slurm/test_slurm_faults_real.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from submitit.core import utils as submitit_utils

from hetseq_hpc.cli import dispatch as cli
from hetseq_hpc.config import compose_run_config, save_run_config
from hetseq_hpc.env.preemption import REQUEUE, TERMINATE
from hetseq_hpc.errors import DataError, LaunchError, Preempted
from hetseq_hpc.launch.failures import (
    STOP_RECORD,
    StopWatch,
    first_failure,
    read_stop_record,
    write_stop_record,
)
from hetseq_hpc.launch.slurm import HetseqJobFunction, launch_slurm
from hetseq_hpc.launch.slurm_watch import RequeueLimitReached, wait_for_job
from hetseq_hpc.rundir.paths import RunDir

#: what ranks of a 3-rank job on the test cluster wrote when rank 1 was SIGKILLed (recorded)
RESET = (
    "RuntimeError: Got the following error when running the callback: RuntimeError: "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:37768: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application."
)
CLOSED = (
    "RuntimeError: Got the following error when running the callback: RuntimeError: "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:58774. This is typically caused by a remote worker crashing."
)
#: ... and when rank 1 was SIGSTOPped (cluster.collective_timeout_s=20)
TIMEOUT = (
    "RuntimeError: Got the following error when running the callback: RuntimeError: "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 20000ms for recv operation to complete"
)
OWN = "hetseq_hpc.errors.DataError: train file /d/empty.txt is empty: give a text file"


class _Job:
    """The attributes wait_for_job reads of a submitit job, with a fixed Slurm state."""

    def __init__(self, folder: Path, state: str = "RUNNING", job_id: str = "77"):
        self.job_id = job_id
        self.paths = type("P", (), {"folder": folder})()
        self.watcher = type("W", (), {"get_state": lambda _s, job_id, mode="": state})()


def _trace(line: str) -> str:
    return f'Traceback (most recent call last):\n  File "x.py", line 1, in f\n{line}\n'


def _rank_left(
    run_dir: Path, rank: int, line: str, when: float, peer: bool, result: bool = True, **extra
) -> None:
    """What a failed rank leaves: its error file (rank_guard.report_failure) and its result."""
    kind, _, message = line.partition(": ")
    kind = kind.rsplit(".", 1)[-1]  # type(exc).__name__
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / f"rank{rank}.error.json").write_text(
        json.dumps(
            {"rank": rank, "type": kind, "message": message, "time": when, "peer": peer, **extra}
        )
    )
    if result:
        submitit_utils.cloudpickle_dump(
            ("error", _trace(line)), run_dir / "submitit" / f"77_{rank}_result.pkl"
        )


def _failure(job_dir: Path, state: str = "RUNNING") -> str:
    with pytest.raises(LaunchError) as info:
        wait_for_job(_Job(job_dir / "submitit", state), RunDir(job_dir), 3)
    return str(info.value)


# ------------------------------------------------------------------ which rank is named
def test_killed_rank_is_named_not_the_first_peer_complaint(job_dir):
    """Rank 1 SIGKILLed: ranks 0 and 2 fail with disconnections (rank 0 first), rank 1 leaves
    nothing. Rank 0 was named before."""
    _rank_left(job_dir, 0, RESET, 100.0, peer=True)
    _rank_left(job_dir, 2, CLOSED, 100.3, peer=True)
    message = _failure(job_dir)
    assert message.startswith("job 77: rank 1 failed: it ended without an error of its own"), (
        message
    )
    assert "killed by a signal" in message and "77_1_log.err" in message


def test_stopped_rank_is_named_from_its_own_error_file(job_dir):
    """Rank 1 SIGSTOPped: ranks 0 and 2 time out first; Slurm then ends the step, which
    continues rank 1, and it fails with a disconnection too, but its error file says it stood
    still for 22 s (StopWatch)."""
    _rank_left(job_dir, 0, TIMEOUT, 100.0, peer=True)
    _rank_left(job_dir, 2, TIMEOUT.replace("recv", "send"), 100.02, peer=True)
    _rank_left(job_dir, 1, CLOSED, 101.6, peer=True, stopped_s=21.8)
    message = _failure(job_dir)
    assert message.startswith("job 77: rank 1 failed: it was stopped for 22 s"), message
    assert "its peers timed out waiting for it" in message


def test_first_own_error_by_time_wins_and_an_error_file_alone_is_enough(job_dir):
    """Ranks 2 and 1 both fail on their own, rank 1 first (by the error files' times); rank 1's
    result has not landed (only its error file has), rank 0 still runs."""
    _rank_left(job_dir, 2, "ValueError: late", 200.0, peer=False)
    _rank_left(job_dir, 1, OWN, 150.0, peer=False, result=False)
    message = _failure(job_dir)
    assert message.startswith("job 77: rank 1 failed: DataError: train file /d/empty.txt"), message


def test_only_peer_complaints_name_the_earliest(job_dir):
    for rank, when in ((0, 100.5), (1, 100.1), (2, 100.9)):
        _rank_left(job_dir, rank, CLOSED, when, peer=True)
    assert _failure(job_dir).startswith("job 77: rank 1 failed: RuntimeError: Got the following")


def test_first_failure_orders_silent_and_stopped_ranks():
    peer = {
        "type": "RuntimeError",
        "message": "Connection closed by peer",
        "peer": True,
        "time": 1.0,
    }
    own = {"type": "DataError", "message": "bad file", "peer": False, "time": 9.0}
    assert first_failure({}, {0: peer, 2: peer}, silent=[1]) == 1
    assert first_failure({}, {0: peer, 1: own, 2: peer}, silent=[]) == 1
    assert first_failure({}, {0: peer, 1: {**peer, "stopped_s": 20.0}, 2: peer}) == 1
    assert first_failure({}, {0: own, 2: peer}, silent=[1]) == 0, "an own error comes first"


def test_stop_watch_notices_a_stop_not_a_slow_tick():
    now = [0.0]
    watch = StopWatch(gap_s=5.0, tick_s=0.5, clock=lambda: now[0])
    last = watch.check(0.0)
    now[0] = 2.5  # a busy machine: 2 s late
    last = watch.check(last)
    assert watch.stopped_s == 0.0
    now[0] = 25.0  # stopped for 22 s
    watch.check(last)
    assert watch.stopped_s == pytest.approx(22.0)


# ------------------------------------------------------------------ the rank's side
def _job_function(tmp_path: Path, *overrides: str) -> HetseqJobFunction:
    run = compose_run_config(["cluster=testcluster", *overrides])
    config = save_run_config(run, tmp_path / "hetseq_config.yaml")
    return HetseqJobFunction(str(config), str(tmp_path))


def test_slurm_rank_writes_its_own_error_file(tmp_path, monkeypatch):
    import hetseq_hpc.worker as worker

    def fail(run, run_dir):
        raise DataError("train file /d/empty.txt is empty: give a text file")

    monkeypatch.setattr(worker, "run_worker", fail)
    monkeypatch.setenv("SLURM_PROCID", "2")
    with pytest.raises(DataError):
        _job_function(tmp_path)()
    err = json.loads((tmp_path / "logs" / "rank2.error.json").read_text())
    assert err["type"] == "DataError" and err["peer"] is False and "stopped_s" not in err


def test_slurm_rank0_records_a_stop_with_its_requeues_used_up(tmp_path, monkeypatch):
    import hetseq_hpc.worker as worker

    def preempted(run, run_dir):
        raise Preempted(12, REQUEUE, "SIGUSR2")

    monkeypatch.setattr(worker, "run_worker", preempted)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # = the limit: requeue_job runs no scontrol
    with pytest.raises(SystemExit) as info:
        _job_function(tmp_path, "cluster.max_num_timeout=1")()
    assert info.value.code == 3
    stop = read_stop_record(RunDir(tmp_path), "41")
    assert stop is not None and (stop["step"], stop["requeued"], stop["max_requeues"]) == (
        12,
        False,
        1,
    )
    assert read_stop_record(RunDir(tmp_path), "42") is None, (
        "another job's record is not this job's"
    )


def test_launch_clears_an_earlier_jobs_errors_and_stop_record(tmp_path):
    (tmp_path / "logs").mkdir()
    stale = [tmp_path / "logs" / "rank1.error.json", tmp_path / STOP_RECORD]
    for path in stale:
        path.write_text("{}")
    launch_slurm(
        compose_run_config(["cluster=testcluster", "cluster.dry_run=true"]), RunDir(tmp_path)
    )
    assert not any(p.exists() for p in stale)


# ------------------------------------------------------------------ requeues used up
def test_exhausted_requeues_are_a_clean_stop_with_the_resume_command(job_dir):
    write_stop_record(
        RunDir(job_dir), "77", 40, REQUEUE, restarts=3, max_requeues=3, requeued=False
    )
    with pytest.raises(RequeueLimitReached) as info:
        wait_for_job(_Job(job_dir / "submitit", "FAILED"), RunDir(job_dir), 3)
    assert isinstance(info.value, Preempted)
    assert str(info.value) == (
        "stopped after step 40 with a checkpoint: requeue limit (cluster.max_num_timeout=3) "
        f"reached; continue with: hetseq-hpc hydra.run.dir={job_dir} trainer.resume=auto"
    )


@pytest.mark.parametrize(
    "job_id, code, requeued",
    [
        ("76", REQUEUE, False),  # an earlier job's record
        ("77", REQUEUE, True),  # requeued: that attempt's record, the job then died another way
        ("77", TERMINATE, False),  # scancel: Slurm's state says CANCELLED
    ],
)
def test_other_stop_records_do_not_make_a_clean_stop(job_dir, job_id, code, requeued):
    write_stop_record(
        RunDir(job_dir), job_id, 40, code, restarts=0, max_requeues=3, requeued=requeued
    )
    with pytest.raises(LaunchError, match="ended FAILED before every rank finished"):
        wait_for_job(_Job(job_dir / "submitit", "FAILED"), RunDir(job_dir), 3)


def test_cli_exits_3_on_a_clean_stop(tmp_path, monkeypatch, capsys):
    def stopped(run, run_dir):
        raise RequeueLimitReached(40, 3, run_dir)

    monkeypatch.setattr(cli, "dispatch", stopped)
    with pytest.raises(SystemExit) as info:
        cli.dispatch_or_exit(
            compose_run_config(["cluster=testcluster"]), RunDir(tmp_path / "my run")
        )
    assert info.value.code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetseq-hpc: stopped after step 40")
    assert (
        f"continue with: hetseq-hpc 'hydra.run.dir={tmp_path / 'my run'}' trainer.resume=auto"
        in err
    )
