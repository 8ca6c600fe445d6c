"""What the planner needs from the task's real model: parameters, FLOPs, activation memory.

Every task is asked for its model and a batch maker (:meth:`hetseq_hpc.tasks.Task.planning_model`,
:mod:`hetseq_hpc.tasks.planning`): BERT builds its model from its config alone, on the ``meta``
device when nothing is measured (no memory, no time), with random token rows masked by its own
rule; every other task (image, translation, a user's) sizes its model from its data (classes,
vocabulary), prepared and loaded as a run would, and real training samples are measured. FLOPs
come from the task's formula, else ``FlopCounterMode`` (:mod:`hetseq_hpc.tasks.flops`). The host
time of building a batch (the task's own batch function) is timed here (:func:`batch_build_s`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from hetseq_hpc.balance.memory import PARAM_BYTES, model_bytes

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.tasks.planning import EncoderShape


@dataclass
class ModelInfo:
    """The task model's planning figures."""

    param_count: int
    flops_per_sample: float  # training FLOPs of one sample (the task's flops_per_sample)
    activation_bytes_per_sample: float = 0.0  # measured on the CPU (fp32), with safety margin
    cpu_samples_per_s: float = 0.0  # measured on the CPU (cluster=local only)
    vocab_size: int = 0
    # where vocab_size comes from, as the plan prints it: the config field that sets it, or
    # "its data" (a task whose data decides its vocabulary)
    vocab_from: str = "task.data.vocab_size"
    notes: List[str] = field(default_factory=list)
    largest_unit_params: int = 0  # parameters of the largest FSDP block (a sharding unit)
    # parameters of the FSDP root unit (outside every block); None = not known
    root_params: Optional[int] = None
    # validation runs on the shards under FSDP (Task.evaluates_in_fixed_passes); False: the
    # whole weights are gathered for it, and FSDP's memory counts them
    evaluates_sharded: bool = False
    # parameter tensors (the spec model's fixed cost per pass scales with them,
    # hetseq_hpc.plan.perf_model.pass_overhead_s); 0 = not known
    param_tensors: int = 0
    # element accesses of one sample's memory-bound operations (the spec model's memory term,
    # hetseq_hpc.plan.perf_model): counted from the architecture for BERT, else from the
    # measured activations; 0 = not known (matmul time only)
    accesses_per_sample: float = 0.0
    accesses_from: str = "as given"  # how accesses_per_sample was found, as the plan prints it
    # host seconds per training sample of building its batch (the task's make_batch, timed on
    # this machine: batch_build_s); 0 = none
    data_s_per_sample: float = 0.0
    data_from: str = "the task's batch function timed on this machine"

    @property
    def gradient_bytes(self) -> float:
        """Bytes all-reduced per step: fp32 gradients of every parameter."""
        return float(self.param_count * PARAM_BYTES)


@dataclass(frozen=True)
class CpuCalibration:
    """How cluster=local ranks calibrate (the runtime's values, :mod:`hetseq_hpc.balance.placement`)."""

    micro_batch: int  # samples per timed forward+backward
    steps: int  # timed steps
    threads: int  # torch threads per rank
    budget_bytes: float  # memory budget per rank


#: samples per timed batch build (:func:`batch_build_s`)
DATA_TIMING_SAMPLES = 32
#: timed builds after one untimed one; the fastest counts (noise on a shared host only adds)
DATA_TIMING_REPEATS = 3
#: a build slower than this many seconds is not repeated
DATA_TIMING_BUDGET_S = 2.0


def batch_build_s(
    make: Callable[[int], Dict[str, Any]], samples: int = DATA_TIMING_SAMPLES
) -> float:
    """Host seconds per sample of building a training batch with ``make`` (``n -> batch``):
    one build of 2 samples (warm-up; the measurement itself if it takes over a quarter of
    :data:`DATA_TIMING_BUDGET_S`), then the fastest of :data:`DATA_TIMING_REPEATS` builds of
    ``samples``, divided by the rows each returned (a small data set may give fewer).

    Each rank builds its batches in its training loop, before its passes and not overlapped
    with them (:meth:`hetseq_hpc.train.trainer.Trainer.train_step`, ``data_time_s`` in
    metrics.jsonl), so this time adds to every sample's. The runtime's calibration includes it
    (:func:`hetseq_hpc.balance.calibrate.calibrate` times ``make_batch`` with each pass); the
    GPU spec model, fitted on published figures whose loaders ran beside the GPU, does not.
    Measured on the machine that plans, not on the cluster's nodes.
    """
    start = time.perf_counter()
    make(2)
    if time.perf_counter() - start > DATA_TIMING_BUDGET_S / 4:  # slow: this is measurement enough
        return (time.perf_counter() - start) / 2
    best = float("inf")
    for _ in range(DATA_TIMING_REPEATS):
        start = time.perf_counter()
        batch = make(samples)
        took = time.perf_counter() - start
        rows = max(int(next(iter(batch.values())).shape[0]), 1) if batch else 1
        best = min(best, took / rows)
        if took > DATA_TIMING_BUDGET_S:
            break
    return best


#: measured models of this process: (task config, need_activations) -> ModelInfo
_MEASURED: dict = {}


def measure_model(
    task_cfg,
    need_activations: bool,
    cpu_calibration: Optional[CpuCalibration] = None,
    time_batches: bool = False,
) -> ModelInfo:
    """:func:`measure_task_model`, measured once per task configuration in a process (``plan
    --when`` plans many mixes of one model); a CPU calibration (timed) always runs again.
    Returns a copy: callers may change it."""
    from dataclasses import replace

    if cpu_calibration is not None:
        return measure_task_model(task_cfg, need_activations, cpu_calibration, time_batches)
    key = (repr(task_cfg), bool(need_activations), bool(time_batches))
    if key not in _MEASURED:
        _MEASURED[key] = measure_task_model(task_cfg, need_activations, time_batches=time_batches)
    return replace(_MEASURED[key])


