"""Uneven exact batches in a hand-written loop (Fabric, accelerate): :class:`StepRunner`.

The loop changes in two places: the training loader comes from :meth:`StepRunner.
setup_dataloader` (one item per optimizer step on every rank, after calibration and the agreed
split), and ``loss = loss_fn(model, batch); backward(loss)`` becomes :meth:`StepRunner.backward`,
which runs the rank's micro-batches (each mean loss times its units, under ``no_sync`` but the
last), exchanges the step's statistics, divides the gradients by the global unit count and
re-balances; clipping and ``optimizer.step()`` stay the loop's. The framework supplies its
backward, its ``no_sync`` and its device transfer; the model's DDP must SUM gradients
(:func:`register_sum_hook`). Framework glue: :mod:`~hetseq_hpc.integrations.fabric`,
:mod:`~hetseq_hpc.integrations.accelerate`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Dict, Iterable, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetseq_hpc.distributed.rendezvous import Rendezvous, StepStats
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.integrations.data import (
    LoaderSpec,
    StepBatch,
    StepLoader,
    loader_spec,
    lookahead,
    step_loader,
)
from hetseq_hpc.integrations.engine import (
    Balancer,
    GlobalOrder,
    HetSeqSettings,
    divide_gradients,
    global_loss,
)
from hetseq_hpc.train.ddp_hooks import HookState, sum_allreduce_hook

#: ``loss_fn(model, batch) -> mean loss`` (a 0-dim tensor)
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def register_sum_hook(model: nn.Module) -> Optional[HookState]:
    """Make a DDP model SUM its gradients across ranks (the hook's state), on CPU and GPU; a
    model that is not DDP (one rank) is left alone (None).

    Raises:
        ConfigError: the model already has a communication hook.
    """
    ddp = getattr(model, "_forward_module", model)  # Fabric's wrapper holds the DDP module
    if not isinstance(ddp, DistributedDataParallel):
        return None
    state = HookState(process_group=None)
    try:
        ddp.register_comm_hook(state, sum_allreduce_hook)
    except RuntimeError as exc:
        raise ConfigError(
            f"the model's DDP already has a communication hook ({exc}): uneven exact batches "
            "need hetseq_hpc's SUM hook; register none of your own"
        ) from None
    return state


class _StepLoss(nn.Module):
    """Calibration's model: ``forward(positions)`` = the SUM loss of those samples."""

    def __init__(self, runner: StepRunner, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self._runner = [runner]
        self._loss_fn = loss_fn

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        runner = self._runner[0]
        wanted = [int(p) for p in positions.tolist()]
        batch = runner.micro_batch(wanted)
        return self._loss_fn(self.model, batch) * runner.units(batch, len(wanted))


class StepRunner:
    """One rank's side of uneven exact batches in a hand-written loop.

    Args:
        settings: the user's :class:`~hetseq_hpc.integrations.engine.HetSeqSettings`.
        rdv: the engine's rendezvous over the framework's process group
            (:func:`~hetseq_hpc.integrations.engine.rendezvous_of`).
        backward: the framework's ``backward(loss)``.
        no_sync: ``no_sync(model)`` context of the framework (gradients not all-reduced).
        to_device: moves a micro-batch to this rank's device.
        device: this rank's device.
        units_fn: ``batch -> loss units`` (None: samples).
        autocast: the precision context of a forward pass (calibration).
        hook_state: the SUM hook's state (:func:`register_sum_hook`; it times the end of the
            rank's compute), None where it is not registered yet.
    """

    def __init__(
        self,
        settings: HetSeqSettings,
        rdv: Rendezvous,
        backward: Callable[[torch.Tensor], None],
        no_sync: Callable[[nn.Module], ContextManager],
        to_device: Callable[[Any], Any],
        device: torch.device,
        units_fn: Optional[Callable[[Any], Any]] = None,
        autocast: Callable[[], ContextManager] = contextlib.nullcontext,
        hook_state: Callable[[], Optional[HookState]] = lambda: None,
    ):
        self.settings = settings
        self.rdv = rdv
        self._backward = backward
        self._no_sync = no_sync
        self._to_device = to_device
        self.device = device
        self.units_fn = units_fn
        self.autocast = autocast
        self.balancer: Optional[Balancer] = None
        self.order: Optional[GlobalOrder] = None
        self.spec: Optional[LoaderSpec] = None
        self._hook_state = hook_state
        #: optimizer steps done (the next step's 0-based global batch index); restore it with
        #: :meth:`load_state_dict` to resume
        self.global_step = 0
        self.last_global_loss: Optional[float] = None
        self.last_stats: list = []
        self._last_end: Optional[float] = None

    def setup_dataloader(
        self, loader: Any, model: nn.Module, loss_fn: LossFn, seed: Optional[int] = None
    ) -> StepLoader:
        """The step loader of the user's training ``loader`` (its dataset, ``collate_fn``,
        ``shuffle`` and workers), after calibrating ``model`` (the bare module: no
        collectives) with ``loss_fn`` and agreeing on the split (every rank at once).

        Raises:
            ConfigError: an iterable dataset, or a sampler of the user's own.
            AllocationError: no split fits.
        """
        spec = loader_spec(loader, seed=self.settings.seed if seed is None else int(seed))
        self.spec = spec
        self.order = GlobalOrder(
            len(spec.dataset), self.settings.global_batch_size, spec.seed, spec.shuffle
        )
        self.balancer = Balancer(self.settings, self.rdv, lookahead(spec.loader_kwargs))
        self.balancer.agree(
            _StepLoss(self, model, loss_fn),
            lambda n: {"positions": torch.tensor(self.order.positions(0)[:n])},
            self.device,
            autocast=self.autocast,
        )
        balancer = self.balancer
        return step_loader(
            spec,
            self.order,
            lambda: balancer.schedule,
            self.rdv.world.rank,
            lambda: self.global_step,
        )

    def micro_batch(self, positions: Iterable[int]) -> Any:
        """The micro-batch of those dataset positions, on this rank's device."""
        assert self.spec is not None
        return self._to_device(self.spec.collate_fn([self.spec.dataset[p] for p in positions]))

    def units(self, micro: Any, samples: int) -> float:
        """Loss units of a micro-batch: ``units_fn(micro)``, else its ``samples``."""
        if self.units_fn is None:
            return float(samples)
        value = self.units_fn(micro)
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def backward(self, model: nn.Module, batch: StepBatch, loss_fn: LossFn) -> float:
        """This rank's share of one optimizer step: every micro-batch's forward and backward
        (``loss_fn`` returns a mean; it is multiplied by the micro-batch's units), the
        all-reduce on the last one only, then the step's exchange and the division of the
        gradients by the global unit count (clip after this, then ``optimizer.step()``).
        Returns the exact mean loss of the global batch.

        Raises:
            ConfigError: ``batch`` is not an item of :meth:`setup_dataloader`'s loader.
        """
        if not isinstance(batch, StepBatch) or self.balancer is None:
            raise ConfigError(
                f"StepRunner.backward got a {type(batch).__name__}: pass the items of the loader "
                "from setup_dataloader (one per optimizer step)"
            )
        start = time.perf_counter()
        tail = start - self._last_end if self._last_end is not None else 0.0
        hook = self._hook_state()
        if hook is not None:
            hook.reset()
        loss_sum, count = 0.0, 0.0
        micros = batch.micro_batches
        # samples as units: the global count is global_batch_size, folded into the losses
        scale = 1.0 / self.settings.global_batch_size if self.units_fn is None else 1.0
        for j, micro in enumerate(micros):
            micro = self._to_device(micro)
            units = self.units(micro, batch.sizes[j])
            last = j == len(micros) - 1
            with contextlib.nullcontext() if last else self._no_sync(model):
                loss = loss_fn(model, micro)
                self._backward(loss * (units * scale))
            loss_sum += float(loss.detach()) * units
            count += units
        ready = (hook.last_ready_s if hook is not None else 0.0) or time.perf_counter()
        stats = StepStats(
            loss_sum=loss_sum,
            count=count,
            samples=sum(batch.sizes),
            compute_time_s=max(ready - start, 1e-9),
            step_time_s=time.perf_counter() - start,
            data_time_s=0.0,
            tail_time_s=tail,
        )
        per_rank, _ = self.balancer.exchange(stats)
        if self.units_fn is not None:  # the global unit count is known only now
            divide_gradients(model.parameters(), sum(s.count for s in per_rank))
        self.last_stats = per_rank
        self.last_global_loss = global_loss(per_rank)
        self.balancer.after_step(batch.index, per_rank)
        self.global_step = batch.index + 1
        self._last_end = time.perf_counter()
        return self.last_global_loss

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps: the global step (the data position follows from it)."""
        return {"global_step": int(self.global_step)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume at ``state["global_step"]`` (any world size or split)."""
        self.global_step = int(state["global_step"])


__all__ = ["LossFn", "StepRunner", "register_sum_hook"]
