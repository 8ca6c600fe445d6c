"""``hetseq-hpc prepare``: build the task's caches before any job is submitted.

On a login node (or with ``srun``): the tokenizer and the packed token array of
``task.data.files`` (:func:`hetseq_hpc.tasks.bert.mlm_data.build_packed_text`: streamed in bounded
memory, encoded on all cores, atomic), so no GPU waits for it later. A run finds the finished
cache by its key (corpus fingerprint, vocabulary size, sequence length) in
``task.data.cache_dir`` / ``$HETSEQ_CACHE`` / ``~/.cache/hetseq_hpc``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence


def prepare_command(overrides: Sequence[str]) -> str:
    """Compose the overrides, prepare the task's caches and return a one-line result: where the
    cache is and how long it took, or that it was already prepared (and where).

    Raises:
        ConfigError: a bad override (nothing is written).
        DataError: a data file that cannot be read or is too small; a cache directory that
            cannot be written (full disk, read-only, a file in its place): one line with the
            path and the fix, and nothing half-written that a run would trust.
    """
    from hetseq_hpc.cli.overrides import refuse_internal_options
    from hetseq_hpc.config.compose import compose_run_config, run_overrides
    from hetseq_hpc.tasks import build_task
    from hetseq_hpc.tasks.cache import TaskCache
    from hetseq_hpc.tasks.prepare_errors import prepare_task

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    refuse_internal_options(overrides)
    run = compose_run_config(run_overrides(overrides))
    task = build_task(run.task, run.trainer.seed)
    where = getattr(task, "directory", None)
    if where is not None and TaskCache(Path(where)).is_complete():  # every built-in cache's
        return (
            f"task={run.task.name} was already prepared: {where} (nothing to do; delete "
            "that directory to rebuild it)"
        )
    started = time.monotonic()
    prepare_task(task)
    return f"prepared task={run.task.name} in {time.monotonic() - started:.1f} s" + (
        f": {where}" if where else ""
    )
