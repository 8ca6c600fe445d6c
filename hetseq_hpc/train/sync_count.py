"""Count the host synchronisations of a piece of PyTorch code, on any device (a CPU too).

:class:`SyncCounter` is a ``TorchDispatchMode`` that counts the aten calls that make the host
wait for a device: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``int(t)``,
``bool(t)``), ``aten.nonzero`` and ``aten.masked_select`` (a data-dependent shape), ``aten.index``
/ ``aten.index_put`` with a boolean index (``x[mask]``), plus calls of
``torch.cuda.synchronize`` (patched while the counter is active). On a CPU nothing waits, but
the same calls are the ones that would on a GPU, so the count is the GPU's. A dispatch mode
sees the calls of its own thread only: work done in a background thread (batch building)
is not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_ALWAYS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _bool_index(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c: ...`` then ``c.total`` (and ``c.calls``: per op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self._saved: Callable[..., None] = torch.cuda.synchronize

    @property
    def total(self) -> int:
        """Host synchronisations counted."""
        return sum(self.calls.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALWAYS or (func in _INDEX and _bool_index(args[1] if len(args) > 1 else ())):
            self.calls[str(func)] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> SyncCounter:
        self._saved = torch.cuda.synchronize

        def synchronize(*args: Any, **kwargs: Any) -> None:
            self.calls["torch.cuda.synchronize"] += 1
            return self._saved(*args, **kwargs)

        torch.cuda.synchronize = synchronize
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize = self._saved
        return super().__exit__(*exc)

    def summary(self) -> Dict[str, int]:
        """The counts per call, as a plain dict."""
        return dict(self.calls)


__all__ = ["SyncCounter"]
