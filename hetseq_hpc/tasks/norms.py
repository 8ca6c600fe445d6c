"""BatchNorm detection: the one common layer that breaks exact uneven-batch training.

hetseq_hpc makes a step with uneven per-rank batches equal to one big batch by summing losses
and dividing by the GLOBAL unit count. BatchNorm normalises with the statistics of each rank's
own micro-batch (Ioffe & Szegedy, 2015), so its output - and the loss - depends on how the
global batch was cut; even ``SyncBatchNorm`` only syncs within one forward pass, not across
gradient-accumulation micro-batches. GroupNorm (Wu & He, 2018) and LayerNorm normalise each
sample on its own and keep the semantics exact.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hetseq_hpc.errors import ConfigError

log = logging.getLogger(__name__)

#: the trainer option that accepts inexact results from BatchNorm models
OPT_OUT = "trainer.allow_inexact_batchnorm=true"


def find_batchnorm(model: nn.Module) -> List[Tuple[str, str]]:
    """Every BatchNorm layer of ``model``, in ``named_modules`` order.

    Detects any subclass of ``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d,
    their Lazy variants, SyncBatchNorm and user subclasses.

    Returns:
        ``[(qualified_name, class_name), ...]``; empty when there is none. The root module
        itself is named ``"<model>"``.
    """
    found = []
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            found.append((name or "<model>", type(module).__name__))
    return found


def check_no_batchnorm(model: nn.Module, allow: bool) -> Optional[Dict[str, object]]:
    """Refuse a model with BatchNorm, or (with ``allow``) warn and describe it.

    Args:
        model: the freshly built model, before any training.
        allow: the value of ``trainer.allow_inexact_batchnorm``.

    Returns:
        ``None`` when the model has no BatchNorm; otherwise (only with ``allow``) a record for
        ``summary.json``: ``{"exact": False, "reason": ..., "batchnorm_layers": [[name, type],
        ...]}``.

    Raises:
        ConfigError: the model has BatchNorm and ``allow`` is false; the one-line message names
            the first layer and the fixes.
    """
    layers = find_batchnorm(model)
    if not layers:
        return None
    name, kind = layers[0]
    more = f" (and {len(layers) - 1} more)" if len(layers) > 1 else ""
    if not allow:
        raise ConfigError(
            f"model layer {name!r} is {kind}{more}: BatchNorm statistics depend on each rank's "
            "micro-batch, so uneven batches are not exact; replace it with nn.GroupNorm or "
            f"nn.LayerNorm, or set {OPT_OUT} to accept inexact results"
        )
    reason = (
        f"{len(layers)} BatchNorm layer(s), first {name!r} ({kind}): losses depend on "
        "the per-rank micro-batch split"
    )
    log.warning(
        "%s=true: training is NOT exact across allocations: %s", OPT_OUT.split("=")[0], reason
    )
    return {"exact": False, "reason": reason, "batchnorm_layers": [list(x) for x in layers]}


__all__ = ["OPT_OUT", "check_no_batchnorm", "find_batchnorm"]
