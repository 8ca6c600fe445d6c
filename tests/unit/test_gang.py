"""FakeGang: the rendezvous interface (hetseq_hpc.distributed.gang.Gang) in one process, no
store and no sockets; a world of N ranks with the others' answers scripted. (The real gloo
collectives: tests/integration/test_rendezvous_two_ranks.py.)"""

from __future__ import annotations

import threading

import pytest

from hetseq_hpc.balance.agree import agree_on_sharding
from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.distributed.rendezvous import StepStats
from hetseq_hpc.errors import AllocationError, WorldError

GiB = 2.0**30


def _stats(rank: int) -> StepStats:
    return StepStats(1.5 + rank, 3 + rank, 2, 0.1, 0.2, 0.05, rank)


def test_a_world_of_one_answers_with_its_own_objects():
    gang = FakeGang()
    assert (gang.world.rank, gang.world.world_size, gang.cpu_group) == (0, 1, None)
    sent = {"a": [1, 2]}
    (got,) = gang.all_gather_objects(sent)
    assert got == sent and got is not sent  # pickled, as over a real group
    assert gang.broadcast_object("x") == "x"
    gang.check_agreement("d1", "allocation")
    gang.barrier()
    barrier = gang.post_barrier()
    assert barrier.done() and barrier.wait() is None
    assert gang.post_step_stats(_stats(0)).result() == [_stats(0)]
    assert gang.exchange_step_stats(_stats(0)) == [_stats(0)]
    assert [what for what, _ in gang.calls] == [
        "all_gather_objects",
        "broadcast_object",
        "all_gather_objects",
        "barrier",
        "post_barrier",
        "all_gather_objects",
        "all_gather_objects",
    ]


def test_an_object_that_cannot_travel_fails_as_on_a_real_group():
    with pytest.raises(Exception, match="pickle"):
        FakeGang().all_gather_objects(threading.Lock())


def test_rank_r_of_n_gets_the_scripted_answers_in_rank_order():
    gang = FakeGang(
        world_size=3,
        rank=1,
        answers=[{0: "zero", 2: "two"}, {0: "from rank 0"}, {0: _stats(0), 2: _stats(2)}],
    )
    assert gang.all_gather_objects("one") == ["zero", "one", "two"]
    assert gang.broadcast_object("ignored") == "from rank 0"
    assert gang.exchange_step_stats(_stats(1)) == [_stats(0), _stats(1), _stats(2)]
    assert gang.broadcast_object("mine", src=1) == "mine"  # the source needs no answer
    with pytest.raises(LookupError, match="no scripted answer for call 5"):
        gang.all_gather_objects("one")


def test_an_answer_without_every_other_rank_is_named():
    gang = FakeGang(world_size=3, rank=0, answers=[{1: "one"}])
    with pytest.raises(LookupError, match=r"lacks rank\(s\) \[2\]"):
        gang.all_gather_objects("zero")


def test_without_answers_the_other_ranks_mirror_this_one():
    gang = FakeGang(world_size=4, rank=2)
    assert gang.all_gather_objects(7) == [7, 7, 7, 7]
    gang.check_agreement("same", "allocation")


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(WorldError, match="rank 3 is outside"):
        FakeGang(world_size=3, rank=3)


def test_three_ranks_disagreeing_on_a_digest_are_each_named():
    gang = FakeGang(world_size=3, rank=0, answers=[{1: "aaa", 2: "bbb"}])
    with pytest.raises(AllocationError) as info:
        gang.check_agreement("aaa", "allocation")
    assert "ranks disagree on the allocation (digest rank 0: aaa, rank 1: aaa, rank 2: bbb)" in (
        str(info.value)
    )


@pytest.mark.parametrize(
    "others, expected",
    [
        ([("cpu", True), ("cpu", True)], "ddp"),  # a replica fits all three ranks
        ([("cpu", True), ("cpu", False)], "fsdp"),  # rank 2 is short: every rank shards
    ],
)
def test_three_ranks_agree_on_sharding_in_one_process(others, expected, caplog):
    """sharding.mode=auto decided as rank 0 of three: one all-gather of (device kind,
    replica fits), then the same choice every rank makes from the same verdicts."""
    gang = FakeGang(world_size=3, rank=0, answers=[{1: others[0], 2: others[1]}])
    caplog.set_level("INFO")
    assert agree_on_sharding("auto", 1 * GiB, 100 * GiB, gang) == expected
    assert gang.calls == [("all_gather_objects", ("cpu", True))]
    if expected == "fsdp":
        assert "a full replica does not fit rank(s) [2]" in caplog.text


def test_three_ranks_mixing_cuda_and_cpu_are_refused_before_any_sharding():
    gang = FakeGang(world_size=3, rank=1, answers=[{0: ("cuda", True), 2: ("cpu", True)}])
    with pytest.raises(AllocationError, match="rank 0: cuda, rank 1: cpu, rank 2: cpu"):
        agree_on_sharding("fsdp", 1 * GiB, 100 * GiB, gang)
