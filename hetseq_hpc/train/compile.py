"""``trainer.compile``: each sharding unit compiled in place with ``torch.compile``, and the
count of the graphs compiled so far (a re-balancing that changes a rank's micro-batch may
compile one more; the count is logged and bounded). Why units and not the whole model, and
what stays eager: docs/configuration.md (``trainer.compile``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

#: graphs one compiled function may hold before torch falls back to eager for new shapes
#: (exact either way; the first size change makes the batch dimension dynamic, a micro-batch
#: of one sample is specialised: three graphs cover every split in practice)
RECOMPILE_LIMIT = 8


def compiles(mode: str, device: torch.device) -> bool:
    """Whether ``trainer.compile=mode`` compiles on ``device``: ``on`` always, ``off`` never,
    ``auto`` on a CUDA device only (on a CPU a compile takes tens of seconds and fp32 gains
    nothing: docs/configuration.md)."""
    if mode == "on":
        return True
    return mode == "auto" and device.type == "cuda"


def compile_in_place(model: nn.Module, units: Sequence[nn.Module]) -> List[nn.Module]:
    """Compile each of ``units`` (the task's sharding units), or ``model`` whole when there are
    none, in place: parameter names, state dicts and checkpoints are unchanged, and a DDP or
    FSDP2 wrapper goes around them as before. A module of the project's or the user's code is
    compiled with :meth:`torch.nn.Module.compile`; one of ``torch.nn``'s own classes
    (``nn.TransformerEncoderLayer``: torch does not trace its ``__call__`` from there, measured
    with torch 2.13) gets its ``forward`` compiled instead (hooks such as FSDP2's stay eager
    around it). Returns the modules compiled. The compile itself happens at their first
    forward pass."""
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    compiled = list(units) or [model]
    for module in compiled:
        if type(module).__module__.startswith("torch."):
            module.forward = torch.compile(module.forward)
        else:
            module.compile()
    return compiled


def compiled_graphs() -> int:
    """Graphs compiled in this process so far (torch's dynamo counter; 0 when nothing was)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled modules eagerly inside (validation: its shapes would compile more graphs,
    and a first validation that compiles on one rank only would look like a stuck peer)."""
    with torch.compiler.set_stance("force_eager"):
        yield


__all__ = ["RECOMPILE_LIMIT", "compile_in_place", "compiled_graphs", "compiles", "eager"]
