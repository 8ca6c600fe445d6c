"""Checks of ``task=hf`` and ``task=dataset`` made on the command line before any process starts
(:func:`hetseq_hpc.cli.preflight.check_task_code`): the data files' columns, the model's kind and
the user's ``build`` function. Each failure is one line; nothing is started or written."""

from __future__ import annotations

from typing import Any

from hetseq_hpc.errors import ConfigError


def check_hf_task(task_cfg: Any) -> None:
    """``task=hf``: the config and tokenizer load, the kind is known, and every data file has
    the columns the kind reads (``task.data.text_field``; ``task.data.label_field`` for
    classification).

    Raises:
        ConfigError: the model config / tokenizer cannot be read, or the kind is unknown.
        DataError: a file lacks a column (names the columns it has) or holds no records.
    """
    from hetseq_hpc.tasks.hf.hf_model import load_hf_config, model_kind
    from hetseq_hpc.tasks.hf.hf_records import check_columns

    kind = model_kind(task_cfg.model, load_hf_config(task_cfg.model))
    wanted = [(task_cfg.data.text_field, "task.data.text_field")]
    if kind == "classification":
        wanted.append((task_cfg.data.label_field, "task.data.label_field"))
    check_columns(task_cfg.data.files, wanted)


def check_dataset_task(task_cfg: Any) -> None:
    """``task=dataset``: ``task.target`` names an importable callable.

    Raises:
        ConfigError: the module cannot be imported or has no such callable (one line).
    """
    from hetseq_hpc.tasks.dataset_task import resolve_build

    if not callable(resolve_build(task_cfg.target, task_cfg.path)):  # pragma: no cover
        raise ConfigError(f"task.target={task_cfg.target!r} is not callable")
