"""Lightning Fabric with uneven exact batches: :class:`HetSeqFabricStrategy` (Fabric's DDP with
the SUM hook on every device type, no sampler injection, the het-job cluster environment) and
:class:`HetSeqFabric` (the loop's few changed lines: :class:`~hetseq_hpc.integrations.loop.
StepRunner` on Fabric's backward, ``no_backward_sync`` and device transfer)::

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=HetSeqFabricStrategy())
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    hetseq = HetSeqFabric(fabric, global_batch_size=32)
    loader = hetseq.setup_dataloader(loader, model.module, loss_fn)  # not setup_dataloaders
    for batch in loader:
        loss = hetseq.backward(model, batch, loss_fn)  # not fabric.backward(loss_fn(...))
        optimizer.step()
        optimizer.zero_grad()

Pitfalls: docs/integrations.md.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Sequence

import lightning
import torch
from lightning.fabric.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.integrations.cluster import HetJobEnvironment, native_root_device
from hetseq_hpc.integrations.engine import HetSeqSettings, cpu_group, rendezvous_of
from hetseq_hpc.integrations.lightning import check_lightning_version
from hetseq_hpc.integrations.loop import StepRunner
from hetseq_hpc.train.ddp_hooks import HookState, no_forward_buffer_sync, sum_allreduce_hook


class HetSeqFabricStrategy(DDPStrategy):
    """Fabric's DDP strategy for uneven exact batches.

    Args:
        cluster_environment: Fabric's; None = :class:`~hetseq_hpc.integrations.cluster.
            HetJobEnvironment` inside an srun step or an external launcher, else Fabric's.
        **kwargs: ``DDPStrategy`` arguments (``process_group_backend``, ``timeout``, ...).

    Raises:
        ConfigError: the installed Lightning is outside the tested range.
    """

    strategy_name = "hetseq"

    def __init__(self, cluster_environment: Any = None, **kwargs: Any) -> None:
        check_lightning_version(lightning.__version__)
        if cluster_environment is None and HetJobEnvironment.detect():
            cluster_environment = HetJobEnvironment()
        for name, value in no_forward_buffer_sync().items():
            kwargs.setdefault(name, value)
        super().__init__(cluster_environment=cluster_environment, **kwargs)
        self.hook_state: Optional[HookState] = None

    @property
    def root_device(self) -> torch.device:
        """The CPU for CPU devices whatever the local rank; under HetJobEnvironment the GPU
        ``local rank % visible GPUs``; else Fabric's."""
        native = native_root_device(
            self.parallel_devices or [], self.cluster_environment, self.local_rank
        )
        return native if native is not None else super().root_device

    @property
    def distributed_sampler_kwargs(self) -> Optional[Dict[str, Any]]:
        """None: Fabric injects no DistributedSampler (the step loader cuts every rank's share)."""
        return None

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        """Fabric's DDP wrapping, then the SUM all-reduce hook (on CPU too)."""
        ddp = super().setup_module(module)
        self.hook_state = HookState(process_group=None)
        ddp.register_comm_hook(self.hook_state, sum_allreduce_hook)
        return ddp


class HetSeqFabric(StepRunner):
    """:class:`~hetseq_hpc.integrations.loop.StepRunner` on a launched ``Fabric`` whose
    strategy is :class:`HetSeqFabricStrategy`.

    Args:
        fabric: the launched Fabric.
        global_batch_size, allocation, units_fn: as :class:`~hetseq_hpc.integrations.lightning.
            HetSeqStrategy`'s; further keywords: :class:`~hetseq_hpc.integrations.engine.
            HetSeqSettings`.

    Raises:
        ConfigError: Fabric's strategy is not HetSeqFabricStrategy, or a setting is invalid.
    """

    def __init__(
        self,
        fabric: Any,
        global_batch_size: int,
        allocation: Optional[Sequence[int]] = None,
        units_fn: Optional[Callable[[Any], Any]] = None,
        **settings: Any,
    ):
        strategy = fabric.strategy
        if not isinstance(strategy, HetSeqFabricStrategy):
            raise ConfigError(
                f"Fabric(strategy={type(strategy).__name__}) with HetSeqFabric: pass "
                "Fabric(strategy=HetSeqFabricStrategy()) (the SUM hook, no sampler injection)"
            )
        settings.setdefault("seed", int(os.environ.get("PL_GLOBAL_SEED", 0)))  # seed_everything's
        env = strategy.cluster_environment
        rdv = rendezvous_of(
            fabric.global_rank,
            fabric.local_rank,
            fabric.world_size,
            env.main_address,
            env.main_port,
            cpu_group(torch.distributed.get_backend()),
            source="fabric",
        )
        super().__init__(
            HetSeqSettings(
                global_batch_size=global_batch_size,
                allocation=tuple(allocation) if allocation is not None else None,
                **settings,
            ),
            rdv,
            backward=fabric.backward,
            no_sync=lambda model: fabric.no_backward_sync(model, enabled=True),
            to_device=fabric.to_device,
            device=fabric.device,
            units_fn=units_fn,
            autocast=fabric.autocast,
            hook_state=lambda: strategy.hook_state,
        )


__all__ = ["HetSeqFabric", "HetSeqFabricStrategy"]
