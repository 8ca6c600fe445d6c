"""Each rank's precision, and ONE dynamic loss scale for the whole job.

:func:`resolve_precision` turns ``auto`` / ``fp32`` / ``bf16`` / ``fp16`` into the rank's
autocast dtype (parameters, gradients and optimizer state stay fp32); :class:`LossScale` is
GradScaler's dynamic rule as one job-wide scale, used when any rank computes in fp16 or the
all-reduce payload is fp16, so an overflow skips the SAME step on every rank.
Design: docs/design/exact-gradients.md, "Precision per rank and one loss scale".
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from hetseq_hpc.config.comm import CommConfig
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.train import ddp_hooks

log = logging.getLogger(__name__)

#: precisions a rank can train in (``auto`` resolves to one of them)
PRECISIONS = ("fp32", "bf16", "fp16")
#: autocast dtype of each half precision
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: torch.amp.GradScaler defaults (torch docs, torch.amp.GradScaler): initial scale, growth and
#: backoff factors, clean steps between growths
INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


def resolve_precision(
    requested: str, device_type: str, capability: Optional[Tuple[int, int]] = None
) -> Tuple[str, Optional[str]]:
    """``(precision, warning)``: what a rank asked to run in ``requested`` trains in.

    Args:
        requested: ``auto``, ``fp32``, ``bf16`` or ``fp16`` (the rank's placement precision).
        device_type: ``"cuda"`` or ``"cpu"``.
        capability: CUDA compute capability (None on the CPU).

    ``auto``: bf16 on CUDA >= 8.0, fp16 on CUDA 7.x, fp32 on older GPUs and the CPU. An explicit
    ``bf16`` on CUDA < 8.0 falls back to fp16 (>= 7.0) or fp32, with a warning line.
    """
    cap = tuple(capability or (0, 0))
    cuda = device_type == "cuda"
    if requested == "auto":
        if cuda and cap >= (8, 0):
            return "bf16", None
        return ("fp16" if cuda and cap >= (7, 0) else "fp32"), None
    if requested == "bf16" and cuda and cap < (8, 0):
        fallback = "fp16" if cap >= (7, 0) else "fp32"
        return fallback, (
            f"precision bf16 needs compute capability >= 8.0, this GPU has "
            f"{cap[0]}.{cap[1]}: training in {fallback}"
        )
    if requested not in PRECISIONS:
        raise ConfigError(f"precision {requested!r} is unknown: use auto, fp32, bf16 or fp16")
    return requested, None


def autocast_factory(precision: str, device_type: str) -> Callable[[], Any]:
    """Context factory for ``precision``: ``torch.autocast(device_type, dtype)`` for bf16/fp16,
    a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = DTYPES[precision]
    return lambda: torch.autocast(device_type, dtype=dtype)


def fsdp_param_dtype(precisions: Sequence[Optional[str]]) -> Tuple[Optional[torch.dtype], str]:
    """``(dtype, why)``: the dtype FSDP2 gathers parameters in for ranks computing in
    ``precisions`` (every rank's, rank order; None = fp32), and why, for the log and
    ``summary.json``.

    bf16 when EVERY rank computes in bf16: each rank's matmuls would round the fp32 weights to
    bf16 under autocast anyway, so gathering them in bf16 moves half the bytes (the sharded
    master weights, the optimizer state and the gradient reduce-scatter stay fp32:
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). None (fp32 gathers) when
    the ranks disagree or any computes in fp32 or fp16: FSDP2 gathers one dtype on every rank,
    and an fp32 rank must not lose its precision (nor an fp16 rank take bf16's coarser
    rounding)."""
    named = [p or "fp32" for p in precisions]
    if named and all(p == "bf16" for p in named):
        return torch.bfloat16, "every rank computes in bf16"
    if len(set(named)) > 1:
        return None, f"ranks compute in {'/'.join(sorted(set(named)))}: one dtype for all, fp32"
    return None, f"every rank computes in {named[0] if named else 'fp32'}"


def needs_loss_scale(precisions: Sequence[Optional[str]], grad_compression: str = "none") -> bool:
    """True when the job needs its shared loss scale: a rank computes in fp16, or gradients
    travel as fp16 (fp16's 5 exponent bits under- and overflow; bf16 has fp32's range)."""
    return "fp16" in precisions or grad_compression == "fp16"


def is_power_of_two(n: int) -> bool:
    """``n`` is 1, 2, 4, 8, ..."""
    return n >= 1 and (n & (n - 1)) == 0


def check_adasum_world(world_size: int) -> None:
    """Adasum's recursive pairing needs a power-of-two world (as Horovod's, which refuses
    others: "Running Adasum with non-power-of-two ranks is not supported yet", adasum.h).

    Raises:
        ConfigError: ``world_size`` is not a power of two (one line).
    """
    if not is_power_of_two(int(world_size)):
        raise ConfigError(
            f"comm.grad_combine=adasum needs a power-of-two number of ranks, "
            f"this run has {world_size}: use 2, 4, 8 ... ranks, or "
            "comm.grad_combine=sum"
        )


@dataclass
class LossScale:
    """The job-wide dynamic loss scale (``torch.amp.GradScaler``'s rule, one scale for all ranks).

    Attributes:
        enabled: False = no scale at all (factor 1, no check, nothing logged).
        scale: current scale ``S`` (a power of two, so scaling and unscaling are exact).
        growth_tracker: clean steps since the last change.
        skipped_steps: steps skipped because the summed gradient was not finite.
    """

    enabled: bool = False
    scale: float = INIT_SCALE
    growth_tracker: int = 0
    skipped_steps: int = 0
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL

    def factor(self) -> float:
        """What the loss is multiplied by before backward (1.0 when disabled)."""
        return self.scale if self.enabled else 1.0

    def update(self, found_inf: bool) -> bool:
        """Apply one step's verdict; returns True when the step must be skipped."""
        if not self.enabled:
            return False
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return True
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
        return False

    def state_dict(self) -> Dict[str, Any]:
        """Plain data for the checkpoint."""
        return {
            "enabled": self.enabled,
            "scale": float(self.scale),
            "growth_tracker": int(self.growth_tracker),
            "skipped_steps": int(self.skipped_steps),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a checkpoint of a run without a scale leaves the
        initial one (and the skip count at 0)."""
        if not state.get("enabled") or not self.enabled:
            return
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state["skipped_steps"])


class GradientPath:
    """How one rank's gradients become the update: loss scale, combine rule, compression.

    Built by the Trainer from the run and every rank's precision; the Trainer calls
    :meth:`backward`, :meth:`unscale_factor` and :meth:`step_ok` at fixed points of a step.

    Raises:
        ConfigError: ``grad_combine=adasum`` on a world that is not a power of two.
    """

    def __init__(
        self,
        comm_cfg: CommConfig,
        precisions: Sequence[Optional[str]],
        rank: int,
        world_size: int,
        expected_units: float,
    ):
        self.combine = comm_cfg.grad_combine
        self.compression = comm_cfg.grad_compression
        self.bucket_cap_mb = comm_cfg.bucket_cap_mb
        self.precisions = [p or "fp32" for p in precisions]
        self.rank = rank
        self.expected_units = max(float(expected_units), 1.0)
        self.loss_scale = LossScale(enabled=needs_loss_scale(self.precisions, self.compression))
        self.last_skipped = False
        self._used_scale = self.loss_scale.factor()
        self._loss_factor = 1.0
        if self.combine == "adasum":
            check_adasum_world(world_size)
            if rank == 0:
                log.warning(
                    "comm.grad_combine=adasum: each rank's own mean gradient is "
                    "combined by Adasum (Maleki et al. 2020); this is NOT the exact "
                    "global-batch update"
                )
        if self.loss_scale.enabled and rank == 0:
            log.info(
                "precisions %s: one job-wide dynamic loss scale (init %g)",
                self.precisions,
                self.loss_scale.scale,
            )

    # --------------------------------------------------------------- DDP wiring
    def ddp_kwargs(self) -> Dict[str, Any]:
        """Extra DDP arguments (``bucket_cap_mb`` when set; nothing otherwise)."""
        return {} if self.bucket_cap_mb is None else {"bucket_cap_mb": float(self.bucket_cap_mb)}

    def comm_hook(self, state: ddp_hooks.HookState) -> Callable:
        """The DDP comm hook: the SUM all-reduce (compressed or not), or Adasum; configures
        ``state`` (:class:`~hetseq_hpc.train.ddp_hooks.HookState`) for it."""
        state.comm_dtype = None if self.compression == "none" else DTYPES[self.compression]
        if self.combine == "adasum":
            return ddp_hooks.adasum_hook
        if state.comm_dtype is not None:
            return ddp_hooks.compressed_sum_hook
        return ddp_hooks.sum_allreduce_hook

    # --------------------------------------------------------------- one step
    def backward(
        self,
        loss: torch.Tensor,
        step: int,
        state: Optional[ddp_hooks.HookState] = None,
        local_units: int = 0,
    ) -> None:
        """``loss.backward()``, on ``loss x S / U`` when the scale is in use: the SUM loss's
        gradients are ~U times a mean loss's (``U`` = expected loss units of the global batch),
        so the job-wide constant ``1 / U`` (the same on every rank: the sum stays exact) brings
        them to a mean loss's size before ``S``, GradScaler's usual operating range. ``step``:
        the optimizer step; ``state`` / ``local_units``: the hook state and this rank's unit
        count so far (Adasum)."""
        if state is not None:
            state.local_units = max(int(local_units), 1)
        self._used_scale = self.loss_scale.factor()
        if not self.loss_scale.enabled:
            loss.backward()
            return
        self._loss_factor = self._used_scale / self.expected_units
        (loss * self._loss_factor).backward()

    def unscale_factor(self, global_count: int) -> float:
        """What the summed gradients are multiplied by: ``1 / global_count`` (exactly the value
        without a scale), ``x U / S`` with one; Adasum's are already per-rank means: ``U / S``."""
        if not self.loss_scale.enabled:
            return 1.0 if self.combine == "adasum" else 1.0 / global_count
        if self.combine == "adasum":
            return 1.0 / self._loss_factor
        return 1.0 / (global_count * self._loss_factor)

    def step_ok(self, grad_norm: float, step: int) -> bool:
        """False when this step must be skipped (scale in use and the unscaled global gradient's
        norm is not finite); updates the scale. Always True without a scale."""
        self.last_skipped = self.loss_scale.update(not math.isfinite(grad_norm))
        if self.last_skipped:
            log.warning(
                "rank %d: step %d skipped: summed gradient not finite at loss scale %g; "
                "scale now %g (%d skipped so far)",
                self.rank,
                step,
                self._used_scale,
                self.loss_scale.scale,
                self.loss_scale.skipped_steps,
            )
        return not self.last_skipped

    def row(self, state: Any = None) -> Dict[str, Any]:
        """The step's fields for ``metrics.jsonl``: the loss scale's, the payload bytes of a
        compressed or Adasum path, and the measured gradient communication of ``state``
        (:meth:`~hetseq_hpc.train.ddp_hooks.HookState.comm_row`; none without a collective)."""
        out: Dict[str, Any] = {}
        if self.loss_scale.enabled:
            out.update(
                loss_scale=self._used_scale,
                step_skipped=self.last_skipped,
                skipped_steps=self.loss_scale.skipped_steps,
            )
        if state is not None and (self.compression != "none" or self.combine != "sum"):
            out["allreduce_bytes"] = int(state.bytes_sent)
        if state is not None:  # this rank's measured gradient communication
            out.update(state.comm_row())
        return out

    def summary(self) -> Dict[str, Any]:
        """What ``summary.json`` records about precision and the gradient combine."""
        out: Dict[str, Any] = {
            "precisions": list(self.precisions),
            "grad_compression": self.compression,
            "grad_combine": self.combine,
            "exact_global_batch_update": self.combine == "sum",
        }
        if self.combine == "adasum":
            out["grad_combine_note"] = (
                "Adasum of each rank's own mean gradient (Maleki et al. "
                "2020), per parameter tensor: not the exact global-batch "
                "update"
            )
        if self.loss_scale.enabled:
            out.update(
                loss_scale=self.loss_scale.scale, skipped_steps=self.loss_scale.skipped_steps
            )
        return out
