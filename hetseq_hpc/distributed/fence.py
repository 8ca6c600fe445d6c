"""A rank's fencing token: the generation of the world it is in, checked in the job's store.

:func:`~hetseq_hpc.distributed.membership.reform` writes each new world's members under
``g<n>/members``; a rank of generation ``n`` is current while ``g<n+1>/members`` is absent
or lists it. :class:`GenerationFence` is the check the worker installs
(:mod:`hetseq_hpc.files.fence`): a row or checkpoint write asks the store once; a log line
takes a lease, renewed by the heartbeat thread after each beat that is followed by a
confirmation (the others leave a rank out only after its heartbeat stood still for
``stale_s``, and the lease is shorter). A rank found left out is fenced for good; a rank that
cannot reach the store waits, writing nothing, until its link comes back (then it finds out)
or ``give_up_s`` passed (:class:`~hetseq_hpc.errors.StoreLost`).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Dict, Optional, Sequence

import torch.distributed as dist

from hetseq_hpc.errors import RankFenced, StoreLost


def members_key(generation: int) -> str:
    """The key (under the job's prefix) that holds generation ``generation``'s members (a
    JSON list of original ranks), written once by :func:`~hetseq_hpc.distributed.membership.reform`."""
    return f"g{int(generation)}/members"


def left_out_line(member: int, generation: int, members: Sequence[int]) -> str:
    """The one line of a rank the others went on without."""
    return (
        f"rank {int(member)} was left out: the others re-formed the job as generation "
        f"{int(generation)} with ranks {list(members)} without it (it was cut off or stopped "
        "too long); it stops without writing into the run directory"
    )


class GenerationFence:
    """This rank's fencing token and its check (``check(ask)``, :mod:`hetseq_hpc.files.fence`).

    Args:
        store: the job's store, best a client of its own whose replies wait at most ``ask_s``
            (:func:`~hetseq_hpc.distributed.membership.fence_store`).
        member: this rank's original rank; generation: its world's generation (0 at start).
        lease_s: how long a confirmation by the heartbeat thread stands for a log line
            (seconds; shorter than the heartbeat staleness after which a rank is left out).
        ask_s: how long one question to the store may take.
        give_up_s: how long the store may stay unreachable (questions asked again, nothing
            written meanwhile) before the rank stops as cut off: a rank whose own link comes
            back in time then finds whether the others left it out.
        where: the store's address, for the one line of a rank that cannot reach it.
    """

    def __init__(
        self,
        store: dist.Store,
        member: int,
        generation: int = 0,
        lease_s: float = 1.0,
        ask_s: float = 10.0,
        give_up_s: float = 0.0,
        where: str = "",
    ):
        self.member, self.generation = int(member), int(generation)
        self.lease_s, self.ask_s, self.where = float(lease_s), float(ask_s), where
        self.give_up_s = float(give_up_s)
        self.store = store
        self.fenced: Optional[RankFenced] = None  # set once, for good
        self._confirmed = float("-inf")  # time.monotonic() the lease runs from
        self._lock = threading.Lock()
        #: when the store died for every rank at once (``time.monotonic()``), else None: the
        #: local launcher that served it was killed (:meth:`store_dies_with`)
        self._store_died_at: Callable[[], Optional[float]] = lambda: None

    def store_dies_with(self, died_at: Callable[[], Optional[float]]) -> None:
        """Say how this rank learns that the job's store died for every rank (``died_at()``:
        the ``time.monotonic()`` of it, else None): the local launcher serves the store, and
        its death (the parent-death signal) ends every world too. A rank then current
        (:meth:`current_at`) may write its last checkpoint without asking; the check looks
        before each question and between questions, so a write that was asking when the
        launcher died goes on."""
        self._store_died_at = died_at

    def _current_when_store_died(self) -> bool:
        at = self._store_died_at()
        return at is not None and self.current_at(at)

    def identity(self) -> Dict[str, int]:
        """``{"rank": original rank, "generation": n}``: what this rank's writes carry."""
        return {"rank": self.member, "generation": self.generation}

    def enter(self, generation: int) -> None:
        """This rank is a member of the newer world ``generation`` (its writes check that)."""
        with self._lock:
            self.generation = int(generation)
            self._confirmed = float("-inf")

    def exclude(self, why: str) -> RankFenced:
        """Fence this rank for good (the others went on without it); returns the error."""
        with self._lock:
            if self.fenced is None:
                self.fenced = RankFenced(why)
            return self.fenced

    def renew(self, sent: float) -> None:
        """After a heartbeat sent at ``sent`` (``time.monotonic()``) reached the store: confirm
        this rank is current and let the lease run from ``sent`` (never raises: the heartbeat
        thread calls it). While the lease has more than half of ``lease_s`` to run it is
        kept as it is, without a question: the store sees fewer than one a second per rank."""
        if sent - self._confirmed < self.lease_s / 2.0:
            return
        try:
            self._ask()
        except RankFenced:
            return
        with self._lock:
            self._confirmed = max(self._confirmed, sent)

    def confirm(self, at: float) -> None:
        """A collective of this rank's whole world completed at ``at`` (``time.monotonic()``;
        a training step): nobody had re-formed without this rank then, so it counts as a
        confirmation, as a heartbeat the store answered does."""
        with self._lock:
            if self.fenced is None:
                self._confirmed = max(self._confirmed, at)

    def current_at(self, at: float) -> bool:
        """Whether this rank was confirmed current less than ``2 * lease_s`` (the heartbeat
        staleness after which the others leave a rank out) before ``at``
        (``time.monotonic()``): no world can have re-formed without it by then. Used when the
        job's store died for every rank at ``at`` (the local launcher that served it was
        killed): no world can re-form after either, so such a rank may write its last
        checkpoint; one that was stopped or cut off before stays unable to write."""
        return self.fenced is None and at - self._confirmed < 2.0 * self.lease_s

    def check(self, ask: bool = True) -> None:
        """Return when this rank may write into the run directory now.

        Args:
            ask: ask the store (one round trip); False: a lease younger than ``lease_s`` will
                do, else ask.

        Raises:
            RankFenced: a newer generation does not list this rank (also every later call).
            StoreLost: the store did not answer for ``give_up_s`` (questions of ``ask_s``).
        """
        if self.fenced is not None:
            raise self.fenced
        if not ask and time.monotonic() - self._confirmed < self.lease_s:
            return
        if self._current_when_store_died():
            return
        self._ask()

    def _ask(self) -> None:
        if self.fenced is not None:
            raise self.fenced
        first_failure = None
        while True:
            generation = self.generation
            key = members_key(generation + 1)
            try:
                members = json.loads(self.store.get(key)) if self.store.check([key]) else None
                break
            except Exception as exc:
                if self._current_when_store_died():
                    return  # the launcher died while asking: its store with it
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure < self.give_up_s:
                    time.sleep(min(1.0, self.ask_s))  # nothing is written while it waits
                    continue
                raise self._lost(exc) from None
        if members is not None and self.member not in members:
            raise self.exclude(left_out_line(self.member, generation + 1, members))

    def _lost(self, exc: BaseException) -> RankFenced:
        """Fence this rank for good: the store did not answer (``exc``); returns the error."""
        where = f" at {self.where}" if self.where else ""
        lost = StoreLost(
            f"rank {self.member} cannot reach the job's store{where} (the master's node: "
            f"the launcher or the Slurm batch host) for {max(self.give_up_s, self.ask_s):g} s "
            f"({type(exc).__name__}): that node or this one is cut off, so this rank stops "
            "without writing into the run directory; the last checkpoint stays as it is"
        )
        with self._lock:
            if self.fenced is None:
                self.fenced = lost
            return self.fenced


__all__ = ["GenerationFence", "left_out_line", "members_key"]
