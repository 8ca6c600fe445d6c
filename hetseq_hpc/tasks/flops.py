"""Training FLOPs per sample for any task: the task's own formula, else a measurement.

The measurement runs one forward and backward pass of ``n`` training samples under
``torch.utils.flop_counter.FlopCounterMode`` (PyTorch's operator-level counter: matmuls,
convolutions, attention; element-wise operations count 0, as in the usual ``6 N`` estimates of
Kaplan et al., 2020) and divides by ``n``. Gradients are cleared afterwards.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from hetseq_hpc.tasks.contract import check_loss, checked_batch

log = logging.getLogger(__name__)


def measure_flops_per_sample(task: Any, model: nn.Module, n: int = 2) -> float:
    """Forward + backward FLOPs of one training sample, counted on ``min(n, num_train)``
    samples (positions ``0..n-1``, epoch 0) on the model's device.

    Raises:
        TaskContractError: the batch or the loss breaks the task contract.
    """
    from torch.utils.flop_counter import FlopCounterMode

    n = max(1, min(int(n), int(task.num_train)))
    positions = list(range(n))
    batch = checked_batch(task, positions, 0, "train")
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    was_training = model.training
    model.train()
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            loss = check_loss(task, model(**batch))
            loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return float(counter.get_total_flops()) / n


def task_flops_per_sample(task: Any, model: nn.Module) -> float:
    """``task.flops_per_sample(model)`` when the task gives a formula (not ``None``), else
    :func:`measure_flops_per_sample` (logged once)."""
    formula = getattr(task, "flops_per_sample", None)
    value = formula(model) if callable(formula) else None
    if value is not None:
        return float(value)
    measured = measure_flops_per_sample(task, model)
    log.info("FLOPs per training sample measured with FlopCounterMode: %.4g", measured)
    return measured


__all__ = ["measure_flops_per_sample", "task_flops_per_sample"]
