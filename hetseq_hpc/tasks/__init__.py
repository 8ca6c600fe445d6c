"""Tasks: data + model + loss. ``build_task`` picks one by ``task.name``."""

from __future__ import annotations

from hetseq_hpc.errors import ConfigError


def build_task(task_cfg, seed: int):
    """Instantiate the task named by ``task_cfg.name``.

    Raises:
        ConfigError: the name is unknown.
    """
    if task_cfg.name == "bert":
        from hetseq_hpc.tasks.bert.task import BertTask

        return BertTask(task_cfg, seed)
    raise ConfigError(f"task={task_cfg.name!r} is unknown: use task=bert")


__all__ = ["build_task"]
