"""Hugging Face accelerate with uneven exact batches: :class:`HetSeqAccelerate`, the documented
recipe as a helper (:class:`~hetseq_hpc.integrations.loop.StepRunner` on accelerate's
backward, ``no_sync`` and device)::

    accelerator = Accelerator()                      # gradient_accumulation_steps stays 1
    model, optimizer = accelerator.prepare(model, optimizer)   # NOT the training loader
    hetseq = HetSeqAccelerate(accelerator, model, global_batch_size=32)  # the SUM hook
    loader = hetseq.setup_dataloader(loader, accelerator.unwrap_model(model), loss_fn)
    for batch in loader:
        loss = hetseq.backward(model, batch, loss_fn)   # not accelerator.backward(loss_fn(...))
        optimizer.step()
        optimizer.zero_grad()

Launch with ``torchrun`` on one node, or ``srun`` (``hetseq-hpc run`` with ``cluster.command``)
on a mixed node layout: ``accelerate launch`` starts the same number of processes on every
node. accelerate's ``prepare()`` of the training loader would give every rank equal batches
(``BatchSamplerShard``), and its accumulation divides by one global count: both refused here.
Pitfalls: docs/integrations.md.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.integrations.engine import HetSeqSettings, cpu_group, rendezvous_of
from hetseq_hpc.integrations.loop import StepRunner, register_sum_hook


class HetSeqAccelerate(StepRunner):
    """:class:`~hetseq_hpc.integrations.loop.StepRunner` on an ``Accelerator``; registers
    the SUM hook on the prepared (DDP) model.

    Args:
        accelerator: the ``Accelerator`` (one process per rank, torchrun or srun).
        model: the model as ``accelerator.prepare`` returned it.
        global_batch_size, allocation, units_fn: as :class:`~hetseq_hpc.integrations.
            lightning.HetSeqStrategy`'s; further keywords: :class:`~hetseq_hpc.integrations.
            engine.HetSeqSettings`.

    Raises:
        ConfigError: ``gradient_accumulation_steps != 1``, a model with its own comm hook, or
            a setting is invalid.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        global_batch_size: int,
        allocation: Optional[Sequence[int]] = None,
        units_fn: Optional[Callable[[Any], Any]] = None,
        **settings: Any,
    ):
        if accelerator.gradient_accumulation_steps != 1:
            raise ConfigError(
                f"Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps})"
                " with HetSeqAccelerate: accumulation is per rank here (each rank's share of "
                "global_batch_size in micro-batches); leave it at 1 and set global_batch_size "
                "(and max_micro_batch)"
            )
        if not dist.is_initialized():  # one process: accelerate made no process group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        hook = register_sum_hook(model)
        rdv = rendezvous_of(
            accelerator.process_index,
            accelerator.local_process_index,
            accelerator.num_processes,
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", "1") or 1),
            cpu_group(dist.get_backend()),
            source="accelerate",
        )
        device = accelerator.device
        super().__init__(
            HetSeqSettings(
                global_batch_size=global_batch_size,
                allocation=tuple(allocation) if allocation is not None else None,
                **settings,
            ),
            rdv,
            backward=accelerator.backward,
            no_sync=accelerator.no_sync,
            to_device=lambda batch: send_to_device(batch, device),
            device=device,
            units_fn=units_fn,
            autocast=accelerator.autocast,
            hook_state=lambda: hook,
        )


__all__ = ["HetSeqAccelerate"]
