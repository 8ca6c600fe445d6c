"""``task=dataset``: any map-style ``torch.utils.data.Dataset`` plus a model, as a Task.

The user writes one function (``task.target=my_data:build`` or ``my_data.build``)::

    def build(dropout=0.1, **args):           # task.args.*; task.model.dropout if it takes dropout
        return {"train": MyDataset("train"),   # required: len() and [i]
                "val": MyDataset("val"),       # optional (else task.val_fraction of train)
                "model": MyModel(dropout),     # an nn.Module, or a function building one
                "collate_fn": my_collate,      # optional: list of items -> dict of tensors
                "count": my_count,             # optional: batch -> int loss units
                "loss_fn": my_loss}            # optional: (model, batch) -> SUM of losses

Positions become items (``dataset[i]``), ``collate_fn`` turns them into the batch (torch's
``default_collate`` by default; it must pad to a fixed width, not to the longest item), ``count``
gives the loss units (default: the samples), and ``model(**batch)`` (or ``loss_fn(model,
batch)``) returns the SUM of the unit losses. The same build function works from Python with
:func:`dataset_task_class`.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from hetseq_hpc.errors import ConfigError, TaskContractError
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.custom import _failed_import, _missing_module


def resolve_build(target: str, path: Optional[str] = None) -> Callable[..., Any]:
    """The function ``target`` names (``module:function`` or ``module.function``).

    Raises:
        ConfigError: malformed, not importable (names the file and line), or no such callable.
    """
    module_name, sep, func = target.partition(":")
    if not sep:
        module_name, _, func = target.rpartition(".")
    if not module_name or not func.isidentifier():
        raise ConfigError(
            f"task.target={target!r} is not <module>:<function>: e.g. task.target=my_data:build"
        )
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _missing_module(target, module_name, exc) from None
    except (Exception, SystemExit) as exc:
        raise _failed_import(target, module_name, exc) from None
    build = getattr(module, func, None)
    if not callable(build):
        raise ConfigError(
            f"task.target={target!r}: module {module_name!r} has no function "
            f"{func!r}: define def {func}(**args) returning {{'train': ..., "
            "'model': ...}"
        )
    return build


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing extra
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in params
    )


def build_args(build: Callable[..., Any], cfg: Any) -> Dict[str, Any]:
    """The keyword arguments of ``build``: ``task.args``, plus ``dropout=task.model.dropout``
    when ``build`` takes a ``dropout`` argument (or ``**kwargs``).

    Raises:
        ConfigError: ``build`` does not take one of the ``task.args`` keys (one line).
    """
    args = dict(getattr(cfg, "args", {}) or {})
    target = getattr(cfg, "target", None) or getattr(build, "__name__", "build")
    for key in args:
        if not accepts(build, key):
            raise ConfigError(
                f"task.args.{key} is given but {target!r} takes no argument "
                f"{key!r}: add {key}=... to its parameters or drop "
                f"+task.args.{key}"
            )
    if "dropout" not in args and accepts(build, "dropout"):
        model = getattr(cfg, "model", None) or {}
        dropout = model.get("dropout", 0.1) if hasattr(model, "get") else 0.1
        if dropout is not None:
            args["dropout"] = float(dropout)
    return args


class _LossFnModel(nn.Module):
    """``forward(**batch) = loss_fn(model, batch)`` (the user's summed loss)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Dict[str, Any]], Any]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _count_samples(batch: Dict[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])


def _qualname(fn: Any) -> str:
    """``module.name`` of a function or callable object (its class's when it has no name)."""
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def _length(dataset: Any, key: str, target: str) -> int:
    """``len(dataset)`` of what ``build`` returned under ``key`` (``train`` or ``val``).

    Raises:
        ConfigError: it has no ``len()`` (an iterable-style dataset), or is empty.
    """
    try:
        n = len(dataset)
    except (TypeError, OverflowError) as exc:
        raise ConfigError(
            f"task.target={target!r} returned a {key!r} {type(dataset).__name__} whose "
            f"len() fails ({exc}): return a map-style Dataset with len() and [i] "
            "(an IterableDataset cannot be cut into exact global batches)"
        ) from None
    if n <= 0:
        fix = (
            "return one with at least trainer.global_batch_size items"
            if key == "train"
            else "return a non-empty one, or no 'val' (task.val_fraction holds out part of train)"
        )
        raise ConfigError(f"task.target={target!r} returned an empty {key!r} Dataset: {fix}")
    return int(n)


def _default_collate(
    items: List[Any], positions: Sequence[int], split: str, target: str
) -> Dict[str, torch.Tensor]:
    """torch's ``default_collate(items)``.

    Raises:
        TaskContractError: the items cannot be stacked (shapes differ): one line naming the
            positions and the fix, a ``collate_fn`` that pads to a fixed width.
    """
    from torch.utils.data import default_collate

    try:
        return default_collate(items)
    except (RuntimeError, TypeError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise TaskContractError(
            f"the {split} items at positions {list(map(int, positions))[:8]} of "
            f"task.target={target!r} cannot be stacked into a batch by torch's "
            f"default_collate ({why}): return 'collate_fn' from the build function, padding "
            "every item to one fixed width (not to the longest item of the batch)"
        ) from None


class DatasetTask(Task):
    """Adapter: the user's Dataset(s), collate function and model behind the Task contract.

    Args:
        cfg: the ``task`` group (:class:`~hetseq_hpc.config.hf_tasks.DatasetTaskConfig`).
        seed: ``trainer.seed``.

    Raises:
        ConfigError: ``build`` cannot be imported, or returns no ``train``/``model``.
    """

    name = "dataset"
    build_fn: Optional[Callable[..., Any]] = None

    def __init__(self, cfg: Any, seed: int):
        super().__init__(cfg, seed)
        self._parts: Optional[Dict[str, Any]] = None

    def _build(self) -> Callable[..., Any]:
        if self.build_fn is not None:
            return type(self).build_fn  # set by dataset_task_class (a plain function)
        return resolve_build(self.cfg.target, getattr(self.cfg, "path", None))

    def load(self) -> None:
        """Call ``build`` (under ``torch.manual_seed(seed)``: a model built here is the same on
        every rank) and check what it returned."""
        build = self._build()
        args = build_args(build, self.cfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            parts = build(**args)
        if not isinstance(parts, dict) or "train" not in parts or "model" not in parts:
            got = sorted(parts) if isinstance(parts, dict) else type(parts).__name__
            raise ConfigError(
                f"task.target={getattr(self.cfg, 'target', '?')!r} returned {got}: "
                "return a dict with at least 'train' (a Dataset) and 'model'"
            )
        train, val = parts["train"], parts.get("val")
        target = self._target()
        fraction = float(getattr(self.cfg, "val_fraction", 0.0) or 0.0)
        self.train_items, self.val_items = train, val
        self.train_offset = 0
        n_train = _length(train, "train", target)  # sizes checked before any item is read
        if val is None and fraction > 0:
            n_val = max(1, int(n_train * fraction))
            if n_val >= n_train:
                raise ConfigError(
                    f"task.val_fraction={fraction:g} holds out {n_val} of the {n_train} items "
                    f"task.target={target!r} returned, leaving none to train on: return more "
                    "items, or set task.val_fraction=0"
                )
            self.val_items, self.train_offset = train, n_val  # the first n_val items
            self.n_train, self.n_val = n_train - n_val, n_val
        else:
            n_val = _length(val, "val", target) if val is not None else 0
            self.n_train, self.n_val = n_train, n_val
        self._parts = parts

    def _target(self) -> str:
        """How messages name the build function: ``task.target``, else its name."""
        return str(getattr(self.cfg, "target", None) or _qualname(type(self).build_fn))

    @property
    def parts(self) -> Dict[str, Any]:
        """What ``build`` returned; raises DataError before :meth:`load`."""
        return self.loaded(self._parts)

    @property
    def num_train(self) -> int:
        """``len(train)`` (less the held-out items)."""
        return int(self.parts and self.n_train)

    @property
    def num_val(self) -> int:
        """``len(val)``, the held-out items, or 0."""
        return int(self.parts and self.n_val)

    @property
    def data_summary(self) -> Dict[str, Any]:
        return {
            "target": getattr(self.cfg, "target", None) or getattr(self.build_fn, "__name__", ""),
            "dataset": type(self.parts["train"]).__name__,
            "train_items": self.num_train,
            "val_items": self.num_val,
        }

    def make_batch(
        self, positions: Sequence[int], epoch: int, split: str
    ) -> Dict[str, torch.Tensor]:
        """``collate_fn([dataset[p] for p in positions])`` (``default_collate`` by default)."""
        if split == "train":
            items = [self.train_items[int(p) + self.train_offset] for p in positions]
        else:
            items = [self.val_items[int(p)] for p in positions]
        collate = self.parts.get("collate_fn")
        if collate is None:
            batch = _default_collate(items, positions, split, self._target())
        else:
            batch = collate(items)
        if not isinstance(batch, dict):
            raise TaskContractError(
                f"collate_fn of {self._target()!r} returned a "
                f"{type(batch).__name__}: return a dict of tensors passed "
                "as model(**batch) (a dataset item should be a dict)"
            )
        return batch

    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        """The user's ``count(batch)``, else the samples in the batch."""
        fn = self.parts.get("count") or _count_samples
        return int(fn(batch))

    @property
    def loss_label(self) -> str:
        """What computes the loss, as contract errors name it
        (:func:`hetseq_hpc.tasks.contract.loss_label`): the user's ``loss_fn``, else their
        model's ``forward(**batch)``."""
        loss_fn, target = self.parts.get("loss_fn"), self._target()
        if loss_fn is not None:
            return f"loss_fn {_qualname(loss_fn)} (from task.target={target!r})"
        model = self.parts["model"]
        kind = type(model) if isinstance(model, nn.Module) else model
        return f"the model {_qualname(kind)} of task.target={target!r}: forward(**batch)"

    def build_model(self) -> nn.Module:
        """A copy of the model ``build`` returned (built under the seed), or a call of the
        function it returned (the caller seeds torch); wrapped with ``loss_fn`` if given."""
        model = self.parts["model"]
        model = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
        loss_fn = self.parts.get("loss_fn")
        return _LossFnModel(model, loss_fn) if loss_fn is not None else model


def dataset_task_class(build: Callable[..., Any], name: str = "dataset") -> type:
    """A :class:`DatasetTask` subclass bound to ``build`` (for Python, and for
    ``task=custom task.target=my_module.MyTask`` with ``MyTask = dataset_task_class(build)``)."""
    return type(
        f"DatasetTask_{build.__name__}",
        (DatasetTask,),
        {"build_fn": staticmethod(build), "name": name},
    )
