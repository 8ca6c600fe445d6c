"""``self.log`` inside the micro-batches of one step: captured, combined, logged once.

A rank runs ``training_step`` once per micro-batch and ranks run different numbers of them,
so Lightning's own ``sync_dist=True`` (a collective at every ``self.log`` call) would pair up
wrongly or hang. While a micro-batch runs, :meth:`LogCapture.capturing` puts a recorder in
place of the module's ``log``; after the step every value is combined over the rank's
micro-batches and, for ``sync_dist=True``, over every rank (the tables travel in the step's
one exchange), then logged once through the real ``log``. ``reduce_fx="mean"`` (the default) is
weighted by each micro-batch's ``batch_size`` (else its loss units), so a per-sample mean comes
out as the exact mean of the global batch; ``sum``, ``max`` and ``min`` combine as named.
``torchmetrics`` metrics are passed through at once (they synchronise themselves).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.integrations.engine import Table

#: how ``reduce_fx`` names combine: each ``self.log`` argument -> the combination
REDUCTIONS: Dict[Any, str] = {
    "mean": "mean",
    "avg": "mean",
    torch.mean: "mean",
    "sum": "sum",
    torch.sum: "sum",
    "max": "max",
    torch.max: "max",
    "min": "min",
    torch.min: "min",
}
#: ``self.log`` arguments the combined value is NOT logged with (it is combined already)
NOT_PASSED = ("name", "value", "batch_size", "sync_dist", "sync_dist_group", "enable_graph")


_QUIETED: set = set()
#: ``log``'s signature per module class (read once: binding a call is all a step pays)
_SIGNATURES: Dict[type, inspect.Signature] = {}


def quiet_epoch_sync_warning(name: str) -> None:
    """Silence Lightning's advice to log ``name`` with ``sync_dist=True`` on epoch level:
    the value logged here is already the same on every rank (combined over all of them)."""
    if name in _QUIETED:
        return
    _QUIETED.add(name)
    warnings.filterwarnings(
        "ignore", message=rf"It is recommended to use `self\.log\({re.escape(repr(name))},"
    )


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - lightning requires torchmetrics
        return False
    return isinstance(value, Metric)


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}: log a scalar "
                "(e.g. loss.mean()) so that micro-batches and ranks can be combined"
            )
        return float(value.detach().reshape(()).item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"self.log({name!r}) got a {type(value).__name__}: log a number, a scalar tensor or "
            "a torchmetrics Metric"
        ) from None


@dataclass
class _Entry:
    op: str
    total: float
    weight: float
    sync: bool
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def add(self, value: float, weight: float) -> None:
        if self.op == "mean":
            self.total += value * weight
        elif self.op == "sum":
            self.total += value
        elif self.op == "max":
            self.total = max(self.total, value)
        else:
            self.total = min(self.total, value)
        self.weight += weight


def combine(op: str, parts: List[Tuple[float, float]]) -> Tuple[float, float]:
    """``(value, weight)`` of ``(total, weight)`` parts combined by ``op``."""
    weight = sum(w for _, w in parts)
    if op == "mean":
        return (sum(t for t, _ in parts) / weight if weight else float("nan")), weight
    if op == "sum":
        return sum(t for t, _ in parts), weight
    if op == "max":
        return max(t for t, _ in parts), weight
    return min(t for t, _ in parts), weight


class LogCapture:
    """The ``self.log`` calls of one step of one rank."""

    def __init__(self) -> None:
        self.entries: Dict[str, _Entry] = {}

    @contextlib.contextmanager
    def capturing(self, module: Any, weight: float) -> Iterator[None]:
        """Record ``module.log`` calls (weight ``weight`` unless a call gives ``batch_size``)
        while the block runs; metrics go straight to the real ``log``."""
        real: Callable[..., None] = module.log
        signature = _SIGNATURES.get(type(module))
        if signature is None:
            signature = _SIGNATURES[type(module)] = inspect.signature(real)

        def capture(*args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            call = dict(bound.arguments)
            name, value = call["name"], call["value"]
            if _is_metric(value):
                real(*args, **kwargs)
                return
            self.record(name, value, call, weight)

        module.__dict__["log"] = capture
        try:
            yield
        finally:
            module.__dict__.pop("log", None)

    def record(self, name: str, value: Any, call: Dict[str, Any], weight: float) -> None:
        """Add one ``self.log`` call (``call``: its bound arguments).

        Raises:
            ConfigError: a ``reduce_fx`` other than mean, sum, max or min, or a value that is
                not a scalar.
        """
        fx = call.get("reduce_fx", "mean")
        op = REDUCTIONS.get(fx)
        if op is None:
            raise ConfigError(
                f"self.log({name!r}, reduce_fx={fx!r}): uneven micro-batches combine only "
                "mean, sum, max and min; log one of those, or a torchmetrics Metric"
            )
        if call.get("batch_size") is not None:
            weight = float(call["batch_size"])
        entry = self.entries.get(name)
        if entry is None:
            start = 0.0 if op in ("mean", "sum") else (-math.inf if op == "max" else math.inf)
            entry = _Entry(op, start, 0.0, bool(call.get("sync_dist")), call)
            self.entries[name] = entry
        entry.add(_scalar(name, value), weight)

    def table(self) -> Table:
        """What the other ranks need: the synchronised entries' ``(op, total, weight)``."""
        return {n: (e.op, e.total, e.weight) for n, e in self.entries.items() if e.sync}

    def results(self, tables: List[Table]) -> Dict[str, Tuple[float, float]]:
        """name -> ``(value, weight)``: synchronised entries over every rank's table
        (``tables``, rank order), the others over this rank's micro-batches."""
        out = {}
        for name, entry in self.entries.items():
            if entry.sync:
                parts = [(t[name][1], t[name][2]) for t in tables if name in t]
            else:
                parts = [(entry.total, entry.weight)]
            out[name] = combine(entry.op, parts)
        return out

    def emit(self, module: Any, tables: List[Table]) -> None:
        """Log every combined value once through ``module.log`` (float64, ``batch_size`` =
        the combined weight, no further synchronisation: synchronised values are the same on
        every rank already)."""
        for name, (value, weight) in self.results(tables).items():
            kwargs = {k: v for k, v in self.entries[name].kwargs.items() if k not in NOT_PASSED}
            size: Optional[float] = weight if weight > 0 else None
            if size is not None and float(size).is_integer():
                size = int(size)
            if self.entries[name].sync:
                quiet_epoch_sync_warning(name)
            module.log(
                name,
                torch.tensor(value, dtype=torch.float64),
                batch_size=size,
                sync_dist=False,
                **kwargs,
            )


@contextlib.contextmanager
def silenced(module: Any) -> Iterator[None]:
    """``module.log`` does nothing while the block runs (calibration passes)."""
    module.__dict__["log"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


__all__ = ["REDUCTIONS", "LogCapture", "Table", "combine", "quiet_epoch_sync_warning", "silenced"]
