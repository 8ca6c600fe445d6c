"""Grow back's admission (issue 45), in-process over the real job store
(hetseq_hpc.distributed.auth_store): a replacement's request, the survivors' answer, the
refusal of a newcomer of another code version or config, and a join row's ``join_s``."""

from __future__ import annotations

import threading

import pytest

from hetseq_hpc.config import compose_run, to_run_config
from hetseq_hpc.distributed.admission import (
    answer,
    closed_key,
    join_requests,
    read_requests,
    refusal,
    request_join,
    wait_for_answer,
)
from hetseq_hpc.distributed.membership import job_store, serve_job_store
from hetseq_hpc.train.recovery.grow import code_version, job_fingerprint

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def run_config():
    """``run_config(*overrides)`` -> validated RunConfig."""
    return lambda *overrides: to_run_config(compose_run(list(overrides)))


@pytest.fixture
def store():
    """A rank's client of a real job store (keys under ``job/``)."""
    server, port = serve_job_store("127.0.0.1", token=TOKEN)
    yield job_store(30, {"HETSEQ_STORE": f"127.0.0.1:{port}", "HETSEQ_JOB_TOKEN": TOKEN})
    server.close()


def test_a_request_is_counted_read_and_answered(store, run_config):
    """The survivors see one request (its member, place and fingerprint) and the newcomer
    gets their answer; nothing was asked before it."""
    assert join_requests(store) == 0
    mine = job_fingerprint(run_config("cluster.ranks=3"))
    assert request_join(store, member=3, slot=1, host="vm", fingerprint=mine) == 1
    assert join_requests(store) == 1
    (req,) = read_requests(store, 1, 1)
    assert (req["member"], req["slot"], req["fingerprint"]) == (3, 1, mine)
    assert refusal(req, mine, taken=False) is None
    answer(store, 3, {"generation": 2, "members": [0, 3, 2], "source": 0})
    got = wait_for_answer(store, 3, stop=lambda: False, poll_s=0.01)
    assert got == {"generation": 2, "members": [0, 3, 2], "source": 0}


def test_a_waiting_newcomer_ends_when_admissions_close(store):
    """Nobody is left to admit it (the launcher says so): the wait ends with None."""
    done = threading.Event()
    got = {}

    def wait():
        got["answer"] = wait_for_answer(store, 5, stop=lambda: False, poll_s=0.01)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    store.set(closed_key(), "1")
    assert done.wait(30) and got["answer"] is None


@pytest.mark.parametrize(
    ("changed", "words"),
    [("code", "code version"), ("config", "config digest")],
)
def test_a_newcomer_of_another_code_or_config_is_refused_in_one_line(changed, words, run_config):
    expected = job_fingerprint(run_config("cluster.ranks=3"))
    other = {**expected, changed: "something-else"}
    req = {"member": 3, "slot": 1, "fingerprint": other}
    line = refusal(req, expected, taken=False)
    assert line is not None and "\n" not in line
    assert words in line and "rank 1" in line and "goes on without it" in line


def test_a_newcomer_for_a_place_still_held_is_refused(run_config):
    expected = job_fingerprint(run_config("cluster.ranks=3"))
    line = refusal({"member": 3, "slot": 1, "fingerprint": expected}, expected, taken=True)
    assert line is not None and "still in the running world" in line


def test_the_fingerprint_names_the_config_and_the_code(run_config):
    """Another setting changes the config digest; the code version is the package's."""
    one = job_fingerprint(run_config("cluster.ranks=3"))
    two = job_fingerprint(run_config("cluster.ranks=3", "trainer.seed=7"))
    assert one["code"] == two["code"] == code_version() and one["config"] != two["config"]


def test_a_join_row_counts_join_s_from_the_request(run_config, tmp_path):
    """A join's membership row gets ``join_s`` (from its request), a loss's ``recovery_s``."""
    import time

    from hetseq_hpc.rundir.paths import RunDir
    from hetseq_hpc.train.metrics.step_log import StepLog

    log = StepLog(run_config("cluster.ranks=3"), RunDir(tmp_path), 0, 1, {})
    joined = {"event": "membership", "joined": [{"rank": 1}], "lost_monotonic": time.monotonic()}
    lost = {"event": "membership", "lost": [{"rank": 1}], "lost_monotonic": time.monotonic()}
    log.events += [joined, lost]
    log.flush_events("run")
    assert joined["join_s"] >= 0 and "recovery_s" not in joined
    assert lost["recovery_s"] >= 0 and "join_s" not in lost
    log.close()


def test_survivors_refuse_a_newcomer_of_another_code_version_and_go_on(store, run_config):
    """The survivors' side (rank 0 of a world of 3 that lost rank 1, in-process: the world's
    collectives are not reached): a request from a process of another code version is
    answered with its one line, nothing changes in the world, and the request is counted as
    answered (not asked again at the next step). The trainer is a stand-in: a refusal reads
    only its rank and whether it is sharded."""
    from types import SimpleNamespace

    import torch

    from hetseq_hpc.distributed.gang import FakeGang
    from hetseq_hpc.distributed.membership import Membership
    from hetseq_hpc.train.recovery.elastic import ElasticWorld
    from hetseq_hpc.train.recovery.grow import admit

    run = run_config("cluster.ranks=3", "trainer.elastic.restarts=1")
    world = Membership(1, (0, 2))
    elastic = ElasticWorld(run, store, FakeGang(3), [], torch.device("cpu"), membership=world)
    try:
        other = {**job_fingerprint(run), "code": "0.0.1+000000000000"}
        request_join(store, member=3, slot=1, host="vm", fingerprint=other)
        trainer = SimpleNamespace(rank=0, sharded=False)
        assert admit(elastic, trainer, join_requests(store)) is None
        got = wait_for_answer(store, 3, stop=lambda: False, poll_s=0.01)
        assert "code version" in got["refused"] and "\n" not in got["refused"]
        assert elastic.membership == world and elastic.joins_answered == 1
    finally:
        elastic.close()


def test_a_newcomer_that_ended_before_its_admission_is_not_admitted(store, run_config):
    """The launcher saw the replacement's process end (``gone``) before the survivors read its
    request: they do not grow the world with a member that will never come."""
    from types import SimpleNamespace

    import torch

    from hetseq_hpc.distributed.gang import FakeGang
    from hetseq_hpc.distributed.membership import Membership
    from hetseq_hpc.train.recovery.elastic import ElasticWorld
    from hetseq_hpc.train.recovery.grow import admit

    run = run_config("cluster.ranks=3", "trainer.elastic.restarts=1")
    world = Membership(1, (0, 2))
    elastic = ElasticWorld(run, store, FakeGang(3), [], torch.device("cpu"), membership=world)
    try:
        request_join(store, member=3, slot=1, host="vm", fingerprint=job_fingerprint(run))
        store.set("gone/3", "-9")
        assert admit(elastic, SimpleNamespace(rank=0, sharded=False), 1) is None
        assert elastic.membership == world and elastic.joins_answered == 1
    finally:
        elastic.close()
