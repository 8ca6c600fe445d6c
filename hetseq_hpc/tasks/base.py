"""The public task API: what the trainer needs from a task (data, model, loss, metrics).

A task owns its data, its model and its loss. Write your own by subclassing :class:`Task`
(``docs/tasks.md`` is the guide, with a complete worked example) and run it with
``python -m hetseq_hpc task=custom task.target=<module>.<Class>``.

The one rule that makes uneven per-rank batches exact: the model's ``forward(**batch)``
returns the SUM of the losses of the batch's *loss units* (samples, target tokens, masked
tokens ...), and :meth:`Task.count` says how many units a batch holds before any forward pass.
The trainer adds the sums and the counts of every rank and divides once by the GLOBAL count,
so one optimizer step equals one step on the whole global batch however it was split.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hetseq_hpc.tasks.planning import PlanningModel, from_data


class Task(abc.ABC):
    """Base class of every task (BERT, image, translation and user tasks).

    Args:
        cfg: the ``task`` config group (a dataclass; for ``task=custom`` a
            :class:`~hetseq_hpc.config.tasks.CustomTaskConfig` whose ``args`` and ``model`` are
            plain dicts of your own options).
        seed: ``trainer.seed``: draw every random choice of the data (masking, augmentation)
            from it, the epoch and the sample's position, never from the rank.

    Lifecycle on every rank: ``__init__`` -> (rank 0 only) :meth:`prepare` -> barrier ->
    :meth:`load` -> ``torch.manual_seed(seed)``; :meth:`build_model` -> training, which calls
    :meth:`make_batch`, :meth:`count` and ``model(**batch)``; validation calls
    :meth:`evaluate_batch` and :meth:`finalize_metrics`.

    Must implement: :meth:`load`, :attr:`num_train`, :attr:`num_val`, :meth:`build_model`,
    :meth:`make_batch`, :meth:`count`. Everything else has a working default.
    """

    #: the task's name in logs and ``summary.json``
    name: str = "task"
    #: what one loss unit is, plural (``units_per_s`` in ``metrics.jsonl`` counts these)
    unit_name: str = "samples"

    def __init__(self, cfg: Any, seed: int):
        self.cfg = cfg
        self.seed = seed

    # ------------------------------------------------------------------ data
    def prepare(self) -> None:
        """Build caches (tokenizers, decoded arrays) once. Runs on rank 0 while the other
        ranks wait; write files atomically (:mod:`hetseq_hpc.files.atomic`). Default: nothing."""
        return None

    @abc.abstractmethod
    def load(self) -> None:
        """Open the prepared data (every rank, after :meth:`prepare`)."""

    def loaded(self, data: Any) -> Any:
        """``data`` (what :meth:`load` stored), or a one-line error when it is still None.

        Raises:
            DataError: the task's data is used before :meth:`load` ran.
        """
        if data is None:
            from hetseq_hpc.errors import DataError

            raise DataError(f"{self.name} data used before load(): call prepare() then load()")
        return data

    @property
    @abc.abstractmethod
    def num_train(self) -> int:
        """Training samples (positions ``0 .. num_train - 1``)."""

    @property
    @abc.abstractmethod
    def num_val(self) -> int:
        """Validation samples (positions ``0 .. num_val - 1``); 0 = no validation."""

    @property
    def units_per_sample(self) -> float:
        """Mean loss units per training sample, for ``units_per_s`` (default 1: one unit per
        sample)."""
        return 1.0

    @property
    def tokens_per_sample(self) -> float:
        """Alias of :attr:`units_per_sample` (``tokens_per_s`` in ``metrics.jsonl``)."""
        return self.units_per_sample

    @property
    def data_summary(self) -> Dict[str, Any]:
        """What data was used (source, sizes), for the log and ``summary.json``; default
        ``{}``."""
        return {}

    @abc.abstractmethod
    def make_batch(
        self, positions: Sequence[int], epoch: int, split: str
    ) -> Dict[str, torch.Tensor]:
        """The batch of ``positions`` (0-based within ``split``, ``"train"`` or ``"val"``).

        Must be a pure function of ``(positions, epoch, split)`` and the seed: row ``i`` of
        every tensor depends only on ``positions[i]`` (so any cut of a global batch into
        per-rank micro-batches gives the same rows). Every value is a tensor whose first
        dimension is ``len(positions)``; the dict is passed as ``model(**batch)``.
        """

    @abc.abstractmethod
    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        """Loss units in ``batch`` (the normaliser), from the batch alone, before the forward
        pass; > 0 for a non-empty batch."""

    # ------------------------------------------------------------------ model
    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model on the CPU (the caller seeds the RNG first; every rank
        must build the same weights). ``forward(**batch)`` returns a 0-dim floating tensor:
        the SUM of the losses of the batch's units. No BatchNorm (see
        :mod:`hetseq_hpc.tasks.norms`); put dropout behind ``task.model.dropout``."""

    def flops_per_sample(self, model: nn.Module) -> Optional[float]:
        """Training FLOPs (forward + backward) of one sample, or ``None`` (default) to let
        hetseq_hpc measure them with ``torch.utils.flop_counter.FlopCounterMode`` on one
        batch (:func:`hetseq_hpc.tasks.flops.task_flops_per_sample`)."""
        return None

    def planning_model(self, on_meta: bool = False) -> PlanningModel:
        """The model and a batch maker for the planner (``hetseq-hpc plan``), which reads the
        model's parameters, FLOPs and activation memory from them and times the batches.
        ``on_meta``: nothing will run, the model may be built on the ``meta`` device. Default
        (:func:`hetseq_hpc.tasks.planning.from_data`): :meth:`prepare`, :meth:`load`,
        :meth:`build_model` and real training batches; override it when the model is known from
        the config alone (``BertTask`` builds BERT without its data)."""
        return from_data(self)

    def data_fingerprint(self) -> Optional[str]:
        """A digest of what :meth:`prepare` made of the data, when two prepares of the same
        files may differ (a trained tokenizer), or None (default: the files and config decide
        the data). A resume refuses a checkpoint trained on another (``data.fingerprint`` in
        the run's fingerprint, :mod:`hetseq_hpc.train.state`)."""
        return None

    def sharding_units(self, model: nn.Module) -> List[nn.Module]:
        """The submodules FSDP shards separately under ``sharding.mode=fsdp`` (each is
        all-gathered whole while it computes; the rest of the model forms the root unit).
        Default: :func:`default_sharding_units` (transformer blocks / residual blocks). Weights
        tied between two modules must stay in the same unit."""
        return default_sharding_units(model)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def evaluate_batch(
        self, model: nn.Module, batch: Dict[str, torch.Tensor], positions: Sequence[int]
    ) -> Dict[str, float]:
        """ADDITIVE validation statistics of one batch of validation ``positions``; the
        trainer sums them over batches and ranks, then calls :meth:`finalize_metrics`.

        Default: ``{"loss_sum": model(**batch), "units": count(batch)}``.
        """
        return {"loss_sum": float(model(**batch)), "units": float(self.count(batch))}

    def evaluates_in_fixed_passes(self) -> bool:
        """Whether :meth:`evaluate_batch` runs the model's ``forward`` the same number of times
        for every batch (and calls nothing else of the model). Then an FSDP run validates on
        the shards, every rank running as many batches, one unit gathered at a time, and never
        holds the whole weights; otherwise (decoding step by step, calling other methods of the
        model) the whole weights are gathered on every rank for validation. Default: True for
        the default :meth:`evaluate_batch` (one forward), False when it is overridden (say True
        in your override when it holds)."""
        return type(self).evaluate_batch is Task.evaluate_batch

    def finalize_metrics(self, sums: Dict[str, float]) -> Dict[str, float]:
        """Metrics from the summed statistics; names start with ``val_`` (they land in
        ``metrics.jsonl`` and ``summary.json``). Default: ``val_loss`` (mean loss per unit)
        and ``val_ppl`` (its exponential, capped at e^50)."""
        loss = sums.get("loss_sum", 0.0) / max(sums.get("units", 0.0), 1.0)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def examples(self, model: nn.Module, n: int = 3) -> List[Tuple[str, ...]]:
        """A few human-readable predictions for the end of rank 0's log (default: none)."""
        return []


def default_sharding_units(model: nn.Module) -> List[nn.Module]:
    """The blocks of a model, as FSDP wraps them (torchtitan shards each transformer block):
    every entry of every ``nn.ModuleList`` that holds parameters (transformer layers), else
    every composite entry (one with parameterised submodules) of every ``nn.Sequential``
    (residual blocks). Outermost first; a block inside a chosen block is not chosen again."""

    def has_params(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        candidates = [e for lst in lists for e in lst if has_params(e)]
    else:
        candidates = [
            e
            for seq in model.modules()
            if isinstance(seq, nn.Sequential)
            for e in seq
            if any(has_params(c) for c in e.children())
        ]
    chosen: List[nn.Module] = []
    for unit in candidates:
        if unit is not model and not any(unit is c or _contains(c, unit) for c in chosen):
            chosen.append(unit)
    return chosen


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


__all__ = ["Task", "default_sharding_units"]
