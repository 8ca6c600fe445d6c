"""The write fence of a rank (issue 46), in-process over the real job store
(hetseq_hpc.distributed.auth_store) and a real re-form: once the others re-formed the world
without a rank, nothing that rank writes reaches its run directory (atomic files, metrics
rows, events, checkpoints, its log file), and a rank that cannot get an answer from the store
does not write either. What it writes while current carries its original rank and generation.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest
import torch

from hetseq_hpc.distributed.auth_store import AuthStoreServer
from hetseq_hpc.distributed.fence import GenerationFence
from hetseq_hpc.distributed.membership import (
    Heartbeat,
    Membership,
    fence_store,
    job_store,
    reform,
    serve_job_store,
)
from hetseq_hpc.errors import RankFenced, StoreLost, exit_code
from hetseq_hpc.files import fence
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.rundir.events import append_event
from hetseq_hpc.rundir.logs import RunLogHandler
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.background import BackgroundWrite
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from hetseq_hpc.train.metrics.rows import MetricsWriter

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def job():
    """``(server, env)``: the launcher's store and what a rank needs to reach it."""
    server, port = serve_job_store("127.0.0.1", token=TOKEN)
    yield server, {"HETSEQ_STORE": f"127.0.0.1:{port}", "HETSEQ_JOB_TOKEN": TOKEN}
    server.close()


@pytest.fixture
def installed(tmp_path):
    """Install a fence (given to the returned function) on ``tmp_path / "run"``; removed after."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.logs.mkdir(parents=True)

    def install(check: GenerationFence) -> RunDir:
        fence.install(run_dir.root, check.check, check.identity)
        return run_dir

    yield install
    fence.uninstall()


def _files(run_dir: RunDir) -> dict:
    """Every file under the run directory -> its bytes."""
    return {p: p.read_bytes() for p in sorted(run_dir.root.rglob("*")) if p.is_file()}


def test_a_rank_left_out_by_a_reform_writes_nothing_after_it(job, installed, tmp_path):
    """Member 2 writes (stamped rank 2, generation 0) while current; members 0 and 1 then
    re-form as generation 1 without it (its heartbeat never moved). After that every writer
    of its run directory refuses, the files stay byte for byte, its log file gets no line,
    and the error says it was left out (exit code 4). A file outside the run directory is
    not fenced."""
    _, env = job
    survivor, left_out = job_store(30, env), job_store(30, env)
    mine = GenerationFence(fence_store(left_out, 5.0), 2, lease_s=60.0, ask_s=5.0)
    run_dir = installed(mine)
    log_handler = RunLogHandler(run_dir.rank_log(2))
    logger = logging.getLogger("test_write_fence")
    logger.addHandler(log_handler)
    rows = MetricsWriter(run_dir.metrics)
    try:
        rows.write({"step": 1, "loss": 2.0})
        append_event(run_dir, "checkpoint", step=1)
        atomic_write_json(run_dir.summary, {"final_step": 1})
        logger.warning("step 1 done")
        CheckpointManager(run_dir).write({"model": {"w": torch.zeros(2)}}, 1)
        stamped = {"rank": 2, "generation": 0}
        assert json.loads(run_dir.metrics.read_text())["written_by"] == stamped
        assert json.loads(run_dir.events.read_text())["written_by"] == stamped
        checkpoint = torch.load(CheckpointManager(run_dir).list()[-1], weights_only=True)
        assert checkpoint["written_by"] == stamped

        heartbeat = Heartbeat(survivor, 0, watch=[0, 1, 2])
        try:
            survivor.set("g1/join/1", "1")
            new = reform(survivor, heartbeat, 0, Membership(0, (0, 1, 2)), 0.2, 20)
        finally:
            heartbeat.close()
        assert new == Membership(1, (0, 1))

        before = _files(run_dir)
        mine.renew(float("inf"))  # a heartbeat after the re-form gives no lease
        logger.warning("step 2: a collective failed; re-forming")
        with pytest.raises(RankFenced, match=r"rank 2 was left out.*generation 1 with ranks"):
            rows.write({"step": 2, "loss": 1.0})
        for write in (
            lambda: append_event(run_dir, "checkpoint", step=2),
            lambda: atomic_write_json(run_dir.summary, {"final_step": 2}),
            lambda: CheckpointManager(run_dir).write({"model": {"w": torch.ones(2)}}, 2),
            lambda: fence.check_write(run_dir.metrics, ask=False),
        ):
            with pytest.raises(RankFenced) as raised:
                write()
            assert exit_code(raised.value) == 4
        assert _files(run_dir) == before
        assert list(run_dir.root.rglob("*.tmp")) == []
        atomic_write_json(tmp_path / "outside.json", {"ok": True})  # not the run directory
    finally:
        logger.removeHandler(log_handler)
        log_handler.close()
        rows.close()


def test_a_member_of_the_newer_generation_and_a_current_rank_may_write(job, installed):
    """Generation 1 lists member 0: its fence at generation 0 (about to enter it) writes, and
    after :meth:`GenerationFence.enter` so does generation 1 while no generation 2 exists."""
    _, env = job
    store = job_store(30, env)
    mine = GenerationFence(fence_store(store, 5.0), 0, ask_s=5.0)
    run_dir = installed(mine)
    store.set("g1/members", json.dumps([0, 1]))
    atomic_write_json(run_dir.summary, {"final_step": 1})
    mine.enter(1)
    atomic_write_json(run_dir.allocation, {"samples": [1]})
    assert json.loads(run_dir.summary.read_text()) == {"final_step": 1}


def test_a_rank_that_gets_no_answer_from_the_store_does_not_write(job, installed):
    """The store holds every request (its lock taken: a server cut off from this rank): the
    rank's question fails after ``ask_s``, it writes nothing, and the error names the store
    it could not reach (exit code 1: the job cannot go on without its store)."""
    server, env = job
    store = job_store(30, env)
    mine = GenerationFence(fence_store(store, 0.5), 1, ask_s=0.5, where=env["HETSEQ_STORE"])
    run_dir = installed(mine)
    where = re.escape(env["HETSEQ_STORE"])
    with server._cond, pytest.raises(StoreLost, match=f"cannot reach the job's store at {where}"):
        # every request waits for the store's lock, held here: no reply
        atomic_write_json(run_dir.summary, {"final_step": 1})
    assert not run_dir.summary.exists()
    with pytest.raises(StoreLost) as raised:  # for good, without asking again
        fence.check_write(run_dir.summary, ask=False)
    assert exit_code(raised.value) == 1


class _Watched:
    """The fence's store, passed through, with an event set when a question fails."""

    def __init__(self, store):
        self.store, self.failed = store, threading.Event()

    def check(self, keys):
        try:
            return self.store.check(keys)
        except Exception:
            self.failed.set()
            raise

    def get(self, key):
        return self.store.get(key)


