"""Plan a heterogeneous run before submitting it: predicted split, step time and efficiency.

``python -m hetseq_hpc.plan cluster=mixed task=bert trainer.global_batch_size=4096`` (usage and
options: :mod:`hetseq_hpc.plan.command`). The modules, one job each:

- :mod:`~hetseq_hpc.config.plan`: the ``plan`` config group (:class:`PlanConfig`, validated);
- :mod:`~hetseq_hpc.plan.gpus`: GPU classes by GRES type (from :mod:`~hetseq_hpc.plan.gpu_specs`); :mod:`~hetseq_hpc.plan.perf_model`: achieved rates;
- :mod:`~hetseq_hpc.plan.step_time`: throughput, ring all-reduce, DDP overlap, :func:`predict`;
- :mod:`~hetseq_hpc.plan.model_info`: the task model's parameters, FLOPs and activation memory;
- :mod:`~hetseq_hpc.plan.inputs`: per-rank inputs from a probe or from the GPU spec model;
- :mod:`~hetseq_hpc.plan.planner`: run config -> :class:`Plan` (with warnings);
- :mod:`~hetseq_hpc.plan.render`: the printed table and the JSON headline;
- :mod:`~hetseq_hpc.plan.command`: the command line.

Nothing here imports :mod:`hetseq_hpc.config` at import time (it imports
:mod:`hetseq_hpc.config.plan` for ``RunConfig.plan``). The names below load their module when
first used: a rank or a command that needs one GPU table entry does not import the planner.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any, Callable, Dict

#: each public name and the module that defines it (imported on first use, PEP 562)
_HOMES: Dict[str, str] = {
    "memory_cap": "hetseq_hpc.balance.memory:param_memory_cap",
    "PlanConfig": "hetseq_hpc.config.plan",
    "register_plan_config": "hetseq_hpc.config.plan",
    "compose_plan_run": "hetseq_hpc.plan.command",
    "plan_command": "hetseq_hpc.plan.command",
    "plan_overrides": "hetseq_hpc.plan.command",
    "normalise_gpu_type": "hetseq_hpc.plan.gpu_specs",
    "GPU_TABLE": "hetseq_hpc.plan.gpus",
    "GpuClass": "hetseq_hpc.plan.gpus",
    "lookup_gpu": "hetseq_hpc.plan.gpus",
    "runtime_precision": "hetseq_hpc.plan.gpus",
    "PartitionSpec": "hetseq_hpc.plan.inputs",
    "RankSpec": "hetseq_hpc.plan.inputs",
    "probe_sync_s": "hetseq_hpc.plan.inputs",
    "ranks_from_probe": "hetseq_hpc.plan.inputs",
    "ranks_from_table": "hetseq_hpc.plan.inputs",
    "ModelInfo": "hetseq_hpc.plan.model_info",
    "measure_model": "hetseq_hpc.plan.model_info",
    "Plan": "hetseq_hpc.plan.planner",
    "make_plan": "hetseq_hpc.plan.planner",
    "DDP_BUCKET_BYTES": "hetseq_hpc.plan.step_time",
    "Prediction": "hetseq_hpc.plan.step_time",
    "SplitTime": "hetseq_hpc.plan.step_time",
    "datasheet_throughput": "hetseq_hpc.plan.step_time",
    "ddp_exposed_allreduce_s": "hetseq_hpc.plan.step_time",
    "predict": "hetseq_hpc.plan.step_time",
    "ring_allreduce_s": "hetseq_hpc.plan.step_time",
}

__all__ = sorted([*_HOMES, "render"])


def __getattr__(name: str) -> Any:
    """A public name of the package, from its module, or a submodule (``plan.planner``, as
    the eager package gave them): imported now, then kept here.

    Raises:
        AttributeError: ``name`` is neither one of :data:`__all__` nor a submodule.
    """
    home = _HOMES.get(name)
    if home is None:
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    module, _, attr = home.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value


class _PlanPackage(types.ModuleType):
    """This package's module type: ``render`` is the function
    :func:`hetseq_hpc.plan.render.render` (as the eager package bound it), not the submodule
    of the same name that the import system binds here when it first loads it."""

    @property
    def render(self) -> Callable[..., str]:
        """:func:`hetseq_hpc.plan.render.render` (imported on first use)."""
        return importlib.import_module("hetseq_hpc.plan.render").render

    @render.setter
    def render(self, value: Any) -> None:
        """The submodule being bound here: ``render`` stays the function."""


sys.modules[__name__].__class__ = _PlanPackage
