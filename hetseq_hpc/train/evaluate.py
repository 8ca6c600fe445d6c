"""Validation for any task: sharded over the ranks, additive statistics, task-defined metrics.

Rank ``r`` of ``W`` evaluates validation positions ``r, r + W, r + 2W, ...`` in batches of its
micro-batch size; :meth:`~hetseq_hpc.tasks.Task.evaluate_batch` returns additive statistics
(loss sums, correct counts, BLEU n-gram counts); every rank's sums are gathered and added in
rank order, and :meth:`~hetseq_hpc.tasks.Task.finalize_metrics` turns them into metrics
(``val_loss``, ``val_accuracy``, ``val_bleu`` ...). The result is the same for any world size
up to float summation order, and identical on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.contract import checked_batch

log = logging.getLogger(__name__)


def _add(total: Dict[str, float], part: Dict[str, float]) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + float(value)


@torch.no_grad()
def evaluate_task(
    task: Task,
    model: nn.Module,
    rdv: Gang,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    same_passes: bool = False,
    before_gather: Optional[Callable[[float], Any]] = None,
) -> Dict[str, float]:
    """The task's validation metrics on its whole validation split (every rank calls this).

    Args:
        task: the task (``num_val``, ``make_batch``, ``evaluate_batch``, ``finalize_metrics``).
        model: the BARE model (not the DDP wrapper: no collective runs inside).
        rdv: the rendezvous (``world``, ``all_gather_objects``).
        batch_size: samples per validation batch on this rank (its micro-batch).
        device: where the model is.
        autocast: the mixed-precision context of training.
        same_passes: every rank runs the same number of batches (a sharded FSDP model gathers
            each unit in every forward, a collective): the ranks agree on the largest count and
            a rank with fewer batches runs its first one again, its statistics discarded.
        before_gather: called with this rank's pass time (seconds) right before the gather
            of the sums, the one collective of a validation without ``same_passes`` (the
            first validation's timeout is set there: :mod:`hetseq_hpc.train.recovery.timeouts`).

    Returns:
        ``finalize_metrics`` of the summed statistics; ``{}`` when there is no validation split.
    """
    if int(task.num_val) <= 0:
        return {}
    was_training = model.training
    model.eval()
    world = rdv.world
    positions = np.arange(world.rank, int(task.num_val), world.world_size)
    size = max(1, int(batch_size))
    sums: Dict[str, float] = {}
    starts: List[Optional[int]] = list(range(0, positions.size, size))
    if same_passes:
        passes = max(rdv.all_gather_objects(len(starts)))
        starts += [None] * (passes - len(starts))  # repeats of a batch, not counted
    began = time.monotonic()
    try:
        for start in starts:
            chunk = (
                positions[start : start + size]
                if start is not None
                else positions[:size]
                if positions.size
                else np.arange(1)
            ).tolist()
            batch = checked_batch(task, chunk, 0, "val")
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast():
                part = task.evaluate_batch(model, batch, chunk)
            if start is not None:
                _add(sums, part)
    finally:
        model.train(was_training)
    if before_gather is not None and not same_passes:
        before_gather(time.monotonic() - began)
    gathered: List[Dict[str, float]] = rdv.all_gather_objects(sums)
    total: Dict[str, float] = {}
    for part in gathered:
        _add(total, part)
    return {k: float(v) for k, v in task.finalize_metrics(total).items()}


def log_examples(
    task: Task, model: nn.Module, n: int = 3, header: Optional[str] = None
) -> List[Any]:
    """Write ``task.examples(model, n)`` (e.g. source | reference | translation) to the log,
    after ``header`` if given; returns them. A task without examples logs nothing."""
    examples = getattr(task, "examples", None)
    if not callable(examples):
        return []
    model.eval()
    with torch.no_grad():
        rows = list(examples(model, n))
    if rows and header:
        log.info("examples: %s", header)
    for i, row in enumerate(rows, 1):
        log.info("example %d: %s", i, " | ".join(str(x) for x in row))
    return rows


__all__ = ["evaluate_task", "log_examples"]