def test_a_rank_cut_off_waits_for_its_link_then_finds_it_was_left_out(job, installed):
    """The store goes away (closed: the rank's link is down) and comes back on the same
    address with generation 1 formed without member 2: the rank's write waited (asking
    again, writing nothing) and is refused as left out, not as a lost store (exit code 4)."""
    server, env = job
    port = int(env["HETSEQ_STORE"].rsplit(":", 1)[1])
    watched = _Watched(fence_store(job_store(30, env), 0.5))
    mine = GenerationFence(watched, 2, ask_s=0.5, give_up_s=120.0)
    run_dir = installed(mine)
    server.close()
    outcome = {}

    def write() -> None:
        try:
            atomic_write_json(run_dir.summary, {"final_step": 3})
        except RankFenced as exc:
            outcome["error"] = exc

    writer = threading.Thread(target=write)
    writer.start()
    assert watched.failed.wait(60), "the fence never asked the closed store"
    back = AuthStoreServer("127.0.0.1", port, TOKEN)
    try:
        back.set("job/g1/members", json.dumps([0, 1]))
        writer.join(60)
    finally:
        back.close()
    assert not writer.is_alive()
    assert not isinstance(outcome["error"], StoreLost), outcome["error"]
    assert "rank 2 was left out" in str(outcome["error"]) and exit_code(outcome["error"]) == 4
    assert not run_dir.summary.exists()


def test_a_background_checkpoint_of_a_left_out_rank_is_not_written(job, installed):
    """The checkpoint thread's write is refused too, and its waiter gets the fence's error
    (the rank stops), not a failed write to log."""
    _, env = job
    mine = GenerationFence(fence_store(job_store(30, env), 5.0), 1, ask_s=5.0)
    run_dir = installed(mine)
    mine.exclude("rank 1 was left out: test")
    manager = CheckpointManager(run_dir)
    pending = BackgroundWrite(4, lambda: manager.write({"model": {"w": torch.ones(1)}}, 4))
    with pytest.raises(RankFenced, match="rank 1 was left out"):
        pending.wait()
    assert manager.list() == [] and not list(run_dir.root.rglob("*.tmp"))


class _Counted(_Watched):
    """The fence's store, passed through, counting its questions."""

    def __init__(self, store):
        super().__init__(store)
        self.asked = 0

    def check(self, keys):
        self.asked += 1
        return super().check(keys)


def test_a_log_line_under_a_fresh_lease_does_not_ask_the_store(job):
    """A heartbeat's confirmation (a lease) lets log lines go without a question to the store;
    a row or checkpoint write asks once; a second beat soon after is not confirmed again."""
    _, env = job
    counted = _Counted(fence_store(job_store(30, env), 5.0))
    mine = GenerationFence(counted, 0, lease_s=600.0, ask_s=5.0)
    mine.renew(time.monotonic())
    assert counted.asked == 1
    for _ in range(3):
        mine.check(ask=False)
    mine.renew(time.monotonic())
    assert counted.asked == 1
    mine.check(ask=True)
    assert counted.asked == 2


