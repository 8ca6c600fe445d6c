"""What in-job recovery reads and changes of one rank's training: :class:`TrainState`, which
the :class:`~hetseq_hpc.train.trainer.Trainer` implements. Recovery decides (who is left, which
step and phase, which split); the state changes itself (a new DDP, a re-sharded model)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from torch import nn

from hetseq_hpc.balance.agree import RankReport
from hetseq_hpc.balance.allocation import Allocation
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from hetseq_hpc.train.records import RankMeta, StepHistory


class TrainState(Protocol):
    """One rank's training as in-job recovery sees it (:mod:`hetseq_hpc.train.recovery.elastic`).

    Attributes:
        step: the last completed optimizer step.
        phase: what of the work after ``step`` is done (:data:`~hetseq_hpc.train.records.DONE`
            and the other phases of :mod:`hetseq_hpc.train.records`).
        history: the record of every completed step, in order.
        last_row: the ``metrics.jsonl`` row of ``step``.
        metas_by_member: every rank's facts, by original rank (its member id, for ever).
        checkpoints: the run directory's checkpoints.
    """

    step: int
    phase: int
    history: StepHistory
    last_row: Dict[str, Any]
    metas_by_member: List[RankMeta]
    checkpoints: CheckpointManager

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (FSDP: a lost rank takes its shard with it)."""
        ...

    def any_compiles(self) -> bool:
        """Whether ``trainer.compile`` compiles on any rank (a split's first step may compile)."""
        ...

    def state_dict(self, tensors: bool = True) -> Dict[str, Any]:
        """Everything a checkpoint holds, as plain data (the model and optimizer state
        unless ``tensors`` is false)."""
        ...

    def load_state_dict(self, state: Dict[str, Any], source: str = "state") -> None:
        """Continue after ``state["step"]``; ``source`` names it in errors."""
        ...

    def drop_groups(self) -> None:
        """Drop the references to the broken process groups (DDP's wrapper, the gloo group)."""
        ...

    def rejoin(self, rdv: Gang, metas: List[RankMeta], allocation: Allocation) -> None:
        """Go on in a re-formed world with the same model (DDP: a new wrapper on the new
        group)."""
        ...

    def reload(
        self,
        rdv: Gang,
        metas: List[RankMeta],
        allocation: Allocation,
        rebuild: Callable[[], nn.Module],
        reports: Sequence[RankReport],
        state: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        """Go on in a re-formed world from the last checkpoint (or from ``state``, a survivor's
        whole training state sent with a join), in ``rebuild()``, a fresh seeded model (FSDP:
        the lost shard is gone, or the world grew); returns the membership event's fields."""
        ...

    def log_before_stop(self, event: Dict[str, Any]) -> None:
        """Rank 0 of survivors that stop: the row of ``step`` if missing, then ``event``."""
        ...


__all__ = ["TrainState"]
