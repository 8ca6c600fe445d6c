"""What the planner asks of every task: its model and a batch maker, without a run.

:meth:`hetseq_hpc.tasks.Task.planning_model` returns a :class:`PlanningModel`; the planner
(:mod:`hetseq_hpc.plan.model_info`) reads the model's parameters, FLOPs and activation memory
from it and times the batch maker. The default, :func:`from_data`, prepares and loads the task's
data as a run would (a model whose shape depends on its data: classes, vocabulary) and builds
real training batches; a task that knows its model from its config alone (BERT) builds it
without data, on the ``meta`` device when nothing is measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from hetseq_hpc.tasks.contract import checked_batch


@dataclass(frozen=True)
class EncoderShape:
    """A transformer encoder's shape, from which the planner counts its memory traffic
    (:func:`hetseq_hpc.plan.perf_model.transformer_accesses`).

    Attributes:
        name: the model's name in the plan (``"BERT"``).
        layers / hidden / heads / intermediate: the encoder's shape.
        seq_len: tokens per sample.
        fused_attention: the attention is one fused kernel on a GPU
            (``scaled_dot_product_attention``), which never writes its scores.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    intermediate: int
    fused_attention: bool


@dataclass
class PlanningModel:
    """A task's model as the planner measures it.

    Attributes:
        model: the task's model (its ``forward(**batch)`` the summed loss); on the ``meta``
            device when the planner measures nothing but its size.
        make_batch: ``n -> `` a training batch of ``n`` samples (fewer when the data holds
            fewer), as :meth:`Task.make_batch` returns it.
        vocab_size: the vocabulary the plan prints (0: none).
        notes: lines the plan prints about where the model came from.
        encoder: its transformer encoder's shape, when memory traffic should be counted from it
            rather than from the measured activations.
    """

    model: nn.Module
    make_batch: Callable[[int], Dict[str, torch.Tensor]]
    vocab_size: int = 0
    notes: List[str] = field(default_factory=list)
    encoder: Optional[EncoderShape] = None


def from_data(task: Any) -> PlanningModel:
    """The default of :meth:`Task.planning_model`: ``task.prepare()`` (its cache, as a run would
    build it), ``task.load()``, the model built under ``torch.manual_seed(0)``, and training
    batches of positions ``0 .. n-1`` of epoch 0, checked against the task contract.

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
