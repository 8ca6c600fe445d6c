"""The local launcher's side of grow back (issue 45), in-process over the real job store: which
lost ranks it restarts (``trainer.elastic.restarts``), the new member ids, and closing the
admissions. No process is started: ``spawn`` records what would be (the processes' list holds
its answers)."""

from __future__ import annotations

import pytest

from hetseq_hpc.distributed.admission import answer_key, closed_key, refused_key, server_key
from hetseq_hpc.distributed.membership import armed_key, serve_job_store
from hetseq_hpc.launch.local import ElasticJob

TOKEN = "0123456789abcdef0123456789abcdef"


class _Running:
    """A process that has not ended (what ``close_admissions`` and the job read of it)."""

    def poll(self):
        return None


@pytest.fixture
def job():
    server, _ = serve_job_store("127.0.0.1", token=TOKEN)
    job = ElasticJob(server, TOKEN, world=3, restarts=1)
    for rank in range(3):  # every rank entered the training loop
        server.set(armed_key(rank), "1")
    yield job
    server.close()


def _spawned(job, procs, codes):
    started = []

    def spawn(rank, member):
        started.append((rank, member))
        return _Running()

    job.note_exits(procs, codes)
    job.replace_lost(procs, codes, spawn)
    return started


def test_a_killed_rank_is_restarted_once_as_a_new_member(job):
    procs = [_Running() for _ in range(3)]
    codes = {1: -9}
    assert _spawned(job, procs, codes) == [(1, 3)] and codes == {}
    assert job.member_of == [0, 3, 2] and job.restarts_left == [1, 0, 1]
    codes = {1: -9}  # the replacement is killed too: no restarts left for rank 1
    assert _spawned(job, procs, codes) == [] and codes == {1: -9}
    assert job.store.check(["job/gone/3"])  # the survivors leave member 3 out at once


@pytest.mark.parametrize("codes", [{1: -9, 0: 0}, {1: -9, 2: 1}], ids=["finished", "failed"])
def test_no_restart_when_the_run_ends_or_has_failed(job, codes):
    """A rank that finished (the run ends), a real failure (the run stops): nothing is
    restarted."""
    assert _spawned(job, [_Running() for _ in range(3)], dict(codes)) == []


def test_a_left_out_rank_is_restarted_but_not_a_refused_replacement(job):
    """A rank that ended itself after the others left it out (exit 4) is replaced; a
    replacement the survivors refused (its exit 4 too) is not restarted again."""
    procs = [_Running() for _ in range(3)]
    assert _spawned(job, procs, {2: 4}) == [(2, 3)]
    job.restarts_left[2] = 1
    job.store.set(server_key(refused_key(3)), "1")
    assert _spawned(job, procs, {2: 4}) == []


def test_admissions_close_when_only_waiting_replacements_are_left(job):
    procs = [_Running() for _ in range(3)]
    _spawned(job, procs, {1: -9})
    job.close_admissions(procs, {0: 0, 2: 0})
    assert job.store.check([server_key(closed_key())])
    assert job.all_lost_at is None  # the others finished the run: a normal end


def test_every_rank_holding_the_state_lost_is_a_failure_not_a_finished_run(job):
    """Issue 45 (chaos soak): the two survivors killed at once while the third rank's
    replacement waited to be admitted: every process left is a replacement nobody can admit.
    They end by themselves (exit 0), and the launcher ended with exit 0 as for a finished
    run; now it knows every state holder was lost (:attr:`ElasticJob.all_lost_at`)."""
    procs = [_Running() for _ in range(3)]
    _spawned(job, procs, {1: -9})
    codes = {0: -9, 2: -9}
    assert _spawned(job, procs, codes) == [(0, 4), (2, 5)] and codes == {}
    job.close_admissions(procs, codes)
    assert job.store.check([server_key(closed_key())])
    assert job.all_lost_at == 3


def test_admissions_stay_open_while_a_rank_can_admit(job):
    procs = [_Running() for _ in range(3)]
    _spawned(job, procs, {1: -9})
    job.close_admissions(procs, {})
    job.store.set(server_key(answer_key(3)), "{}")  # admitted: it is a rank like the others
    job.close_admissions(procs, {0: 0, 2: 0})
    assert not job.store.check([server_key(closed_key())])
