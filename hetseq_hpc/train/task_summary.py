"""The worker's task-specific steps: build and check the model, and what the run records.

:func:`build_checked_model` builds the model with the run's seed and refuses BatchNorm before
any training (:mod:`hetseq_hpc.tasks.norms`); it also measures the training FLOPs per sample
(:mod:`hetseq_hpc.tasks.flops`) while the model is still bare (before DDP wraps it).
:func:`finish_task_summary` adds the task's facts to ``summary.json`` and writes the task's
example predictions to rank 0's log.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.flops import task_flops_per_sample
from hetseq_hpc.tasks.norms import check_no_batchnorm
from hetseq_hpc.train.evaluate import log_examples
from hetseq_hpc.train.parallel import Replicated

log = logging.getLogger(__name__)

#: example predictions written to rank 0's log at the end of a run
N_EXAMPLES = 3


def seeded_model(task: Task, seed: int) -> nn.Module:
    """``torch.manual_seed(seed)``, then ``task.build_model()``: the run's start-up model (on
    the CPU, not placed), the same on every call."""
    torch.manual_seed(seed)
    return task.build_model()


def build_checked_model(
    task: Task,
    run: RunConfig,
    device: torch.device,
    place: Optional[Callable[[nn.Module], nn.Module]] = None,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """``torch.manual_seed(trainer.seed)``; ``task.build_model()``; BatchNorm check; FLOPs.

    ``place`` (the worker's: DDP moves the model to the device, FSDP shards it there) receives
    the checked model on the CPU, after its FLOPs were measured there; None = ``.to(device)``
    and FLOPs measured on the device.

    Returns:
        ``(model placed, info)``; ``info`` = ``{"name", "class", "unit",
        "units_per_sample", "flops_per_sample", "data", "exact", "inexact"}`` for
        ``summary.json``.

    Raises:
        ConfigError: the model has BatchNorm and ``trainer.allow_inexact_batchnorm`` is false
            (one line naming the layer and the fixes).
    """
    model = seeded_model(task, run.trainer.seed)
    inexact = check_no_batchnorm(model, run.trainer.allow_inexact_batchnorm)
    if place is None:
        model = model.to(device)
    flops = task_flops_per_sample(task, model)
    if place is not None:
        model = place(model)
    data = dict(task.data_summary)
    name = task_name(run, task)
    if data:
        log.info("task=%s data: %s", name, data)
    info = {
        "name": name,
        "class": f"{type(task).__module__}.{type(task).__qualname__}",
        "unit": getattr(task, "unit_name", "samples"),
        "units_per_sample": float(task.units_per_sample),
        "flops_per_sample": flops,
        "data": data,
        "exact": inexact is None,
        "inexact": inexact,
    }
    torch.manual_seed(run.trainer.seed)  # the FLOPs pass must not move the seeded RNG
    return model, info


def task_name(run: RunConfig, task: Task) -> str:
    """The task's name for the log and ``summary.json``: a user task's own ``name`` class
    attribute when it sets one (``task=custom``, ``task=dataset``), else ``task.name``."""
    own = getattr(type(task), "name", None)
    if run.task.name in ("custom", "dataset") and isinstance(own, str) and own and own != "task":
        return own
    return run.task.name


def record_inexact(info: Dict[str, Any], record: Dict[str, Any]) -> None:
    """Mark ``info`` (from :func:`build_checked_model`) inexact with ``record`` (``{"exact":
    False, "reason": ..., ...}``); a second record (BatchNorm opt-out and a skipped contract
    check) joins the reasons with ``"; "`` and keeps the other keys of both."""
    info["exact"] = False
    if info.get("inexact") is None:
        info["inexact"] = dict(record)
        return
    merged = {**info["inexact"], **{k: v for k, v in record.items() if k != "reason"}}
    merged["reason"] = f"{info['inexact'].get('reason', '')}; {record.get('reason', '')}"
    info["inexact"] = merged


def examples_model(task: Task, parallel: Replicated, is_master: bool) -> Optional[nn.Module]:
    """The model rank 0 writes the task's example predictions with: the bare model under DDP;
    under FSDP a CPU copy (``task.build_model()``) loaded from the full state gathered to rank
    0's CPU memory (a collective: EVERY rank calls it), so the whole weights never sit on a
    device. None on the other ranks, and under FSDP when the task writes no examples."""
    if not parallel.sharded:
        return parallel.model
    if type(task).examples is Task.examples:  # nothing to write: nothing to gather
        return None
    state = parallel.model_state()
    if not is_master:
        return None
    copy = task.build_model()
    copy.load_state_dict(state)
    return copy


def finish_task_summary(
    summary: Dict[str, Any],
    task: Task,
    model: Optional[nn.Module],
    info: Dict[str, Any],
    is_master: bool,
) -> None:
    """Add ``task`` (name, class, unit, FLOPs per sample, achieved training TFLOP/s, data),
    ``exact`` and ``inexact`` (BatchNorm opt-out, skipped contract check) to ``summary``; on
    rank 0 log the task's example predictions with ``model`` (:func:`examples_model`; None:
    none) and add them as ``examples``."""
    summary["task"] = {k: v for k, v in info.items() if k not in ("exact", "inexact")}
    if summary.get("samples_per_s"):  # model FLOPs actually done, for MFU against a peak
        summary["task"]["train_tflops_per_s"] = (
            summary["samples_per_s"] * info["flops_per_sample"] / 1e12
        )
    summary["exact"] = info["exact"]
    if info["inexact"] is not None:
        summary["inexact"] = info["inexact"]
    if is_master and model is not None:
        header = getattr(task, "example_header", None)
        rows = log_examples(task, model, N_EXAMPLES, header)
        if rows:
            summary["examples"] = [list(r) for r in rows]


__all__ = [
    "N_EXAMPLES",
    "build_checked_model",
    "examples_model",
    "finish_task_summary",
    "record_inexact",
    "seeded_model",
]