def vocab_source(task_cfg: Any, vocab_size: int) -> str:
    """Where the planned vocabulary of ``vocab_size`` tokens came from, as the plan prints it:
    ``task.data.vocab_size``, the prepared tokenizer (fewer tokens than that ceiling), or the
    task's data (a task without the key)."""
    ceiling = getattr(getattr(task_cfg, "data", None), "vocab_size", None)
    if ceiling is None:
        return "its data"
    if vocab_size and vocab_size != int(ceiling):
        return f"its prepared tokenizer; task.data.vocab_size={int(ceiling)} is the ceiling"
    return "task.data.vocab_size"


def measure_task_model(
    task_cfg,
    need_activations: bool,
    cpu_calibration: Optional[CpuCalibration] = None,
    time_batches: bool = False,
) -> ModelInfo:
    """Build the task's real model and read its parameter count, its training FLOPs per sample
    (the task's formula, else measured with ``FlopCounterMode``:
    :func:`hetseq_hpc.tasks.flops.task_flops_per_sample`), and, if asked, the activation bytes of
    one sample (saved-tensors hook, forward passes at batch 1 and 2, x the runtime's safety
    margin). The model and the batches are the task's
    (:meth:`~hetseq_hpc.tasks.Task.planning_model`: on ``meta`` when nothing is measured, where
    the task can).

    ``cpu_calibration`` instead runs :func:`hetseq_hpc.balance.calibrate.calibrate` (timed
    forward+backward, as a cluster=local rank does) and also sets ``cpu_samples_per_s``.
    ``time_batches`` also times building a batch (:func:`batch_build_s`: ``data_s_per_sample``,
    which the GPU spec model's ranks need and measured ranks already include).

    Raises:
        ConfigError / DataError: the task's data cannot be found or read.
    """
    import torch

    from hetseq_hpc.balance.calibrate import ACTIVATION_SAFETY, saved_tensor_bytes
    from hetseq_hpc.tasks import build_task
    from hetseq_hpc.tasks.flops import task_flops_per_sample

    task = build_task(task_cfg, seed=0)
    torch.manual_seed(0)
    planning = task.planning_model(on_meta=not need_activations and cpu_calibration is None)
    model, make = planning.model, planning.make_batch
    sizes = model_bytes(task, model)
    count = sum(p.numel() for p in model.parameters())

    def params(nbytes: float) -> int:
        return round(count * nbytes / max(sizes.total, 1))

    info = ModelInfo(
        param_count=count,
        flops_per_sample=task_flops_per_sample(task, model, on_meta=True),  # shapes suffice
        vocab_size=planning.vocab_size,
        vocab_from=vocab_source(task_cfg, planning.vocab_size),
        notes=list(planning.notes),
        largest_unit_params=params(sizes.block),
        root_params=params(sizes.root),
        evaluates_sharded=bool(task.evaluates_in_fixed_passes()),
        param_tensors=sum(1 for _ in model.parameters()),
    )
    if time_batches:
        info.data_s_per_sample = batch_build_s(make)

    if cpu_calibration is not None:
        from hetseq_hpc.balance.calibrate import calibrate

        threads = torch.get_num_threads()
        torch.set_num_threads(cpu_calibration.threads)
        try:
            cal = calibrate(
                model,
                make,
                torch.device("cpu"),
                cpu_calibration.micro_batch,
                cpu_calibration.steps,
                cpu_calibration.budget_bytes,
            )
        finally:
            torch.set_num_threads(threads)
        info.cpu_samples_per_s = cal.samples_per_s
        info.activation_bytes_per_sample = cal.activation_bytes_per_sample
    elif need_activations:
        model.train()
        saved = []
        for n in (1, 2):
            batch = make(n)
            loss, nbytes = saved_tensor_bytes(lambda: model(**batch))  # noqa: B023
            del loss
            saved.append(nbytes)
        info.activation_bytes_per_sample = max(saved[1] - saved[0], 0) * ACTIVATION_SAFETY
    info.accesses_per_sample, info.accesses_from = _accesses_per_sample(
        planning.encoder, info.activation_bytes_per_sample
    )
    return info


def _accesses_per_sample(
    encoder: Optional[EncoderShape], activation_bytes_per_sample: float
) -> Tuple[float, str]:
    """``(element accesses of one sample's memory-bound operations, how they were found)``:
    counted from the encoder shape the task gives
    (:func:`hetseq_hpc.plan.perf_model.transformer_accesses`; BERT's attention is fused: its
    encoder calls ``scaled_dot_product_attention``, a fused kernel on a GPU), else from the
    measured fp32 activations without their safety margin
    (:func:`hetseq_hpc.plan.perf_model.accesses_from_activations`; 0 when none were measured)."""
    from hetseq_hpc.balance.calibrate import ACTIVATION_SAFETY
    from hetseq_hpc.plan.perf_model import accesses_from_activations, transformer_accesses

    if encoder is not None:
        e = encoder
        return (
            transformer_accesses(
                e.layers,
                e.hidden,
                e.heads,
                e.seq_len,
                e.intermediate,
                fused_attention=e.fused_attention,
            ),
            f"counted from the {e.name} shape" + (", fused attention" * e.fused_attention),
        )
    return (
        accesses_from_activations(activation_bytes_per_sample / ACTIVATION_SAFETY),
        "from its saved activations",
    )
