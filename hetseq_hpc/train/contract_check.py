"""The task contract, checked on real data before step 1, on every rank.

:func:`check_task_contract` builds the first positions of the sampler's first global batch
whole and as two halves and checks (a) ``make_batch`` rows, (b) ``count`` additivity, (c) the
loss as a SUM, (d) the same batch on every rank; all ranks stop together with the same line,
and the check changes nothing the training uses. What each check compares and why:
docs/design/exact-gradients.md, "The task contract, checked before step 1".
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.errors import TaskContractError
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.contract import check_loss, checked_batch, checked_count, loss_label
from hetseq_hpc.tasks.contract import task_label as _who
from hetseq_hpc.train.sampler import GlobalBatchSampler
from hetseq_hpc.train.task_summary import record_inexact

log = logging.getLogger(__name__)

#: positions checked (the first ones of the sampler's first global batch); at least 2
N_POSITIONS = 8
#: relative tolerance of the loss additivity check (fp32; only the summation order differs)
REL_TOL = 1e-4
#: absolute tolerance of the loss additivity check
ABS_TOL = 1e-5
#: relative tolerance of floating batch tensors (rows and the cross-rank digest)
DATA_TOL = 1e-5
#: the option that skips the check (recorded as inexact in summary.json)
OPT_OUT = "trainer.skip_contract_check=true"


def contract_positions(num_train: int, seed: int, n: int = N_POSITIONS) -> List[int]:
    """The first ``min(n, num_train)`` positions of epoch 0's order: the start of the sampler's
    first global batch (:class:`~hetseq_hpc.train.sampler.GlobalBatchSampler`; beyond it when
    the global batch is smaller than ``n``)."""
    size = max(1, min(n, int(num_train)))
    return [int(p) for p in GlobalBatchSampler(int(num_train), size, seed).global_batch(0)[1]]


def skipped_record() -> Dict[str, Any]:
    """The ``summary.json`` record of a run with ``trainer.skip_contract_check=true``."""
    return {
        "exact": False,
        "contract_check": "skipped",
        "reason": f"{OPT_OUT}: the task contract (sum loss, additive count, row-wise "
        "make_batch) was not checked",
    }


def check_before_training(
    task: Task,
    model: torch.nn.Module,
    run: RunConfig,
    device: torch.device,
    rdv: Gang,
    info: Dict[str, Any],
) -> None:
    """The worker's call after the model is built: :func:`check_task_contract`, or with
    ``trainer.skip_contract_check`` a warning and ``exact: false`` plus the reason in ``info``
    (for ``summary.json``, :func:`hetseq_hpc.train.task_summary.record_inexact`).

    Raises:
        TaskContractError: as :func:`check_task_contract`.
    """
    if getattr(run.trainer, "skip_contract_check", False):
        record = skipped_record()
        log.warning(
            "%s: training is NOT known to be exact across allocations: %s",
            OPT_OUT.split("=")[0],
            record["reason"],
        )
        record_inexact(info, record)
        return
    check_task_contract(task, model, device, rdv, run.trainer.seed)


def check_task_contract(
    task: Task,
    model: torch.nn.Module,
    device: torch.device,
    rdv: Gang,
    seed: int,
    positions: Optional[Sequence[int]] = None,
) -> None:
    """Check checks (a)-(d) of this module on ``positions`` (default
    :func:`contract_positions`). Call it on every rank at the same point (it all-gathers once
    over ``rdv``, a :class:`~hetseq_hpc.distributed.rendezvous.Rendezvous`).

    Args:
        task: the loaded task.
        model: the built model, already on ``device`` (not yet wrapped in DDP).
        device: where the model is.
        rdv: the rendezvous.
        seed: ``trainer.seed``.
        positions: training positions to check (at least 2); fewer than 2 training samples
            skip the check.

    Raises:
        TaskContractError: one line naming the member that breaks the contract
            (``make_batch``, ``count`` or what computes the loss:
            :func:`~hetseq_hpc.tasks.contract.loss_label`), the rank that saw it first when
            not every rank did, and the fix. Raised on every rank.
    """
    positions = list(contract_positions(task.num_train, seed) if positions is None else positions)
    if len(positions) < 2:
        log.warning(
            "task contract not checked: %d training sample(s), 2 are needed", len(positions)
        )
        return
    rank = rdv.world.rank
    with _isolated(model, device):
        error, digest = _check_local(task, model, device, positions, seed, rank)
    verdicts = rdv.all_gather_objects((error, digest))
    found = [r for r, (err, _) in enumerate(verdicts) if err]
    if found:  # the same line on every rank; which rank saw it only when not all did
        where = f" (found on rank {found[0]})" if len(found) < len(verdicts) else ""
        raise TaskContractError(f"{verdicts[found[0]][0]}{where}")
    for r, (_, other) in enumerate(verdicts[1:], start=1):
        key = _digest_difference(verdicts[0][1], other)
        if key is not None:
            raise TaskContractError(
                f"{_who(task)}.make_batch depends on the rank: rank {r}'s batch of training "
                f"positions {positions} differs from rank 0's in {key!r}: build row i from "
                "positions[i], epoch, split and the task seed only, never from the rank or "
                "torch's/numpy's global RNG (the trainer reseeds torch per step and rank)"
            )
    if rank == 0:
        log.info(
            "task contract checked on %d training positions: row-wise make_batch, "
            "additive count, SUM loss%s",
            len(positions),
            ", same batch on every rank" if len(verdicts) > 1 else "",
        )


def _check_local(task, model, device, positions, seed, rank) -> Tuple[Optional[str], Any]:
    """``(error line or None, digest of the full batch or None)`` on this rank."""
    cut = len(positions) // 2
    try:
        batches = []
        for salt, part in enumerate((positions, positions[:cut], positions[cut:])):
            _seed_globals(seed, rank, salt)
            batches.append(checked_batch(task, part, 0, "train"))
        full, head, tail = batches
        digest = _digest(full)
        error = _rows_error(task, full, head, tail, positions, cut)
        if error is None:
            error = _count_error(task, full, head, tail)
        if error is None:
            error = _loss_error(task, model, device, full, head, tail)
    except TaskContractError as exc:
        return str(exc), None
    return error, digest


def _rows_error(task, full, head, tail, positions, cut) -> Optional[str]:
    """(a): the halves are the matching rows of the full batch."""
    fix = (
        "build row i from positions[i], epoch, split and the task seed only (no batch-level "
        "state, no draws from torch's/numpy's/random's global RNG)"
    )
    for name, half, rows in (("first", head, slice(0, cut)), ("second", tail, slice(cut, None))):
        if set(half) != set(full):
            return (
                f"{_who(task)}.make_batch returned keys {sorted(full)} for "
                f"{len(positions)} positions but {sorted(half)} for the {name} half of them: "
                "return the same keys for every batch"
            )
        for key, value in full.items():
            part = half[key]
            if part.dtype != value.dtype or part.dim() != value.dim():
                return (
                    f"{_who(task)}.make_batch gave {key!r} as {value.dtype} with "
                    f"{value.dim()} dims for {len(positions)} positions but {part.dtype} "
                    f"with {part.dim()} dims for the {name} half: keep dtype and shape fixed"
                )
            common = tuple(slice(0, min(a, b)) for a, b in zip(value.shape[1:], part.shape[1:]))
            whole_rows, half_rows = (rows, *common), (slice(None), *common)
            if not _same(value[whole_rows], part[half_rows]):
                return (
                    f"{_who(task)}.make_batch is not row-wise: {key!r} of the {name} half of "
                    f"training positions {positions} differs from the matching rows of the "
                    f"batch of all of them: {fix}"
                )
    return None


def _count_error(task, full, head, tail) -> Optional[str]:
    """(b): the count is additive over the halves."""
    total, a, b = (checked_count(task, x) for x in (full, head, tail))
    if total == a + b:
        return None
    rows = next(iter(full.values())).shape[0]
    return (
        f"{_who(task)}.count is not additive: {total} for a batch of {rows} samples but "
        f"{a} + {b} = {a + b} for its two halves: return the number of loss units in the "
        "batch, e.g. int((labels != -100).sum()) or the number of rows, never a constant "
        "per batch"
    )


def _loss_error(task, model, device, full, head, tail) -> Optional[str]:
    """(c): the model's loss is a SUM over the batch's units."""
    losses, tol = [], REL_TOL
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for batch in (full, head, tail):
            moved = {k: v.to(device) for k, v in batch.items()}
            loss = check_loss(task, model(**moved))
            tol = max(tol, 4 * torch.finfo(loss.dtype).eps)  # a model kept in bf16/fp16
            losses.append(float(loss.double()))
    total, a, b = losses
    if not all(np.isfinite(losses)):
        log.warning(
            "task contract: the first batch's loss is not finite (%s); the loss check is skipped",
            losses,
        )
        return None
    if abs(total - (a + b)) <= tol * max(abs(total), abs(a) + abs(b)) + ABS_TOL:
        return None
    rows = next(iter(full.values())).shape[0]
    mean = abs(2 * total - (a + b)) <= 0.05 * max(abs(a) + abs(b), ABS_TOL)
    what = (
        "it looks like a MEAN (PyTorch's default reduction='mean')"
        if mean
        else "the samples' losses do not add up"
    )
    return (
        f"{loss_label(task)} gave a loss of {total:.6g} for "
        f"{rows} samples but {a:.6g} + {b:.6g} = {a + b:.6g} for its two halves (dropout "
        f"off), {what}: return the SUM, e.g. F.cross_entropy(logits, labels, "
        f"reduction='sum'), or set {OPT_OUT} if the samples of a batch interact "
        "(recorded as inexact)"
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=DATA_TOL, atol=DATA_TOL, equal_nan=True))
    return bool(torch.equal(a, b))


def _digest(batch: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Per key: dtype, shape and a sha256 of the bytes (exact types), or per-row float64 sums
    (floating types: compared to :data:`DATA_TOL`, so ranks on different CPUs may round
    differently)."""
    out: Dict[str, Any] = {}
    for key in sorted(batch):
        value = batch[key].detach().cpu()
        head = (str(value.dtype), tuple(value.shape))
        if value.is_floating_point() or value.is_complex():
            rows = torch.view_as_real(value) if value.is_complex() else value
            rows = torch.nan_to_num(rows.reshape(value.shape[0], -1).double())
            weight = (torch.arange(rows.shape[1], dtype=torch.float64) * 0.6180339887) % 1 + 0.5
            out[key] = (
                head,
                torch.stack([rows.sum(1), rows.abs().sum(1), rows @ weight], 1).tolist(),
            )
        else:
            out[key] = (head, hashlib.sha256(value.contiguous().numpy().tobytes()).hexdigest())
    return out


