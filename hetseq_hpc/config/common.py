"""Checks every schema shares: one-line requirements, finite numbers, sbatch-safe strings."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from hetseq_hpc.errors import ConfigError


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` (one line, ending with the fix) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def require_finite(obj: Any, where: str) -> None:
    """Every float field of the dataclass ``obj`` (and every float in a list field) is finite.

    Args:
        obj: a schema dataclass instance.
        where: its dotted place in the run configuration, e.g. ``"optim"``.

    Raises:
        ConfigError: a value is ``inf`` or ``nan`` (``optim.lr=inf`` would fail steps later).
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(
                    f"{where}.{f.name}={value!r} is not a finite number: give a real value "
                    "(inf and nan are not allowed)"
                )


# Values that end up in an sbatch script: no whitespace, quotes, `;`, `$`, backticks, newlines.
# fullmatch, not match with `$`: `$` also matches before a trailing newline.
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.:,+=/@%-]+")


def is_sbatch_safe(value: Any) -> bool:
    """True if ``str(value)`` consists only of ``[A-Za-z0-9_.:,+=/@%-]`` (and is not empty)."""
    return _SBATCH_SAFE.fullmatch(str(value)) is not None


def check_sbatch_value(where: str, value: Any) -> None:
    """Reject a value that could break out of an ``#SBATCH`` line or a comment of ``job.sbatch``.

    Raises:
        ConfigError: ``value`` holds a character outside ``[A-Za-z0-9_.:,+=/@%-]``
            (a newline, even a trailing one, ``;``, ``$(``, a space, a quote ...).
    """
    require(
        is_sbatch_safe(value),
        f"{where}={value!r} is not allowed in an sbatch script: use only letters, digits "
        "and _.:,+=/@%-",
    )
