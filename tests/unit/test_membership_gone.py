"""Re-forming a world when the launcher says a member's process ended (issue 40), in-process
over the real job store (hetseq_hpc.distributed.auth_store) with a real heartbeat thread: a
member that had joined the re-forming, or had said it was re-forming, and then died is left
out at once, not after its heartbeat went stale (or half of ``cluster.collective_timeout_s``
for one that said it was coming); and the launcher's view of which ranks entered the
training loop (``armed``)."""

from __future__ import annotations

import pytest

from hetseq_hpc.distributed.membership import (
    Heartbeat,
    Membership,
    arm,
    armed_key,
    gone_key,
    job_store,
    recovering_key,
    reform,
    serve_job_store,
)

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def job():
    """``(server, store)``: the launcher's side and a rank's client (keys under ``job/``)."""
    server, port = serve_job_store("127.0.0.1", token=TOKEN)
    store = job_store(30, {"HETSEQ_STORE": f"127.0.0.1:{port}", "HETSEQ_JOB_TOKEN": TOKEN})
    yield server, store
    server.close()


def test_a_member_that_joined_or_was_coming_and_then_ended_is_left_out_at_once(job):
    """Member 1 joined the re-forming and member 2 said it was re-forming; then the launcher
    saw both processes end. Member 0 re-forms alone although neither heartbeat could go stale
    (stale_s=1000): without the launcher's word it would propose member 1 (and wait for
    member 2 until its deadline)."""
    server, store = job
    heartbeat = Heartbeat(store, 0, watch=[0, 1, 2])
    try:
        old = Membership(0, (0, 1, 2))
        store.set("g1/join/1", "1")
        store.set(recovering_key(1, 2), "1")
        server.set(gone_key(1), "-9")
        server.set(gone_key(2), "-9")
        new = reform(store, heartbeat, 0, old, stale_s=1000, timeout_s=20)
    finally:
        heartbeat.close()
    assert new == Membership(1, (0,))
    assert store.check(["excluded/1", "excluded/2"])


def test_the_launcher_sees_which_ranks_entered_the_training_loop(job):
    server, store = job
    arm(store, 1)
    assert server.check([armed_key(1)]) and not server.check([armed_key(0), armed_key(1)])


def test_a_store_timeout_while_reforming_is_named_in_words():
    """A rank lost while the survivors re-form makes the job's store time out: the warning
    that they re-form again says so in words, not with torch's exception class (a user reads
    "DistStoreError" as the crash issue 40 fixed)."""
    import torch.distributed as dist

    from hetseq_hpc.train.recovery.elastic import _first_line

    line = _first_line(dist.DistStoreError("wait timeout after 8000ms, keys: /g1/members"))
    assert "DistStoreError" not in line and "did not answer in the job's store" in line
    assert _first_line(RuntimeError("Connection closed by peer\nmore")) == (
        "RuntimeError: Connection closed by peer"
    )


def test_a_member_reads_every_heartbeat_in_one_request(job, monkeypatch):
    """At W ranks every member read every other member's heartbeat counter on its own, every
    beat (W^2 requests per beat to the job's store, issue 45): now the store times each
    counter's last change, and one request reads them all; a member that never beat is timed
    from the first look."""
    from hetseq_hpc.distributed.auth_store import AuthStoreClient

    _, store = job
    store.add("hb/3", 1)
    heartbeat = Heartbeat(store, 0)
    try:
        calls = []
        call = AuthStoreClient._call
        monkeypatch.setattr(
            AuthStoreClient,
            "_call",
            lambda self, op, *a, **k: calls.append(op) or call(self, op, *a, **k),
        )
        assert heartbeat.stale(range(64), 1000.0) == []
        assert [op for op in calls if op != "add"] == ["ages"]
        assert calls.count("add") <= 2  # this member's own beats, not a read of the others
        # 3 beat once, 7 never (timed from the first look above); 99 is seen for the first time
        assert heartbeat.stale([3, 7, 99], 0.0) == [3, 7]
        assert heartbeat.last_beat(3) is not None
    finally:
        heartbeat.close()
