"""The end of a run with in-job recovery: a rank lost after the last step.

After :meth:`Trainer.fit <hetseq_hpc.train.trainer.Trainer.fit>` returns, the training and its last
checkpoint are complete on every rank, but a few collectives remain: under FSDP the gather of
the weights the examples are written with, and the final barrier. A rank lost there (killed,
its node gone) used to turn a finished run into a failed one. With ``trainer.elastic`` the
survivors now log it and finish: nothing is left to redo, so no world is re-formed. The run's
``summary.json`` is written by rank 0 before the barrier; if rank 0 was the one lost, the
survivors write it (atomically; each writes the same summary, so whichever rename comes last
leaves a whole one).

A survivor that saw such a failure ends without the interpreter's teardown
(:data:`~hetseq_hpc.env.rank_guard.FAILED`: freeing a broken group's DDP reducer can deadlock),
with exit code 0.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, Optional, TypeVar

from hetseq_hpc.distributed.membership import is_peer_failure
from hetseq_hpc.env.rank_guard import FAILED
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.files.fence import stamp
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.recovery.elastic import ElasticWorld

log = logging.getLogger(__name__)

T = TypeVar("T")


def after_training(
    elastic: Optional[ElasticWorld], collective: Callable[[], T], what: str, lost: T
) -> T:
    """Run ``collective`` (one of the collectives after the last step) and return its result;
    with in-job recovery (``elastic`` not None), a peer's failure there means a rank was lost
    after the training had completed: logged, the error kept (:data:`FAILED`), and ``lost``
    returned instead.

    Raises:
        whatever ``collective`` raises, except a peer failure with in-job recovery.
    """
    try:
        return collective()
    except Exception as exc:
        if elastic is None or not is_peer_failure(exc):
            raise
        first = " ".join(str(exc).split())[:200] or type(exc).__name__
        log.warning(
            "a rank was lost after the last step (%s failed: %s): the training and its "
            "last checkpoint are complete; finishing without it",
            what,
            first,
        )
        FAILED.append(exc)
        return lost


def write_summary_if_missing(run_dir: RunDir, summary: Dict[str, Any]) -> bool:
    """Write ``summary`` as the run's ``summary.json`` unless one of this run's end is there
    already (same ``final_step`` and ``final_loss``: rank 0 wrote it before it was lost).
    Returns whether it was written."""
    path = run_dir.summary
    try:
        there = json.loads(path.read_text())
        if (there.get("final_step"), there.get("final_loss")) == (
            summary.get("final_step"),
            summary.get("final_loss"),
        ):
            return False
    except (OSError, ValueError, AttributeError):  # missing, cut off or not an object
        pass
    atomic_write_json(path, {**summary, **stamp()})
    log.info("summary written by this rank (rank 0 was lost after the last step): %s", path)
    return True


__all__ = ["after_training", "write_summary_if_missing"]
