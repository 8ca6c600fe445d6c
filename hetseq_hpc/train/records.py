"""What the training loop reports and where it stands: a rank's static facts, one optimizer
step's outcome, and the phases of the work after a step (which in-job recovery redoes from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from hetseq_hpc.balance.agree import RankMeta
from hetseq_hpc.distributed.rendezvous import StepStats


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


#: phases of ``trainer.step`` completed (in order); DONE: nothing left, the next step may start
TRAINED, REBALANCED, EVALUATED, LOGGED, DONE = range(5)
#: each phase's name, for log lines
PHASE_NAMES = ("trained", "rebalanced", "evaluated", "logged", "done")
#: what is redone first from each phase (a recovery's ``redo``)
REDO = ("re-balancing decision", "validation", "row", "checkpoint", "step")


__all__ = [
    "DONE",
    "EVALUATED",
    "LOGGED",
    "PHASE_NAMES",
    "REBALANCED",
    "REDO",
    "TRAINED",
    "RankMeta",
    "StepRecord",
]
