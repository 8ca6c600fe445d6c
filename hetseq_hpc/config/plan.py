"""The planner's options: the ``plan`` config group (``plan.KEY=VALUE`` on any command line).

``conf/plan/default.yaml`` selects :class:`PlanConfig`; ``conf/config.yaml`` includes it, so
``plan.*`` overrides compose (and are validated) for ``python -m hetseq_hpc`` too, where they
are recorded in ``hetseq_config.yaml`` and otherwise ignored. Only ``python -m hetseq_hpc.plan``
reads them.

This module imports nothing from :mod:`hetseq_hpc.config` (which imports it for ``RunConfig``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from hetseq_hpc.errors import ConfigError

#: model FLOPs utilisation assumed against the datasheet peak when nothing is measured
DEFAULT_MFU = 0.35
#: network bandwidth per rank: InfiniBand EDR (4x 25 Gbit/s) on SLURM clusters
DEFAULT_LINK_GBPS = 100.0
#: gloo over loopback TCP on one machine (cluster=local), a rough figure
DEFAULT_LOCAL_LINK_GBPS = 20.0
#: latency of one ring step, microseconds
DEFAULT_LATENCY_US = 10.0
#: all-reduce overlap model: DDP's bucketed overlap with the last backward
DEFAULT_OVERLAP = "ddp"
#: ``plan.peak`` choices
PEAKS = ("runtime", "tensor")
#: ``plan.when``: seconds from a job's start to its first training step (interpreter and torch
#: imports, rendezvous, calibration), assumed when nothing better is known
DEFAULT_STARTUP_S = 90.0
#: ``plan.when``: checkpoint write bandwidth, GB/s (one parallel-file-system client)
DEFAULT_CHECKPOINT_GB_S = 1.0
#: ``plan.when``: most candidate mixes asked of Slurm (one ``sbatch --test-only`` each)
DEFAULT_MAX_MIXES = 32


def _number(key: str, value: Any, ok, rule: str) -> float:
    """``value`` as a finite float accepted by ``ok``; else a one-line ConfigError for ``plan.key``."""
    if isinstance(value, bool):
        raise ConfigError(f"plan.{key}={value} is not a number: give {rule}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"plan.{key}={value!r} is not a number: give {rule}") from None
    if not (math.isfinite(number) and ok(number)):
        raise ConfigError(f"plan.{key}={value} is out of range: give {rule}")
    return number


@dataclass
class PlanConfig:
    """Options of ``python -m hetseq_hpc.plan`` (group ``plan``).

    Errors (raised by ``__post_init__`` when the composed config becomes objects, one line
    naming the key and the fix): :class:`~hetseq_hpc.errors.ConfigError`. Whether ``probe``
    exists is checked when the planner reads it (:func:`hetseq_hpc.plan.inputs.load_probe`), so
    a saved ``hetseq_config.yaml`` stays loadable after the probe file is gone.
    """

    # allocation.json (or its run directory) of an earlier run: plan from its measured per-rank
    # calibration instead of the GPU spec model; null = spec model (SLURM) / this CPU (local)
    probe: Optional[str] = None
    # network bandwidth per rank for the all-reduce, Gbit/s; null = 100 (SLURM) or 20 (local)
    link_gbps: Optional[float] = None
    # latency of one ring all-reduce step, microseconds
    latency_us: float = DEFAULT_LATENCY_US
    # model FLOPs utilisation against the peak, in (0, 1]; kept for saved configs: the GPU spec
    # model (hetseq_hpc/plan/perf_model.py, docs/planner-accuracy.md) rates every known GPU
    mfu: float = DEFAULT_MFU
    # all-reduce hidden behind backward: ddp (DDP's 25 MiB buckets overlap the last micro-batch's
    # backward) or a fixed fraction in [0, 1] (0 = nothing overlaps, a lower bound)
    overlap: Any = DEFAULT_OVERLAP
    # runtime = the precision the runtime picks (bf16 on compute capability >= 8.0, fp16 on 7.x);
    # tensor = every GPU at its tensor-core peak (fp16 on V100/T4)
    peak: str = "runtime"
    # time to result (hetseq-hpc plan --when): enumerate partition mixes, ask Slurm when each
    # would start (sbatch --test-only, nothing submitted) and rank them by predicted finish
    when: bool = False
    # seconds from a job's start to its first step (imports, rendezvous, calibration), >= 0
    startup_s: float = DEFAULT_STARTUP_S
    # checkpoint write bandwidth in GB/s for the checkpoint cost of a run, > 0
    checkpoint_gb_s: float = DEFAULT_CHECKPOINT_GB_S
    # most candidate mixes plan.when asks Slurm about (node counts are thinned above it), >= 1
    max_mixes: int = DEFAULT_MAX_MIXES
    # milliseconds per sample a rank spends building its batches before its passes, added to
    # every rank rated from GPU specs; null = the task's batch function timed on this machine;
    # 0 = none (e.g. a loader that runs beside the GPU), >= 0
    data_ms_per_sample: Optional[float] = None

    def __post_init__(self) -> None:
        if self.probe is not None and not str(self.probe).strip():
            raise ConfigError(
                "plan.probe is empty: write plan.probe=RUN_DIR/allocation.json, "
                "or leave it out to use the GPU spec model"
            )
        if self.link_gbps is not None:
            self.link_gbps = _number(
                "link_gbps",
                self.link_gbps,
                lambda x: x > 0,
                "a bandwidth > 0 in Gbit/s, e.g. plan.link_gbps=100",
            )
        self.latency_us = _number(
            "latency_us",
            self.latency_us,
            lambda x: x >= 0,
            "microseconds >= 0, e.g. plan.latency_us=10",
        )
        self.mfu = _number(
            "mfu", self.mfu, lambda x: 0 < x <= 1, "a fraction in (0, 1], e.g. plan.mfu=0.35"
        )
        if self.overlap != "ddp":
            self.overlap = _number(
                "overlap",
                self.overlap,
                lambda x: 0 <= x <= 1,
                "ddp or a fraction in [0, 1], e.g. plan.overlap=0 for no overlap at all",
            )
        if self.peak not in PEAKS:
            raise ConfigError(f"plan.peak={self.peak!r} is unknown: use runtime or tensor")
        if not isinstance(self.when, bool):
            raise ConfigError(
                f"plan.when={self.when!r} is not a boolean: use plan.when=true or plan.when=false"
            )
        self.startup_s = _number(
            "startup_s", self.startup_s, lambda x: x >= 0, "seconds >= 0, e.g. plan.startup_s=90"
        )
        self.checkpoint_gb_s = _number(
            "checkpoint_gb_s",
            self.checkpoint_gb_s,
            lambda x: x > 0,
            "a bandwidth > 0 in GB/s, e.g. plan.checkpoint_gb_s=1",
        )
        mixes = _number(
            "max_mixes",
            self.max_mixes,
            lambda x: x >= 1 and float(x).is_integer(),
            "a whole number >= 1, e.g. plan.max_mixes=32",
        )
        self.max_mixes = int(mixes)
        if self.data_ms_per_sample is not None:
            self.data_ms_per_sample = _number(
                "data_ms_per_sample",
                self.data_ms_per_sample,
                lambda x: x >= 0,
                "milliseconds >= 0, e.g. plan.data_ms_per_sample=0.05, or null to time the "
                "task's batch function here",
            )

    @property
    def latency_s(self) -> float:
        """``latency_us`` in seconds."""
        return self.latency_us * 1e-6


def plan_keys() -> tuple:
    """The option names of the ``plan`` group, in schema order."""
    return tuple(f.name for f in fields(PlanConfig))


def register_plan_config(config_store: Any = None) -> None:
    """Store :class:`PlanConfig` as ``plan/plan_schema`` in Hydra's ConfigStore (idempotent);
    ``conf/plan/default.yaml`` starts from it. Called by
    :func:`hetseq_hpc.config.register_configs`."""
    if config_store is None:
        from hydra.core.config_store import ConfigStore

        config_store = ConfigStore.instance()
    config_store.store(group="plan", name="plan_schema", node=PlanConfig)
