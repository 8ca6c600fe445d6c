"""Collective timeouts under in-job recovery: of a training step (:class:`StepTimeout`,
``max(trainer.elastic.timeout_s, 3 x the step time)``) and of the phases after it: the
re-balancing decision (:func:`step_timeout`: the step's own timeout), validation and the
checkpoint (:func:`phase_timeout`), and the first validation's estimated wait
(:func:`first_validation_wait`).

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
from typing import Deque, Dict, Iterator, Optional, Sequence

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from hetseq_hpc.balance.allocation import Allocation
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.train.records import StepRecord

log = logging.getLogger(__name__)


class StepTimeout:
    """The collective timeout of a training step (the default group: DDP's gradient
    all-reduce), ``max(floor_s, factor × T)``: ``T`` is the longest of the last ``window``
    measured step times and the predicted one (twice the prediction before any step is
    measured: a first step warms up). A longer wait than that is a stuck peer; a shorter
    timeout would take an uneven but healthy step (accumulation, a slow device, a big model)
    for a lost rank.

    Args:
        floor_s: the least timeout (``trainer.elastic.timeout_s``).
        factor: the multiple of the step time (3).
        window: how many measured steps count.
    """

    def __init__(self, floor_s: float, factor: float = 3.0, window: int = 20):
        self.floor_s, self.factor = float(floor_s), float(factor)
        self.predicted_s = 0.0
        self.recent: Deque[float] = deque(maxlen=window)
        self.applied: Optional[float] = None
        self.allowance_s = 0.0  # the next step's extra time (a compile), see allow()

    @property
    def seconds(self) -> float:
        """The timeout now, seconds."""
        longest = max(self.recent) if self.recent else 2.0 * self.predicted_s
        return max(self.floor_s, self.factor * max(longest, self.predicted_s)) + self.allowance_s

    def allow(self, seconds: float) -> bool:
        """Give the next step ``seconds`` more (it may compile graphs); its measured time is
        then not recorded. True when the timeout should be applied again."""
        self.allowance_s = max(0.0, float(seconds))
        return self.stale()

    def predict(self, seconds: float) -> bool:
        """Set the predicted step time (of a new split); True when the timeout should be
        applied again (it moved by more than 10 %)."""
        self.predicted_s = max(0.0, float(seconds))
        return self.stale()

    def observe(self, seconds: float) -> bool:
        """Record a measured step time (not that of a step given an allowance: it compiled);
        True when the timeout should be applied again."""
        if self.allowance_s:
            self.allowance_s = 0.0
        else:
            self.recent.append(max(0.0, float(seconds)))
        return self.stale()

    def rescale(self, ratio: float) -> None:
        """Scale the measured times by ``ratio`` (old over new world size: each survivor
        now computes a larger share of the same global batch)."""
        self.recent = deque((x * ratio for x in self.recent), maxlen=self.recent.maxlen)

    def stale(self) -> bool:
        """Whether the timeout applied differs from :attr:`seconds` by more than 10 %."""
        return self.applied is None or abs(self.seconds - self.applied) > 0.1 * self.applied

    def apply(self) -> float:
        """Set :attr:`seconds` as the default process group's timeout (if one exists);
        returns it."""
        seconds = self.seconds
        if dist.is_available() and dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
            log.debug("training-step collective timeout now %.1f s", seconds)
        self.applied = seconds
        return seconds


def predicted_step_s(allocation: Allocation) -> float:
    """The step time an allocation predicts: its slowest rank's samples over its measured
    samples/s (0 when the split was not computed from measured speeds: forced, or equal)."""
    rates = list(getattr(allocation, "throughputs", ()) or ())
    if (
        allocation.source not in ("cost_curve", "throughput", "rebalanced")
        or len(rates) != len(allocation.shares)
        or min(rates, default=0.0) <= 0
    ):
        return 0.0
    return max(s.samples / r for s, r in zip(allocation.shares, rates))


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


def peer_cost_ratio(history: Sequence[StepRecord], rank: int, world_size: int) -> Optional[float]:
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


def first_validation_wait(
    timeouts: PhaseTimeouts,
    step_timeout_s: float,
    group: Optional[dist.ProcessGroup],
    history: Sequence[StepRecord],
    rank: int,
    world_size: int,
    local_s: float,
) -> Optional[float]:
    """Called by a rank that finished its share of a validation pass in ``local_s`` seconds,
    right before the gather of the sums over ``group`` (the rendezvous's gloo group): the
    first validation (nothing measured yet) of an in-job-recovery run waits
    ``max(step_timeout_s, FACTOR x local_s x peer_cost_ratio)`` there instead of
    ``cluster.collective_timeout_s`` (see the module docstring). Returns the timeout set, or
    None when nothing changed (no group, a validation measured before, a timeout that lost
    nobody before (:meth:`PhaseTimeouts.forget`), no step of this world to estimate from, or
    an estimate not shorter)."""
    if group is None or not timeouts.estimate_first or timeouts.durations.get("validation"):
        return None
    ratio = peer_cost_ratio(history, rank, world_size)
    if ratio is None:
        return None
    seconds = max(float(step_timeout_s), FACTOR * max(0.0, local_s) * ratio)
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


def _set(seconds: float, group: Optional[dist.ProcessGroup] = None) -> None:
    with contextlib.suppress(Exception):  # a broken group: the recovery replaces it
        _set_pg_timeout(timedelta(seconds=seconds), group)


@contextlib.contextmanager
def rendezvous_timeout(rdv: Gang, seconds: float, after_s: float) -> Iterator[None]:
    """Inside the block the rendezvous group's collectives (``rdv.cpu_group``) time out after
    ``seconds``, then after ``after_s`` (``cluster.collective_timeout_s``) again (unless a
    recovery dropped the group meanwhile)."""
    _set(seconds, rdv.cpu_group)
    try:
        yield
    finally:
        after = rdv.cpu_group  # None: dropped by a recovery
        if after is not None:
            _set(after_s, after)


@contextlib.contextmanager
def step_timeout(step: StepTimeout, rdv: Gang, after_s: float) -> Iterator[None]:
    """The rendezvous group's collectives wait at most the training step's timeout
    (:class:`StepTimeout`) inside the block: a decision right after a step (re-balancing)
    waits only for the step's skew, so a peer stopped there is noticed as soon as in the step
    itself. Nothing changes without a group."""
    if rdv.cpu_group is None:
        yield
        return
    with rendezvous_timeout(rdv, step.seconds, after_s):
        yield


@contextlib.contextmanager
def phase_timeout(
    timeouts: PhaseTimeouts, step: StepTimeout, rdv: Gang, phase: str, after_s: float
) -> Iterator[None]:
    """Inside the block the collectives of ``phase`` (``"validation"``, ``"checkpoint"``) time
    out after :meth:`PhaseTimeouts.seconds` (nothing changes without a group); the block's
    duration is recorded when it completes (not when it fails: a failed phase is redone after
    the recovery, and its time says nothing about the phase)."""
    group = rdv.cpu_group
    if group is None:
        yield
        return
    seconds = timeouts.seconds(phase, step.seconds)
    _set(seconds)  # the default group
    start = time.monotonic()
    try:
        with rendezvous_timeout(rdv, seconds, after_s):
            yield
        timeouts.record(phase, time.monotonic() - start)
    finally:
        with contextlib.suppress(Exception):
            step.apply()  # the step's timeout on the default group again


__all__ = [
    "FACTOR",
    "WINDOW",
    "PhaseTimeouts",
    "StepTimeout",
    "first_validation_wait",
    "peer_cost_ratio",
    "phase_timeout",
    "predicted_step_s",
    "rendezvous_timeout",
    "step_timeout",
]
