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
:mod:`hetseq_hpc.config.plan` for ``RunConfig.plan``).
"""

from hetseq_hpc.balance.memory import param_memory_cap as memory_cap
from hetseq_hpc.config.plan import PlanConfig, register_plan_config
from hetseq_hpc.plan.command import compose_plan_run, plan_command, plan_overrides
from hetseq_hpc.plan.gpu_specs import normalise_gpu_type
from hetseq_hpc.plan.gpus import (
    GPU_TABLE,
    GpuClass,
    lookup_gpu,
    runtime_precision,
)
from hetseq_hpc.plan.inputs import (
    PartitionSpec,
    RankSpec,
    probe_sync_s,
    ranks_from_probe,
    ranks_from_table,
)
from hetseq_hpc.plan.model_info import ModelInfo, measure_model
from hetseq_hpc.plan.planner import Plan, make_plan
from hetseq_hpc.plan.render import render
from hetseq_hpc.plan.step_time import (
    DDP_BUCKET_BYTES,
    Prediction,
    SplitTime,
    datasheet_throughput,
    ddp_exposed_allreduce_s,
    predict,
    ring_allreduce_s,
)

__all__ = [
    "DDP_BUCKET_BYTES",
    "GPU_TABLE",
    "GpuClass",
    "ModelInfo",
    "PartitionSpec",
    "Plan",
    "PlanConfig",
    "Prediction",
    "RankSpec",
    "SplitTime",
    "compose_plan_run",
    "datasheet_throughput",
    "ddp_exposed_allreduce_s",
    "lookup_gpu",
    "make_plan",
    "measure_model",
    "memory_cap",
    "normalise_gpu_type",
    "plan_command",
    "plan_overrides",
    "predict",
    "probe_sync_s",
    "ranks_from_probe",
    "ranks_from_table",
    "register_plan_config",
    "render",
    "ring_allreduce_s",
    "runtime_precision",
]