def test_a_killed_launcher_lets_only_a_rank_confirmed_just_before_write(job):
    """The local launcher serves the job's store: killed, it takes the store with it for
    every rank, and no world can re-form after. A rank whose last completed step (or
    heartbeat) confirmed it less than the heartbeat staleness (2 leases) before the parent's
    death may write its last checkpoint without the store; one stopped or cut off longer
    than that may not (the others may have left it out), nor a fenced one. Found by
    tests/integration/test_launch_local.py::test_sigkill_to_launcher_stops_the_ranks_within_seconds:
    the orphaned ranks waited for the dead store instead of checkpointing."""
    _, env = job
    mine = GenerationFence(fence_store(job_store(30, env), 5.0), 0, lease_s=5.0, ask_s=5.0)
    assert not mine.current_at(time.monotonic())  # never confirmed
    confirmed = time.monotonic()
    mine.confirm(confirmed)  # a completed step
    assert mine.current_at(confirmed + 9.9)
    assert not mine.current_at(confirmed + 10.1)  # stale long enough to have been left out
    mine.exclude("left out")
    assert not mine.current_at(confirmed + 1.0)


def test_a_write_asking_when_the_launcher_dies_goes_on_without_the_store(job):
    """The race the CI run hit (1 run in 2): a row write had begun asking the store when the
    launcher died, before the parent-death signal said so. The question fails on a refused
    connection within a second, and between questions the fence sees that the store died
    for every rank while this rank was current: the write goes on, not after ``give_up_s``.
    (The launcher's death is ``died_at`` set by another thread, as the SIGHUP handler does.)"""
    server, env = job
    mine = GenerationFence(
        fence_store(job_store(30, env), 5.0), 0, lease_s=5.0, ask_s=5.0, give_up_s=300.0
    )
    died: dict = {}
    mine.store_dies_with(lambda: died.get("at"))
    mine.confirm(time.monotonic())
    mine.check(ask=True)  # the store answers
    server.close()
    threading.Timer(0.5, lambda: died.setdefault("at", time.monotonic())).start()
    mine.check(ask=True)  # returns once "at" is set; a hang would take give_up_s
    assert mine.fenced is None


def test_a_rank_stale_when_the_launcher_died_still_waits_for_the_store(job):
    """Not current when the store died (stopped longer than the staleness before): the fence
    still asks, and gives up as cut off (StoreLost) instead of writing."""
    server, env = job
    mine = GenerationFence(
        fence_store(job_store(30, env), 1.0), 0, lease_s=1.0, ask_s=1.0, give_up_s=1.5
    )
    mine.store_dies_with(lambda: time.monotonic())
    mine.confirm(time.monotonic() - 10.0)
    server.close()
    with pytest.raises(StoreLost):
        mine.check(ask=True)


class _LostAtQuestion:
    """A fence check that answers ``ok`` store questions (``ask=True``), then raises StoreLost
    as a rank cut off from the store does; a lease (``ask=False``) always holds."""

    def __init__(self, ok: int):
        self.ok = ok

    def check(self, ask: bool) -> None:
        if ask:
            if self.ok <= 0:
                raise StoreLost("rank 0 cannot reach the job's store (a test)")
            self.ok -= 1

    def identity(self) -> dict:
        return {"rank": 0, "generation": 0}


@pytest.mark.parametrize("answered", [0, 1])
def test_a_checkpoint_cut_off_mid_write_leaves_no_file_without_its_checksum(installed, answered):
    """Found by test_sigstop_of_the_launcher_as_a_partition_of_the_stores_node_ends_the_run_intact
    (2 runs in 5): the checkpoint was renamed into place, then the fence's question before its
    SHA-256 sidecar found the store gone, and step_N.pt stayed without a checksum (every rank
    then called the last checkpoint unverifiable). The sidecar is written first now: the
    store lost at the checkpoint's question (0 answered) or at the sidecar's (1) leaves no
    checkpoint of that step, and the earlier one verifies."""
    from hetseq_hpc.train.checkpoint.files import verify_checksum

    current = _LostAtQuestion(ok=10)
    run_dir = installed(current)
    manager = CheckpointManager(run_dir)
    manager.write({"model": {"w": torch.zeros(2)}}, 1)
    current.ok = answered
    with pytest.raises(StoreLost):
        manager.write({"model": {"w": torch.ones(2)}}, 2)
    assert [p.name for p in manager.list()] == ["step_00000001.pt"]
    assert not manager.path(2).exists()
    verify_checksum(manager.list()[-1])
