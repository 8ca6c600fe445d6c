"""Tasks: data + model + loss. :class:`Task` is the public API (docs/tasks.md); ``build_task``
picks one by ``task.name``: ``bert``, ``image``, ``translation``, ``hf`` (a Hugging Face model
from a local directory), ``dataset`` (a user's map-style Dataset), or ``custom`` (the class that
``task.target`` names)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hetseq_hpc.errors import ConfigError

if TYPE_CHECKING:
    from hetseq_hpc.tasks.base import Task


def __getattr__(name: str) -> Any:
    """``Task`` on first use: the package imports no torch, so the command line can read
    :mod:`hetseq_hpc.tasks.sizes` and start the ranks without it (~1 s of CPU each run)."""
    if name == "Task":
        from hetseq_hpc.tasks.base import Task

        return Task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: built-in task name -> "module:Class" (imported on use: each pulls its own dependencies)
BUILTIN = {
    "bert": "hetseq_hpc.tasks.bert.mlm_task:BertTask",
    "image": "hetseq_hpc.tasks.image.classify_task:ImageTask",
    "translation": "hetseq_hpc.tasks.translation.seq2seq_task:TranslationTask",
    "hf": "hetseq_hpc.tasks.hf.task:HfTask",
    "dataset": "hetseq_hpc.tasks.dataset_task:DatasetTask",
}


def build_task(task_cfg, seed: int) -> Task:
    """Instantiate the task of ``task_cfg`` with ``(task_cfg, seed)``.

    Raises:
        ConfigError: the name is unknown, or ``task.target`` cannot be imported (``custom``).
    """
    import importlib

    if task_cfg.name == "custom":
        from hetseq_hpc.tasks.custom import resolve_target

        return resolve_target(task_cfg.target, task_cfg.path)(task_cfg, seed)
    if task_cfg.name not in BUILTIN:
        raise ConfigError(
            f"task={task_cfg.name!r} is unknown: use one of {', '.join([*BUILTIN, 'custom'])}"
        )
    module, cls = BUILTIN[task_cfg.name].split(":")
    return getattr(importlib.import_module(module), cls)(task_cfg, seed)


__all__ = ["BUILTIN", "Task", "build_task"]
