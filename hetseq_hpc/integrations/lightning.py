"""``Trainer(strategy=HetSeqStrategy(global_batch_size=B))``: an unchanged LightningModule
trained with uneven per-rank batches, every update exactly one step on the whole global batch.

:class:`HetSeqStrategy` is Lightning's ``DDPStrategy`` (same launcher: ``python script.py``,
srun, ``hetseq-hpc run``) plus the engine: the training loader becomes one item per optimizer
step on every rank (:mod:`~hetseq_hpc.integrations.data`), holding the rank's share of the
global batch as micro-batches; the first runs in ``training_step``, the others in ``backward``
(Lightning zeroes gradients between the two), each mean loss times its units, under
``no_sync`` but the last; the SUM hook all-reduces (registered on the CPU too); one exchange
gives the global unit count, the gradients are divided by it before clipping, the exact loss
is logged as :data:`GLOBAL_LOSS_KEY`, and the split is re-balanced from measured step times
(:class:`~hetseq_hpc.integrations.engine.Balancer`). Pitfalls: docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import lightning
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hetseq_hpc.distributed.rendezvous import StepStats
from hetseq_hpc.errors import AllocationError, ConfigError
from hetseq_hpc.integrations.cluster import HetJobEnvironment, native_root_device
from hetseq_hpc.integrations.data import (
    LoaderSpec,
    StepBatch,
    loader_spec,
    lookahead,
    step_loader,
)
from hetseq_hpc.integrations.engine import (
    Balancer,
    GlobalOrder,
    HetSeqSettings,
    cpu_group,
    divide_gradients,
    global_loss,
    rendezvous_of,
)
from hetseq_hpc.integrations.lightning_logs import LogCapture, quiet_epoch_sync_warning, silenced
from hetseq_hpc.train.ddp_hooks import HookState, no_forward_buffer_sync, sum_allreduce_hook

log = logging.getLogger(__name__)

#: the Lightning releases this strategy is tested with (the ``lightning`` extra pins the same)
TESTED_LIGHTNING = ">=2.6,<2.7"
#: the key the exact mean loss of each global batch is logged under (on step and epoch; the
#: progress bar shows it; ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` can use it)
GLOBAL_LOSS_KEY = "global_loss"
#: ``DDPStrategy`` arguments this strategy sets itself
OWN_DDP_ARGUMENTS = (
    "ddp_comm_hook",
    "ddp_comm_state",
    "ddp_comm_wrapper",
    "model_averaging_period",
)


def check_lightning_version(version: str) -> None:
    """Refuse a Lightning release outside :data:`TESTED_LIGHTNING`.

    Raises:
        ConfigError: one line naming the installed release and the fix.
    """
    if Version(version) not in SpecifierSet(TESTED_LIGHTNING):
        raise ConfigError(
            f"lightning {version} is outside the range HetSeqStrategy is tested with "
            f"({TESTED_LIGHTNING}): pip install 'hetseq_hpc[lightning]' (or "
            f"'lightning{TESTED_LIGHTNING}')"
        )


def step_loss(output: Any, where: str) -> torch.Tensor:
    """The loss tensor of a ``training_step`` output (a tensor, or a mapping's ``"loss"``).

    Raises:
        ConfigError: the output has no loss (``None`` skips a step in Lightning, which uneven
            micro-batches cannot: every rank must take part in every step).
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise ConfigError(
        f"training_step returned {type(output).__name__} for {where}: with uneven micro-batches "
        "every micro-batch must return its mean loss (a tensor, or a dict with 'loss'); a step "
        "cannot be skipped on one rank alone"
    )


@contextlib.contextmanager
def hook_name(module: Any, name: str) -> Iterator[None]:
    """Lightning's current hook name set to ``name`` while the block runs (``self.log`` in a
    micro-batch run from ``backward`` belongs to ``training_step``)."""
    before = module._current_fx_name
    module._current_fx_name = name
    try:
        yield
    finally:
        module._current_fx_name = before


class StepLossModule(nn.Module):
    """What calibration times: ``forward(positions)`` builds the micro-batch of those dataset
    positions as training does and returns the module's ``training_step`` loss as a SUM (mean
    x units). ``self.log`` does nothing meanwhile; nothing is trained."""

    def __init__(self, strategy: HetSeqStrategy, module: nn.Module):
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # a list: not registered as a submodule

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """The SUM loss of the samples at ``positions`` (1-d)."""
        strategy = self._strategy[0]
        wanted = [int(p) for p in positions.tolist()]
        batch = strategy.micro_batch(wanted)
        with silenced(self.module):
            out = self.module.training_step(batch, 0)
        return step_loss(out, "calibration") * strategy.units(batch, len(wanted))


@dataclass
class _Step:
    """The step in flight on this rank."""

    batch: StepBatch
    rest: Sequence[Any]
    start: float
    units: List[float] = field(default_factory=list)
    loss_sum: float = 0.0
    logs: LogCapture = field(default_factory=LogCapture)


class HetSeqStrategy(DDPStrategy):
    """Lightning's DDP with hetseq_hpc's uneven exact batches.

    Args:
        global_batch_size: ``B``, samples of one optimizer step over all ranks (the train
            loader's ``batch_size`` is ignored).
        allocation: a forced per-rank split (one count per rank, summing to ``B``); None =
            measured: calibration, cost curves and memory caps, re-balanced online.
        units_fn: ``batch -> number of loss units`` of a micro-batch, for a loss that is a mean
            over units other than samples (tokens); None = its samples.
        max_micro_batch: the largest micro-batch any rank runs (more samples: accumulation).
        memory_budget_gb: per-rank memory budget in GiB (None: free GPU memory / RAM share).
        calibration_steps: timed passes per rank at start-up.
        calibration_micro_batch: micro-batch timed while calibrating (None: the native rule).
        rebalance_every: steps between re-balancing decisions (0: never; None: every 10 for a
            measured split, never for a forced one).
        rebalance_threshold: relative model error that counts as a speed change.
        seed: seed of the per-epoch shuffle (None: ``seed_everything``'s, else 0).
        allow_batchnorm: train a model with BatchNorm anyway (NOT exact across splits).
        cluster_environment: Lightning's; None = :class:`~hetseq_hpc.integrations.cluster.
            HetJobEnvironment` inside an srun step or an external launcher, else Lightning's.
        **kwargs: ``DDPStrategy`` arguments (``process_group_backend``, ``timeout``, ...).

    Raises:
        ConfigError: a value is invalid, a comm hook is given, or the installed Lightning is
            outside :data:`TESTED_LIGHTNING` (one line each).
    """

    strategy_name = "hetseq"

    def __init__(
        self,
        global_batch_size: int,
        allocation: Optional[Sequence[int]] = None,
        units_fn: Optional[Callable[[Any], Any]] = None,
        *,
        max_micro_batch: Optional[int] = None,
        memory_budget_gb: Optional[float] = None,
        calibration_steps: int = 4,
        calibration_micro_batch: Optional[int] = None,
        rebalance_every: Optional[int] = None,
        rebalance_threshold: float = 0.1,
        seed: Optional[int] = None,
        allow_batchnorm: bool = False,
        cluster_environment: Any = None,
        **kwargs: Any,
    ) -> None:
        check_lightning_version(lightning.__version__)
        given = [k for k in OWN_DDP_ARGUMENTS if kwargs.get(k) is not None]
        if given:
            raise ConfigError(
                f"HetSeqStrategy({given[0]}=...): the strategy registers its own SUM "
                "communication hook (exact uneven batches); leave it out"
            )
        self.settings = HetSeqSettings(
            global_batch_size=global_batch_size,
            allocation=tuple(allocation) if allocation is not None else None,
            max_micro_batch=max_micro_batch,
            memory_budget_gb=memory_budget_gb,
            calibration_steps=calibration_steps,
            calibration_micro_batch=calibration_micro_batch,
            rebalance_every=rebalance_every,
            rebalance_threshold=rebalance_threshold,
            seed=int(seed) if seed is not None else 0,
        )
        if units_fn is not None and not callable(units_fn):
            raise ConfigError(
                f"units_fn={units_fn!r} is not callable: give batch -> loss units, or None"
            )
        if cluster_environment is None and HetJobEnvironment.detect():
            cluster_environment = HetJobEnvironment()
        for name, value in no_forward_buffer_sync().items():
            kwargs.setdefault(name, value)
        super().__init__(cluster_environment=cluster_environment, **kwargs)
        self.units_fn = units_fn
        self.allow_batchnorm = bool(allow_batchnorm)
        self._seed_given = seed is not None
        self.balancer: Optional[Balancer] = None
        self.order: Optional[GlobalOrder] = None
        self.spec: Optional[LoaderSpec] = None
        self.hook_state = HookState()
        self.last_global_loss: Optional[float] = None
        #: every rank's statistics of the last step (loss sums, units, timings), rank order
        self.last_stats: List[StepStats] = []
        self._tail = 0.0
        self._object_group: Any = None
        self._step: Optional[_Step] = None
        self._last_end: Optional[float] = None

    # ------------------------------------------------------------------ devices and world
    @property
    def root_device(self) -> torch.device:
        """The CPU for CPU devices whatever the local rank; under
        :class:`HetJobEnvironment` the GPU ``local rank % visible GPUs`` (the native rule);
        else Lightning's."""
        native = native_root_device(
            self.parallel_devices or [], self.cluster_environment, self.local_rank
        )
        return native if native is not None else super().root_device

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """For validation / test loaders: every rank of the job (not nodes x devices, wrong
        when nodes run different numbers of ranks)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """Lightning's DDP set-up, then the gloo group the step statistics travel on."""
        super().setup_environment()
        self._object_group = cpu_group(torch.distributed.get_backend())

    def setup(self, trainer: Any) -> None:
        """Refuse what uneven exact batches cannot do (one line each), then Lightning's DDP
        set-up (DDP with the SUM hook, on every device type).

        Raises:
            ConfigError: ``accumulate_grad_batches != 1``, ``sync_batchnorm=True``, BatchNorm
                layers (unless ``allow_batchnorm``), manual optimisation, ``precision="16-mixed"``
                or an ``on_before_batch_transfer`` hook.
        """
        if trainer.state.fn == TrainerFn.FITTING:
            self.refuse_unsupported(trainer)
        super().setup(trainer)

    def refuse_unsupported(self, trainer: Any) -> None:
        """The checks of :meth:`setup` (before anything is wrapped).

        Raises:
            ConfigError: see :meth:`setup`.
        """
        module = self.lightning_module
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with "
                "HetSeqStrategy: accumulation is per rank here (each rank's share of "
                "global_batch_size, cut into micro-batches); leave it at 1 and set "
                "global_batch_size (and max_micro_batch) instead"
            )
        if self._layer_sync is not None:
            raise ConfigError(
                "Trainer(sync_batchnorm=True) with HetSeqStrategy: SyncBatchNorm syncs within one "
                "forward pass, and ranks run different numbers of micro-batches (it would hang); "
                "use nn.GroupNorm or nn.LayerNorm"
            )
        layers = [
            (n or "<model>", type(m).__name__)
            for n, m in module.named_modules()
            if isinstance(m, _BatchNorm)
        ]
        if layers and not self.allow_batchnorm:
            name, kind = layers[0]
            raise ConfigError(
                f"model layer {name!r} is {kind}: BatchNorm statistics depend on each rank's "
                "micro-batch, so uneven batches are not exact; replace it with nn.GroupNorm or "
                "nn.LayerNorm, or pass HetSeqStrategy(allow_batchnorm=True) to accept inexact "
                "results"
            )
        if not module.automatic_optimization:
            raise ConfigError(
                "automatic_optimization=False with HetSeqStrategy: manual optimisation is not "
                "supported (the strategy runs each rank's micro-batches between Lightning's "
                "training_step and optimizer step); use automatic optimisation"
            )
        precision = self.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            raise ConfigError(
                f"Trainer(precision={trainer.precision!r}) with HetSeqStrategy: fp16 keeps one "
                "GradScaler per rank, whose skipped steps would differ between ranks; use "
                "precision='bf16-mixed' or '32-true'"
            )
        if is_overridden("on_before_batch_transfer", module):
            raise ConfigError(
                "LightningModule.on_before_batch_transfer with HetSeqStrategy: Lightning calls it "
                "on the step's whole batch (all micro-batches); move it into the DataLoader's "
                "collate_fn or into on_after_batch_transfer (called per micro-batch)"
            )

    def _register_ddp_hooks(self) -> None:
        """The SUM all-reduce hook, on CUDA and CPU alike (Lightning's own registers a hook
        only on CUDA)."""
        self.hook_state = HookState(process_group=None)
        self.model.register_comm_hook(self.hook_state, sum_allreduce_hook)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader becomes the step loader (calibration and the agreed split
        first, on every rank); other loaders stay Lightning's.

        Raises:
            ConfigError: an iterable dataset, or a sampler of the user's own.
            AllocationError: no split fits (a rank cannot hold one sample, ...).
        """
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or not trainer.training or trainer.state.fn != TrainerFn.FITTING:
            return super().process_dataloader(dataloader)
        spec = loader_spec(dataloader, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
        if self._seed_given:
            spec = replace(spec, seed=self.settings.seed)
        if self.balancer is None:
            self.spec = spec
            self.order = GlobalOrder(
                len(spec.dataset), self.settings.global_batch_size, spec.seed, spec.shuffle
            )
            env = self.cluster_environment
            rdv = rendezvous_of(
                self.global_rank,
                self.local_rank,
                self.world_size,
                env.main_address if env is not None else "127.0.0.1",
                env.main_port if env is not None else 1,
                self._object_group,
                source="lightning",
            )
            self.balancer = Balancer(self.settings, rdv, lookahead(spec.loader_kwargs))
            self.balancer.agree(
                StepLossModule(self, module),
                lambda n: {"positions": torch.tensor(self.order.positions(0)[:n])},
                self.root_device,
                autocast=self.precision_plugin.train_step_context,
                precision=str(trainer.precision),
                ranks_on_node=len(self.parallel_devices or [1]),
            )
        balancer = self.balancer
        return step_loader(
            spec,
            self.order,
            lambda: balancer.schedule,
            self.global_rank,
            start=lambda: int(trainer.global_step),
        )

    def micro_batch(self, positions: Sequence[int]) -> Any:
        """The micro-batch of the dataset ``positions`` as training builds it (the user's
        collate_fn, precision conversion, device transfer with the module's hooks)."""
        assert self.spec is not None
        batch = self.spec.collate_fn([self.spec.dataset[p] for p in positions])
        batch = self.precision_plugin.convert_input(batch)
        return super().batch_to_device(batch)

    def units(self, micro: Any, samples: int) -> float:
        """Loss units of a micro-batch: ``units_fn(micro)``, else its ``samples``."""
        if self.units_fn is None:
            return float(samples)
        value = self.units_fn(micro)
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def batch_to_device(
        self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0
    ) -> Any:
        """A step's micro-batches one by one (the module's transfer hooks see its own batch
        format); anything else as Lightning does."""
        if isinstance(batch, StepBatch):
            micro = [
                super(HetSeqStrategy, self).batch_to_device(b, device, dataloader_idx)
                for b in batch.micro_batches
            ]
            return StepBatch(micro_batches=micro, sizes=batch.sizes, step=batch.index)
        return super().batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------ one step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start the step: the first micro-batch's forward (under ``no_sync`` when more
        follow); its output goes back to Lightning's closure as usual.

        Raises:
            ConfigError: the batch is not one step of the step loader (several train loaders,
                or a ``dataloader_iter`` training step).
            AllocationError: the loader's micro-batches differ from the agreed split.
        """
        batch = args[0] if args else kwargs.get("batch")
        if not isinstance(batch, StepBatch):
            raise ConfigError(
                f"HetSeqStrategy got a training batch of type {type(batch).__name__}, not one "
                "step of its loader: train_dataloader must return ONE DataLoader (no list, dict "
                "or CombinedLoader of loaders) and training_step must take a batch, not a "
                "dataloader_iter"
            )
        assert self.balancer is not None and self.balancer.schedule is not None
        expected = self.balancer.schedule.at(batch.index).shares[self.global_rank].micro_sizes
        if list(batch.sizes) != list(expected):
            raise AllocationError(
                f"step {batch.index + 1}: the loader cut micro-batches {batch.sizes} but the "
                f"agreed split gives this rank {expected}: report this as a bug"
            )
        now = time.perf_counter()
        self._tail = now - self._last_end if self._last_end is not None else 0.0
        self.hook_state.reset()
        self._step = _Step(batch=batch, rest=tuple(args[1:]), start=now)
        return self._micro_forward(0)

    def _micro_forward(self, j: int) -> Any:
        step = self._step
        assert step is not None and self.model is not None
        module = self.lightning_module
        micro = step.batch.micro_batches[j]
        units = self.units(micro, step.batch.sizes[j])
        step.units.append(units)
        last = j == len(step.batch.micro_batches) - 1
        sync = contextlib.nullcontext() if last else self.model.no_sync()
        with (
            sync,
            self.precision_plugin.train_step_context(),
            hook_name(module, "training_step"),
            step.logs.capturing(module, units),
        ):
            out = self._forward_redirection(self.model, module, "training_step", micro, *step.rest)
        loss = step_loss(out, f"micro-batch {j + 1} of step {step.batch.index + 1}")
        step.loss_sum += float(loss.detach()) * units
        return out

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """The step's backward passes: the first micro-batch's loss (from ``training_step``),
        then forward+backward of the others; every loss x its units (a SUM), the last pass
        all-reduced by the SUM hook; then the exchange, the division by the global unit
        count (before clipping; with samples as units, ``global_batch_size``, folded into the
        losses), the step's logs, the global loss and re-balancing.
        ``on_before_backward`` / ``on_after_backward`` run once per step (the latter with the
        global gradient)."""
        step = self._step
        if step is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        plugin = self.precision_plugin
        # samples as units: the global count is global_batch_size, known now, so each loss is
        # scaled by 1/B before backward instead of dividing every gradient afterwards
        scale = 1.0 / self.settings.global_batch_size if self.units_fn is None else 1.0
        first = plugin.pre_backward(closure_loss * (step.units[0] * scale), module)
        plugin.backward(first, module, optimizer, *args, **kwargs)
        for j in range(1, len(step.batch.micro_batches)):
            out = self._micro_forward(j)
            loss = step_loss(out, f"micro-batch {j + 1}") * (step.units[j] * scale)
            plugin.backward(loss, module, optimizer, *args, **kwargs)
        ready = self.hook_state.last_ready_s or time.perf_counter()
        stats = StepStats(
            loss_sum=step.loss_sum,
            count=sum(step.units),
            samples=sum(step.batch.sizes),
            compute_time_s=max(ready - step.start, 1e-9),
            step_time_s=time.perf_counter() - step.start,
            data_time_s=0.0,
            tail_time_s=self._tail,
        )
        assert self.balancer is not None
        per_rank, tables = self.balancer.exchange(stats, step.logs.table())
        if self.units_fn is not None:  # the global unit count is known only now
            divide_gradients(module.parameters(), sum(s.count for s in per_rank))
        self.last_global_loss = global_loss(per_rank)
        self.last_stats = per_rank
        quiet_epoch_sync_warning(GLOBAL_LOSS_KEY)
        with hook_name(module, "training_step"):
            step.logs.emit(module, tables)
            module.log(
                GLOBAL_LOSS_KEY,
                torch.tensor(self.last_global_loss, dtype=torch.float64),
                on_step=True,
                on_epoch=True,
                prog_bar=True,
                batch_size=int(sum(s.samples for s in per_rank)),
            )
        closure_loss = plugin.post_backward(first, module)
        trainer = module.trainer
        last = trainer.max_steps is not None and 0 <= trainer.max_steps <= step.batch.index + 1
        self.balancer.after_step(step.batch.index, per_rank, last=last)
        self._step = None
        self._last_end = time.perf_counter()
        return closure_loss

    def teardown(self) -> None:
        """Lightning's DDP teardown; the step state is dropped."""
        self._step = None
        super().teardown()


__all__ = [
    "GLOBAL_LOSS_KEY",
    "TESTED_LIGHTNING",
    "HetSeqStrategy",
    "StepLossModule",
    "check_lightning_version",
    "step_loss",
]