def _digest_difference(mine: Any, other: Any) -> Optional[str]:
    """The first key whose digest differs between two ranks, or None."""
    if mine is None or other is None:
        return None
    for key in sorted(set(mine) | set(other)):
        if key not in mine or key not in other or mine[key][0] != other[key][0]:
            return key
        a, b = mine[key][1], other[key][1]
        if isinstance(a, str) or isinstance(b, str):
            if a != b:
                return key
            continue
        x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        scale = np.maximum(np.abs(x[:, 1:2]), np.abs(y[:, 1:2])) * 2 + 1e-12
        if x.shape != y.shape or np.any(np.abs(x - y) > DATA_TOL * scale):
            return key
    return None


def _seed_globals(seed: int, rank: int, salt: int) -> None:
    """Seed torch's, numpy's and Python's global RNGs differently per rank and batch."""
    value = int(np.random.SeedSequence([seed, rank, salt, 0xC0DE]).generate_state(1)[0])
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


@contextlib.contextmanager
def _isolated(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Eval mode and full-precision fp32 matmuls inside; on exit every module's train flag,
    the matmul precision and the torch (CPU and CUDA), numpy and Python RNG states are back."""
    modes = [(m, m.training) for m in model.modules()]
    np_state, py_state = np.random.get_state(), random.getstate()
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            model.eval()
            torch.set_float32_matmul_precision("highest")
            torch.backends.cudnn.allow_tf32 = False
            yield
    finally:
        for module, training in modes:
            module.training = training
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        np.random.set_state(np_state)
        random.setstate(py_state)


__all__ = [
    "ABS_TOL",
    "N_POSITIONS",
    "OPT_OUT",
    "REL_TOL",
    "check_before_training",
    "check_task_contract",
    "contract_positions",
    "skipped_record",
]
