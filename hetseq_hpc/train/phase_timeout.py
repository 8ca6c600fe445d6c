"""Collective timeouts of the phases after a training step: the re-balancing decision
(:func:`step_timeout`: the step's own timeout), validation and the checkpoint
(:func:`phase_timeout`), and the first validation's estimated wait (:func:`first_validation_wait`).

A rank that hangs in one of these phases is noticed from that phase's own measured time (never
less than the step's timeout), not after ``cluster.collective_timeout_s``. The rule, the
estimate for a first validation and which groups get the timeout:
docs/design/elastic-recovery.md, "Timeouts of validation and checkpoints".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from datetime import timedelta
from typing import Any, Deque, Dict, Iterator, Optional, Sequence

log = logging.getLogger(__name__)

#: a phase's timeout is this many times its longest recent duration
FACTOR = 3.0
#: how many recent durations of a phase count
WINDOW = 5


class PhaseTimeouts:
    """Measured durations of each phase (this rank's wall time, seconds) and the timeout they
    give (:meth:`seconds`).

    Args:
        first_s: the timeout of a phase never measured (``cluster.collective_timeout_s``).
    """

    def __init__(self, first_s: float):
        self.first_s = float(first_s)
        self.durations: Dict[str, Deque[float]] = {}
        self.estimate_first = True  # see first_validation_wait; off after forget()

    def seconds(self, phase: str, step_timeout_s: float) -> float:
        """The timeout of ``phase`` now: ``first_s`` until it was measured once, then
        ``max(step_timeout_s, FACTOR x longest recent duration)``."""
        seen = self.durations.get(phase)
        if not seen:
            return self.first_s
        return max(float(step_timeout_s), FACTOR * max(seen))

    def forget(self) -> None:
        """Drop every measurement: after a timeout that lost nobody (a phase slower than its
        past, not a hung rank) the redone phase waits ``first_s`` again, estimated no more
        (:func:`first_validation_wait`)."""
        self.durations.clear()
        self.estimate_first = False

    def record(self, phase: str, seconds: float) -> None:
        """A completed ``phase`` took ``seconds`` on this rank."""
        self.durations.setdefault(phase, deque(maxlen=WINDOW)).append(max(0.0, float(seconds)))


def peer_cost_ratio(history: Sequence[Any], rank: int, world_size: int) -> Optional[float]:
    """The largest ratio, over the last :data:`WINDOW` steps of this world and its peers, of a
    peer's compute seconds per training sample to this rank's (at least 1); None without a
    step of this world (``per_rank`` of ``world_size`` entries) to measure it from."""
    ratios = []
    for rec in list(history)[-WINDOW:]:
        stats = getattr(rec, "per_rank", None) or []
        if len(stats) != world_size or not 0 <= rank < world_size:
            continue
        cost = [s.compute_time_s / s.samples if s.samples else 0.0 for s in stats]
        if cost[rank] > 0:
            ratios.append(max(cost) / cost[rank])
    return max(1.0, *ratios) if ratios else None


def first_validation_wait(trainer: Any, local_s: float) -> Optional[float]:
    """Called by a rank that finished its share of a validation pass in ``local_s`` seconds,
    right before the gather of the sums: the first validation (nothing measured yet) of an
    in-job-recovery run waits ``max(step timeout, FACTOR x local_s x peer_cost_ratio)`` there
    instead of ``cluster.collective_timeout_s`` (see the module docstring). Returns the
    timeout set, or None when nothing changed (no recovery, a validation measured before, a
    timeout that lost nobody before (:meth:`PhaseTimeouts.forget`), no step of this world to
    estimate from, or an estimate not shorter)."""
    elastic = getattr(trainer, "elastic", None)
    group = getattr(getattr(trainer, "rdv", None), "cpu_group", None)
    timeouts = getattr(elastic, "phase_timeouts", None)
    if (
        group is None
        or timeouts is None
        or not timeouts.estimate_first
        or timeouts.durations.get("validation")
    ):
        return None
    ratio = peer_cost_ratio(trainer.history, trainer.rank, trainer.world.world_size)
    if ratio is None:
        return None
    seconds = max(float(elastic.timeout.seconds), FACTOR * max(0.0, local_s) * ratio)
    if seconds >= timeouts.first_s:
        return None
    _set(seconds, group)
    log.info(
        "first validation: this rank's share took %.1f s, the slowest peer's should take "
        "%.1fx that: its gather waits %.1f s",
        local_s,
        ratio,
        seconds,
    )
    return seconds


def _set(seconds: float, group: Optional[Any] = None) -> None:
    from torch.distributed.distributed_c10d import _set_pg_timeout

    with contextlib.suppress(Exception):  # a broken group: the recovery replaces it
        _set_pg_timeout(timedelta(seconds=seconds), group)


@contextlib.contextmanager
def rendezvous_timeout(trainer: Any, seconds: float) -> Iterator[None]:
    """Inside the block the rendezvous group's collectives (``trainer.rdv.cpu_group``) time out
    after ``seconds``, then after ``cluster.collective_timeout_s`` again (unless a recovery
    dropped the group meanwhile)."""
    _set(seconds, trainer.rdv.cpu_group)
    try:
        yield
    finally:
        after = getattr(trainer.rdv, "cpu_group", None)  # None: dropped by a recovery
        if after is not None:
            _set(trainer.run.cluster.collective_timeout_s, after)


@contextlib.contextmanager
def step_timeout(trainer: Any) -> Iterator[None]:
    """With in-job recovery, the rendezvous group's collectives wait at most the training
    step's timeout (:class:`~hetseq_hpc.train.elastic.StepTimeout`) inside the block: a
    decision right after a step (re-balancing) waits only for the step's skew, so a peer
    stopped there is noticed as soon as in the step itself."""
    if getattr(trainer, "elastic", None) is None or getattr(trainer.rdv, "cpu_group", None) is None:
        yield
        return
    with rendezvous_timeout(trainer, trainer.elastic.timeout.seconds):
        yield


@contextlib.contextmanager
def phase_timeout(trainer: Any, phase: str) -> Iterator[None]:
    """Inside the block the collectives of ``phase`` (``"validation"``, ``"checkpoint"``) time
    out after :meth:`PhaseTimeouts.seconds` (nothing changes without in-job recovery); the
    block's duration is recorded when it completes (not when it fails: a failed phase is
    redone after the recovery, and its time says nothing about the phase)."""
    elastic = getattr(trainer, "elastic", None)
    group = getattr(trainer.rdv, "cpu_group", None)
    if elastic is None or group is None:
        yield
        return
    timeouts: PhaseTimeouts = elastic.phase_timeouts
    seconds = timeouts.seconds(phase, elastic.timeout.seconds)
    _set(seconds)  # the default group
    start = time.monotonic()
    try:
        with rendezvous_timeout(trainer, seconds):
            yield
        timeouts.record(phase, time.monotonic() - start)
    finally:
        with contextlib.suppress(Exception):
            elastic.timeout.apply()  # the step's timeout on the default group again


__all__ = [
    "FACTOR",
    "WINDOW",
    "PhaseTimeouts",
    "first_validation_wait",
    "peer_cost_ratio",
    "phase_timeout",
    "rendezvous_timeout",
    "step_timeout",
]
