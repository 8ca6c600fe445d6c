"""What the training loop reports: a rank's static facts and one optimizer step's outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hetseq_hpc.distributed.rendezvous import StepStats


@dataclass
class RankMeta:
    """Static facts about a rank, reported in metrics.jsonl and allocation.json."""

    rank: int
    device: str
    node: str
    het_group: Optional[int] = None
    partition: Optional[str] = None
    gres: Optional[str] = None
    precision: Optional[str] = None  # what the rank computes in (fp32, bf16, fp16)


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


__all__ = ["RankMeta", "StepRecord"]
