"""What the training loop reports and where it stands: a rank's static facts, one optimizer
step's outcome, and the phases of the work after a step (which in-job recovery redoes from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence

if TYPE_CHECKING:  # torch-free at import: the command line reads rows and records too
    from hetseq_hpc.balance.agree import RankMeta
    from hetseq_hpc.distributed.rendezvous import StepStats


def __getattr__(name: str) -> Any:
    """``RankMeta`` and ``StepStats`` (re-exported) on first use."""
    if name == "RankMeta":
        from hetseq_hpc.balance.agree import RankMeta

        return RankMeta
    if name == "StepStats":
        from hetseq_hpc.distributed.rendezvous import StepStats

        return StepStats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class StepRecord:
    """What one optimizer step produced, as all ranks agree on it (``per_rank`` in rank order;
    ``stop_code`` is the strongest stop request any rank saw)."""

    step: int
    epoch: int
    loss: float
    lr: float
    grad_norm: float
    per_rank: List[StepStats]
    wall_s: float
    stop_code: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)
    grad_path: Dict[str, Any] = field(default_factory=dict)  # loss scale / skip, payload bytes
    ended_s: float = 0.0  # time.perf_counter() when the step ended on this rank


#: step records a :class:`StepHistory` keeps whole (at most twice this many between folds)
KEEP_STEPS = 1024


@dataclass
class FoldedSteps:
    """The part of a run's step records a :class:`StepHistory` no longer holds, as the run's
    summary needs it: how many, their wall time, each rank's samples and compute seconds, the
    first step's loss, and each step's wall time (8 bytes a step, for the steady-state rate's
    median).

    Attributes:
        count: steps folded.
        wall_s: their summed ``wall_s`` (seconds).
        samples: per rank, the samples they computed (rank order).
        compute_s: per rank, their summed ``compute_time_s`` (seconds).
        first_loss: the first folded step's loss (the run's first), or None.
        walls: each folded step's ``wall_s``, in step order.
    """

    count: int = 0
    wall_s: float = 0.0
    samples: List[float] = field(default_factory=list)
    compute_s: List[float] = field(default_factory=list)
    first_loss: Optional[float] = None
    walls: List[float] = field(default_factory=list)

    def add(self, rec: StepRecord) -> None:
        """Fold ``rec`` in (records arrive in step order)."""
        if self.count == 0:
            self.first_loss = rec.loss
        if len(self.samples) < len(rec.per_rank):  # a world that grew: new ranks start at 0
            grow = len(rec.per_rank) - len(self.samples)
            self.samples += [0.0] * grow
            self.compute_s += [0.0] * grow
        for r, stats in enumerate(rec.per_rank):
            self.samples[r] += stats.samples
            self.compute_s[r] += stats.compute_time_s
        self.count += 1
        self.wall_s += rec.wall_s
        self.walls.append(rec.wall_s)


class StepHistory(Sequence[StepRecord]):
    """This run's step records, in step order, in bounded memory: the last
    :data:`KEEP_STEPS` (up to twice that) whole, the earlier ones folded into
    :attr:`folded` (what :func:`~hetseq_hpc.train.metrics.rows.run_summary` needs of them). A
    record is ~9 floats per rank: unbounded, a 64-rank run held ~3 GB of them after 100,000
    steps. Indexing, iteration and ``len`` see the records held; every consumer but the
    summary looks at the last few (a recovery, timeouts, the measured step sync).

    Args:
        keep: records kept whole after a fold.
    """

    def __init__(self, keep: int = KEEP_STEPS):
        self.keep = int(keep)
        self._held: List[StepRecord] = []
        self.folded = FoldedSteps()

    def append(self, rec: StepRecord) -> None:
        """Add the next step's record; past ``2 * keep`` records the oldest are folded."""
        self._held.append(rec)
        if len(self._held) > 2 * self.keep:
            old, self._held = self._held[: -self.keep], self._held[-self.keep :]
            for done in old:
                self.folded.add(done)

    def pop(self) -> StepRecord:
        """Remove and return the last record (a step undone)."""
        return self._held.pop()

    def truncate(self, step: int) -> None:
        """Drop the held records after ``step`` (an in-job reload of the checkpoint of
        ``step``: those steps are redone). Folded steps stay counted: a reload further back
        than :attr:`keep` steps counts the redone steps twice in the summary's sums."""
        self._held = [r for r in self._held if r.step <= step]

    def __getitem__(self, index):
        return self._held[index]

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._held)


#: phases of ``trainer.step`` completed (in order); DONE: nothing left, the next step may start
TRAINED, REBALANCED, EVALUATED, LOGGED, DONE = range(5)
#: each phase's name, for log lines
PHASE_NAMES = ("trained", "rebalanced", "evaluated", "logged", "done")
#: what is redone first from each phase (a recovery's ``redo``)
REDO = ("re-balancing decision", "validation", "row", "checkpoint", "step")


__all__ = [
    "DONE",
    "EVALUATED",
    "KEEP_STEPS",
    "LOGGED",
    "PHASE_NAMES",
    "REBALANCED",
    "REDO",
    "TRAINED",
    "FoldedSteps",
    "RankMeta",
    "StepHistory",
    "StepRecord",
]
