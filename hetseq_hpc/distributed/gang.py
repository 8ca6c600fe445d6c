"""The rendezvous as the engine sees it: :class:`Gang`, the facts and collectives that
balance/, tasks/, train/ and the worker use (as fairseq2's ``Gang``), met by the real
:class:`~hetseq_hpc.distributed.rendezvous.Rendezvous` and by :class:`FakeGang`: one process,
no store, no sockets, for unit tests of agreement and exchange logic. A fake world of N ranks
plays one of them; the other ranks' answers are scripted.
"""

from __future__ import annotations

import pickle
from typing import Any, Iterable, Iterator, List, Mapping, Optional, Protocol, Tuple, TypeVar

import torch.distributed as dist

from hetseq_hpc.distributed.rendezvous import StepStats, check_same
from hetseq_hpc.env.world import WorldInfo

T = TypeVar("T")


class StatsInFlight(Protocol):
    """An all-gather of :class:`StepStats` that may still run (:meth:`Gang.post_step_stats`)."""

    def result(self) -> List[StepStats]:
        """Wait for it; every rank's statistics in rank order."""
        ...


class BarrierInFlight(Protocol):
    """A barrier that may still run (:meth:`Gang.post_barrier`)."""

    def done(self) -> bool:
        """True once every rank has posted the barrier (never blocks)."""
        ...

    def wait(self) -> None:
        """Wait until every rank has posted it."""
        ...


class Gang(Protocol):
    """The ranks of one world and the collectives over them (objects travel pickled).

    Attributes:
        world: this rank's place in the world (``world.rank``, ``world.world_size``, node,
            het component, partition).
        cpu_group: the gloo process group the objects travel over; None in a
            :class:`FakeGang`, or once a recovery dropped a broken one (then nothing sets
            its timeout: :mod:`hetseq_hpc.train.recovery.timeouts`).
    """

    world: WorldInfo
    cpu_group: Optional[dist.ProcessGroup]

    def all_gather_objects(self, obj: T) -> List[T]:
        """Every rank's ``obj``, in rank order."""
        ...

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """``obj`` as given on rank ``src`` (the other ranks' ``obj`` is ignored)."""
        ...

    def check_agreement(self, digest: str, what: str) -> None:
        """Check that every rank computed the same ``digest`` of ``what``.

        Raises:
            AllocationError: the digests differ; the message names each rank's digest.
        """
        ...

    def barrier(self) -> None:
        """Wait for every rank."""
        ...

    def post_barrier(self) -> BarrierInFlight:
        """Start a barrier without waiting for it."""
        ...

    def post_step_stats(self, stats: StepStats) -> StatsInFlight:
        """Start the all-gather of this step's statistics without waiting for it."""
        ...

    def exchange_step_stats(self, stats: StepStats) -> List[StepStats]:
        """Every rank's statistics of this step, in rank order."""
        ...


class _Done:
    """A collective of a :class:`FakeGang`: complete when it is posted."""

    def __init__(self, stats: Optional[List[StepStats]] = None):
        self._stats = stats or []

    def result(self) -> List[StepStats]:
        return self._stats

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class FakeGang(Gang):
    """A :class:`Gang` in one process, without a store, sockets or torch.distributed.

    A world of one by default. With ``world_size`` N it plays rank ``rank``, and each
    collective that needs the other ranks' values (an all-gather, the agreement check, the
    step statistics, a broadcast from another rank) takes the next item of ``answers``: a
    mapping from each other rank to what it sent (for a broadcast, just ``src``). Without
    ``answers`` the other ranks send what this rank sent (N identical ranks). What this
    rank sends is pickled as over a real group (an object that cannot travel fails here too)
    and recorded in :attr:`calls` as ``(collective, object)``.

    Args:
        world_size: ranks in the fake world (>= 1).
        rank: the rank this process plays, in ``[0, world_size)``.
        answers: the other ranks' values, one mapping per collective call, in call order.
        world: the whole :class:`WorldInfo` instead (node, het component, partition);
            overrides ``world_size`` and ``rank``.

    Raises:
        WorldError: ``rank`` is outside ``[0, world_size)`` (:class:`WorldInfo`'s check).
        LookupError: a collective ran out of ``answers`` or an answer lacks a rank (a test
            that scripted fewer calls than the code made).
    """

    def __init__(
        self,
        world_size: int = 1,
        rank: int = 0,
        answers: Optional[Iterable[Mapping[int, Any]]] = None,
        world: Optional[WorldInfo] = None,
    ):
        self.world = world or WorldInfo(
            rank=rank,
            local_rank=rank,
            world_size=world_size,
            master_addr="fake-gang",
            master_port=1,
        )
        self.cpu_group: Optional[dist.ProcessGroup] = None
        self.calls: List[Tuple[str, Any]] = []
        self._answers: Optional[Iterator[Mapping[int, Any]]] = (
            None if answers is None else iter(answers)
        )

    def _others(self, what: str, sent: Any, ranks: Iterable[int]) -> Mapping[int, Any]:
        """The other ranks' values for this call (scripted, or ``sent`` mirrored)."""
        self.calls.append((what, sent))
        wanted = [r for r in ranks if r != self.world.rank]
        if not wanted:
            return {}
        if self._answers is None:
            return {r: sent for r in wanted}
        answer = next(self._answers, None)
        if answer is None:
            raise LookupError(
                f"FakeGang: no scripted answer for call {len(self.calls)} ({what} of {sent!r})"
            )
        missing = [r for r in wanted if r not in answer]
        if missing:
            raise LookupError(
                f"FakeGang: the answer to call {len(self.calls)} ({what}) lacks rank(s) {missing}"
            )
        return answer

    def all_gather_objects(self, obj: T) -> List[T]:
        """Every rank's ``obj`` in rank order: this rank's (pickled and read back) and the
        other ranks' scripted ones."""
        mine = pickle.loads(pickle.dumps(obj))
        others = self._others("all_gather_objects", mine, range(self.world.world_size))
        return [mine if r == self.world.rank else others[r] for r in range(self.world.world_size)]

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """``obj`` on rank ``src`` (pickled and read back), else rank ``src``'s scripted one."""
        if self.world.rank == src:
            mine: T = pickle.loads(pickle.dumps(obj))
            self.calls.append(("broadcast_object", mine))
            return mine
        return self._others("broadcast_object", obj, [src])[src]

    def check_agreement(self, digest: str, what: str) -> None:
        """The same check as the real rendezvous, on this rank's and the scripted digests.

        Raises:
            AllocationError: the digests differ.
        """
        check_same(self.all_gather_objects(digest), what)

    def barrier(self) -> None:
        """Nothing to wait for (recorded in :attr:`calls`)."""
        self.calls.append(("barrier", None))

    def post_barrier(self) -> BarrierInFlight:
        """A barrier that is done at once."""
        self.calls.append(("post_barrier", None))
        return _Done()

    def post_step_stats(self, stats: StepStats) -> StatsInFlight:
        """The gathered statistics, ready at once (the other ranks' are scripted)."""
        return _Done(self.exchange_step_stats(stats))

    def exchange_step_stats(self, stats: StepStats) -> List[StepStats]:
        """Every rank's statistics in rank order (an all-gather, as on the real group)."""
        return self.all_gather_objects(stats)


__all__ = ["BarrierInFlight", "FakeGang", "Gang", "StatsInFlight"]
