"""What the planner asks of every task (:meth:`hetseq_hpc.tasks.Task.planning_model`): its model
and a batch maker, whose parameters, FLOPs and activations :mod:`hetseq_hpc.plan.model_info`
measures. The default, :func:`from_data`, prepares and loads the data as a run would; BERT builds
its model from its config alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from hetseq_hpc.tasks.contract import checked_batch


@dataclass(frozen=True)
class EncoderShape:
    """A transformer encoder's shape, named as the plan prints it, whose memory traffic the
    planner counts (:func:`hetseq_hpc.plan.perf_model.transformer_accesses`); ``fused_attention``:
    one kernel on a GPU (``scaled_dot_product_attention``) that never writes the scores."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    intermediate: int
    fused_attention: bool


@dataclass
class PlanningModel:
    """A task's model as the planner measures it: ``model`` (may be on the ``meta`` device when
    nothing runs), ``make_batch`` (``n ->`` a training batch of up to ``n`` samples), the
    ``vocab_size`` and ``notes`` the plan prints, and the ``encoder`` shape to count memory
    traffic from (else it comes from the measured activations)."""

    model: nn.Module
    make_batch: Callable[[int], Dict[str, torch.Tensor]]
    vocab_size: int = 0
    notes: List[str] = field(default_factory=list)
    encoder: Optional[EncoderShape] = None


def from_data(task: Any) -> PlanningModel:
    """The default of :meth:`Task.planning_model`: ``prepare()``, ``load()``, the model built
    under ``torch.manual_seed(0)``, and checked training batches of positions ``0 .. n-1``.

    Raises:
        ConfigError / DataError: the task's data cannot be found or read.
        TaskContractError: a batch breaks the task contract.
    """
    task.prepare()
    task.load()
    torch.manual_seed(0)
    model = task.build_model()

    def make(n: int) -> Dict[str, torch.Tensor]:
        return checked_batch(task, list(range(min(n, task.num_train))), 0, "train")

    data = task.data_summary
    notes = [f"task={task.name}: model built from {data.get('source', 'its data')}"]
    return PlanningModel(model, make, int(data.get("vocab_size", 0) or 0), notes)


__all__ = ["EncoderShape", "PlanningModel", "from_data"]
