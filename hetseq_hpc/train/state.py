"""Plain-data pieces of a checkpoint: RNG states and the configuration a resume must match.

Checkpoints are read with ``torch.load(weights_only=True)``, which accepts tensors, numbers,
strings, ``None`` and lists/tuples/dicts of them and nothing else, so every value here is
one of those (NumPy's state array becomes a list of ints, torch's is its uint8 tensor).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any, Dict, List, Optional

import numpy as np

from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.errors import CheckpointError

log = logging.getLogger(__name__)


def capture_rng() -> Dict[str, Any]:
    """This process's torch, NumPy and ``random`` generator states as plain data."""
    import torch  # here: the launcher's resume check imports this module, never torch

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)],
        "python": random.getstate(),
    }


def restore_rng(rng: Dict[str, Any]) -> None:
    """Set the generators from :func:`capture_rng`'s output (lists back to tuples/arrays)."""
    import torch

    torch.set_rng_state(rng["torch"])
    name, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))


def _fields(obj: Any, prefix: str, skip: tuple = ()) -> Dict[str, Any]:
    if not dataclasses.is_dataclass(obj):
        return {}
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, (bool, int, float, str)) and not any(s in f.name for s in skip):
            out[f"{prefix}.{f.name}"] = value
    return out


def run_fingerprint(run: RunConfig) -> Dict[str, Any]:
    """The settings a resumed run must share with its checkpoint, as ``{"group.key": value}``:
    ``task.name``, the model's shape (every scalar of ``task.model`` except dropout), the
    vocabulary size, ``trainer.seed`` and ``trainer.global_batch_size``. The world size and
    the allocation may change on resume (results stay exact)."""
    out: Dict[str, Any] = {
        "task.name": run.task.name,
        "trainer.seed": run.trainer.seed,
        "trainer.global_batch_size": run.trainer.global_batch_size,
    }
    out.update(_fields(getattr(run.task, "model", None), "task.model", skip=("dropout",)))
    vocab_size = getattr(getattr(run.task, "data", None), "vocab_size", None)
    if vocab_size is not None:
        out["task.data.vocab_size"] = vocab_size
    return out


def check_fingerprint(
    saved: Optional[Dict[str, Any]], current: Dict[str, Any], source: str, allow_mismatch: bool
) -> List[str]:
    """Compare a checkpoint's :func:`run_fingerprint` with this run's.

    Returns:
        the differing keys (empty when they match); with ``allow_mismatch`` they are logged.

    Raises:
        CheckpointError: they differ and ``allow_mismatch`` is false; one line listing both sides.
    """
    saved = dict(saved or {})
    keys = [k for k in current if k in saved and saved[k] != current[k]]
    # a data fingerprint (Task.data_fingerprint) is compared only where both sides have one
    keys += [k for k in saved if k not in current and not k.startswith("data.")]
    if not keys:
        return []
    then = ", ".join(f"{k}={saved.get(k)}" for k in keys)
    now = ", ".join(f"{k}={current.get(k)}" for k in keys)
    if not allow_mismatch:
        fix = (
            "the same values"
            if "data.fingerprint" not in keys
            else "the data cache the checkpoint was trained with (task.data.cache_dir / "
            "HETSEQ_CACHE: a tokenizer trained again assigns other token ids)"
        )
        raise CheckpointError(
            f"checkpoint {source!r} was trained with {then}; this run has {now}: use {fix}, "
            "a new hydra.run.dir, or trainer.allow_resume_mismatch=true"
        )
    log.warning(
        "resuming from %s although it was trained with %s (this run: %s): "
        "trainer.allow_resume_mismatch=true",
        source,
        then,
        now,
    )
    return keys
