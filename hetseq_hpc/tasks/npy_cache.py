"""A task's data cache as a folder of ``.npy`` arrays plus ``meta.json`` (written last).

Every file is written through :mod:`hetseq_hpc.files.atomic` (temp file, fsync, rename), so a crash
or two concurrent builders never leave a half-written array; a folder whose ``meta.json``
exists is complete. Arrays are memory-mapped when opened, so each rank shares the page cache.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Dict, Sequence, Tuple

import numpy as np

from hetseq_hpc.errors import DataError
from hetseq_hpc.files.atomic import atomic_write


def save_npy(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` in ``.npy`` format, atomically and durably."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array))
    atomic_write(path, lambda fh: fh.write(buf.getvalue()), durable=True)


def open_npy_cache(
    directory: Path, names: Sequence[str], what: str
) -> Tuple[dict, Dict[str, np.ndarray]]:
    """Read ``meta.json`` and memory-map ``<name>.npy`` for each name.

    Args:
        directory: the cache folder.
        names: the arrays to open.
        what: the cache's name for the error message, e.g. ``"image cache"``.

    Returns:
        ``(meta, {name: read-only memory-mapped array})``.

    Raises:
        DataError: a file is missing or unreadable (the message says to delete the folder).
    """
    try:
        meta = json.loads((directory / "meta.json").read_text())
        arrays = {n: np.load(directory / f"{n}.npy", mmap_mode="r") for n in names}
    except Exception as exc:
        raise DataError(
            f"{what} {str(directory)!r} is unreadable ({type(exc).__name__}): delete "
            "that directory to rebuild it"
        ) from None
    return meta, arrays
