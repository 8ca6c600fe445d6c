"""Keys that moved, and the rewriting that keeps old command lines and saved runs working.

The trainer group once held the batch split, gradient communication and precision as well
(``trainer.allocation``, ``trainer.grad_compression``, ``trainer.precision``), and a rank's
precision could also come from ``cluster.precisions`` and ``cluster.partitions.<p>.precision``.
They now live in the ``balance``, ``comm`` and ``precision`` groups (:data:`MOVED_KEYS`). An old
key on the command line is rewritten to its new place with one warning per key
(:func:`migrate_overrides`); a ``hetseq_config.yaml`` saved by an older version is rewritten
when it is read (:func:`migrate_saved`), so such a run directory still resumes.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, List, Optional, Sequence, Set

log = logging.getLogger(__name__)

#: old key -> new key
MOVED_KEYS: Dict[str, str] = {
    **{
        f"trainer.{name}": f"balance.{name}"
        for name in (
            "allocation",
            "max_micro_batch",
            "calibration_steps",
            "calibration_micro_batch",
            "rebalance_every",
            "rebalance_threshold",
        )
    },
    **{
        f"trainer.{name}": f"comm.{name}"
        for name in ("grad_compression", "bucket_cap_mb", "grad_combine")
    },
    "trainer.precision": "precision.default",
    "trainer.sharding": "sharding.mode",
    "trainer.activation_checkpointing": "sharding.activation_checkpointing",
    "cluster.precisions": "precision.ranks",
}
#: ``cluster.partitions.<name>.precision`` -> ``precision.partitions.<name>``
_PARTITION_PRECISION = re.compile(r"cluster\.partitions\.([^.=]+)\.precision")

_warned: Set[str] = set()


def new_key(key: str) -> Optional[str]:
    """Where the old ``key`` lives now, or None when it did not move."""
    if key in MOVED_KEYS:
        return MOVED_KEYS[key]
    match = _PARTITION_PRECISION.fullmatch(key)
    return f"precision.partitions.{match.group(1)}" if match else None


def migrate_overrides(overrides: Sequence[str]) -> List[str]:
    """``overrides`` with every moved key rewritten to its new place (prefixes and values kept;
    a per-partition precision becomes ``++precision.partitions.<name>=...``, which adds the
    entry; so does ``precision.partitions.<name>=...`` written without a ``+``). Logs one
    warning per moved key per process. Idempotent."""
    out = []
    for override in overrides:
        stripped = override.lstrip("+~")
        prefix = override[: len(override) - len(stripped)]
        key, sep, value = stripped.partition("=")
        moved = new_key(key)
        if moved is None:
            if key.startswith("precision.partitions.") and prefix == "":
                override = "++" + override  # an entry of a mapping: add it, as the old key did
            out.append(override)
            continue
        if moved.startswith("precision.partitions.") and prefix != "~":
            prefix = "++"
        if key not in _warned:
            _warned.add(key)
            log.warning("%s is now %s: the old key still works, but write %s", key, moved, moved)
        out.append(f"{prefix}{moved}{sep}{value}")
    return out


def migrate_saved(container: Dict[str, Any]) -> Dict[str, Any]:
    """A saved configuration (a plain dict, as read from ``hetseq_config.yaml``) with the moved
    keys in their new places; a dict already in the new shape comes back unchanged."""
    trainer = container.get("trainer")
    cluster = container.get("cluster")
    if not isinstance(trainer, dict) and not isinstance(cluster, dict):
        return container
    out = dict(container)
    for old, new in MOVED_KEYS.items():
        group, name = old.split(".")
        section = out.get(group)
        if not isinstance(section, dict) or name not in section:
            continue
        section = dict(section)
        value = section.pop(name)
        out[group] = section
        new_group, new_name = new.split(".")
        if not isinstance(out.get(new_group) or {}, dict):
            from hetseq_hpc.errors import ConfigError

            raise ConfigError(
                f"{new_group}={out[new_group]!r} in the saved configuration is not "
                f"a group of settings, and {old} belongs in it: fix the file"
            )
        target = dict(out.get(new_group) or {})
        target.setdefault(new_name, value)
        out[new_group] = target
    partitions = (out.get("cluster") or {}).get("partitions")
    if isinstance(partitions, dict):
        moved: Dict[str, Any] = {}
        cleaned = {}
        for name, part in partitions.items():
            if isinstance(part, dict) and "precision" in part:
                part = dict(part)
                value = part.pop("precision")
                if value is not None:
                    moved[name] = value
            cleaned[name] = part
        if cleaned != partitions:
            out["cluster"] = {**out["cluster"], "partitions": cleaned}
            precision = dict(out.get("precision") or {})
            precision["partitions"] = {**moved, **(precision.get("partitions") or {})}
            out["precision"] = precision
    # a saved null precision list / default means "not set": let the schema's default stand
    precision = out.get("precision")
    if isinstance(precision, dict):
        if precision.get("ranks") is None and "ranks" in precision:
            precision = {k: v for k, v in precision.items() if k != "ranks"}
        if precision.get("default") is None and "default" in precision:
            precision = {k: v for k, v in precision.items() if k != "default"}
        out["precision"] = precision
    return out
