"""Checks of the task contract, made where the trainer uses a task (cheap: shapes and types).

Each violation is one line naming the task, the bad value and the fix; a task that breaks the
contract would otherwise train silently wrong (a mean instead of a sum makes uneven batches
inexact) or fail deep inside DDP.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Union

import numpy as np
import torch

from hetseq_hpc.errors import TaskContractError


def task_label(task: Any) -> str:
    """``"task <module>.<Class>"``: how every contract error names the task."""
    return f"task {type(task).__module__}.{type(task).__qualname__}"


_who = task_label


def loss_label(task: Any) -> str:
    """How contract errors name what computes the loss: the task's own ``loss_label`` (a str
    attribute or property; ``task=dataset`` names the user's ``loss_fn`` or model), else
    ``"the model of <task>: forward(**batch)"``."""
    own = getattr(task, "loss_label", None)
    if isinstance(own, str) and own:
        return own
    return f"the model of {task_label(task)}: forward(**batch)"


def checked_batch(
    task: Any, positions: Union[Sequence[int], np.ndarray], epoch: int, split: str
) -> Dict[str, torch.Tensor]:
    """``task.make_batch(positions, epoch, split)``, checked.

    Raises:
        TaskContractError: the batch is not a dict of tensors, or a tensor's first dimension
            is not ``len(positions)``.
    """
    batch = task.make_batch(positions, epoch, split)
    if not isinstance(batch, dict) or not batch:
        raise TaskContractError(
            f"{_who(task)}.make_batch returned {type(batch).__name__}, not a non-empty dict of "
            "tensors: return {'input_name': tensor, ...} (passed as model(**batch))"
        )
    n = len(positions)
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TaskContractError(
                f"{_who(task)}.make_batch gave {key!r} as {type(value).__name__}, not a tensor: "
                "return only tensors (keep other data on the task)"
            )
        if value.dim() == 0 or value.shape[0] != n:
            raise TaskContractError(
                f"{_who(task)}.make_batch gave {key!r} of shape {tuple(value.shape)} for {n} "
                f"positions of split {split!r}: the first dimension of every tensor must be "
                "len(positions), one row per position, in order"
            )
    return batch


def checked_count(task: Any, batch: Dict[str, torch.Tensor]) -> int:
    """``task.count(batch)``, checked.

    Raises:
        TaskContractError: the count is not a non-negative integer, or is 0 for a non-empty
            batch (the global normaliser must be > 0).
    """
    value = task.count(batch)
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    rows = next(iter(batch.values())).shape[0]
    if count < 0 or count != value:
        raise TaskContractError(
            f"{_who(task)}.count returned {value!r}: return the number of loss units in the "
            "batch as a non-negative int (e.g. int((labels != -100).sum()))"
        )
    if count == 0 and rows > 0:
        raise TaskContractError(
            f"{_who(task)}.count returned 0 for a batch of {rows} samples: every sample must "
            "hold at least one loss unit (the loss is divided by the global unit count)"
        )
    return count


def check_loss(task: Any, loss: Any) -> torch.Tensor:
    """Return ``loss`` if it is a 0-dim floating tensor.

    Raises:
        TaskContractError: it is not a tensor, has dimensions, or is not floating point.
    """
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss
    what = (
        f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
        if isinstance(loss, torch.Tensor)
        else f"a {type(loss).__name__}"
    )
    own = getattr(task, "loss_label", None)
    head = (
        f"{own} returned {what}"
        if isinstance(own, str) and own
        else f"the model of {task_label(task)} returned {what} from forward(**batch)"
    )
    raise TaskContractError(
        f"{head}: return the SUM of the batch's unit losses as a 0-dim floating tensor, e.g. "
        "F.cross_entropy(logits, labels, reduction='sum')"
    )


__all__ = ["check_loss", "checked_batch", "checked_count", "loss_label", "task_label"]
