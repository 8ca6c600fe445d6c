"""Checks made before any process starts or anything is written: the checkpoint a run would
resume from must exist and fit the run (the same checks the ranks make later)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.files.user_input import file_problem


def checkpoint_fingerprint(path: Path) -> Optional[Dict[str, Any]]:
    """The run fingerprint a checkpoint stores (its ``config`` entry), read memory-mapped so
    the weights are not loaded; None when the file cannot be read (the ranks verify it)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return state.get("config") if isinstance(state, dict) else None


def check_resume(run: Any, run_dir: Optional[Path]) -> None:
    """Before any process starts: an explicit ``trainer.resume`` file must exist, and the
    checkpoint the run would resume from must fit it (same checks the ranks make later,
    :func:`hetseq_hpc.train.state.check_fingerprint`).

    Raises:
        CheckpointError: the file is missing, or the checkpoint was trained with other settings
            (the ranks' one-line messages; exit code 1 as when a rank finds it).
    """
    from hetseq_hpc.train.checkpoint import list_checkpoints
    from hetseq_hpc.train.state import check_fingerprint, run_fingerprint

    resume = run.trainer.resume
    if resume == "never":
        return
    if resume == "auto":
        found = list_checkpoints(run_dir) if run_dir is not None else []
        if not found:
            return
        path = found[-1]
    else:
        path = Path(resume).expanduser()
        problem = file_problem(path)
        if problem:
            raise CheckpointError(f"trainer.resume={resume} {problem}: give the path of a "
                              "checkpoint (RUN_DIR/checkpoints/step_XXXXXXXX.pt), or "
                              "trainer.resume=auto / never")
    saved = checkpoint_fingerprint(path)
    if saved is None:
        return
    check_fingerprint(saved, run_fingerprint(run), str(path), run.trainer.allow_resume_mismatch)


def check_task_code(run: Any) -> None:
    """Import the user's task class that ``task.target`` names (``task=custom``) and check it,
    before any process starts: a missing module, class or base class is one line here rather
    than a failure on every rank (:func:`hetseq_hpc.tasks.custom.resolve_target`).

    Raises:
        ConfigError: the target cannot be imported or is not a Task subclass (one line).
    """
    target = getattr(run.task, "target", None)
    if target:
        from hetseq_hpc.tasks.custom import resolve_target

        resolve_target(target, getattr(run.task, "path", None))
