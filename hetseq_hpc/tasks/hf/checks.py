"""Checks of ``task=hf`` and ``task=dataset`` made on the command line before any process starts
(:func:`hetseq_hpc.cli.preflight.check_task_code`): the data files' columns, the model's kind and
the user's ``build`` function. Each failure is one line; nothing is started or written."""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

from hetseq_hpc.errors import ConfigError


def check_hf_task(task_cfg: Any) -> None:
    """``task=hf``: no config or tokenizer names custom code and the safetensors headers of the
    weights are sound (:mod:`hetseq_hpc.tasks.hf.model_files`, checked as the files are
    loaded), the config and a fast tokenizer load, the kind is known, the model and
    tokenizer fit the kind and ``task.model.max_seq_len`` (:func:`check_model_fits_kind`), and
    every data file has the columns the kind reads (``task.data.text_field``;
    ``task.data.label_field`` for classification; ``task.data.source_field`` and
    ``target_field`` for seq2seq).

    Raises:
        ConfigError: Hugging Face ``datasets`` (the data files' reader) is not installed (looked
            up, not imported: the line says ``pip install 'hetseq-hpc[hf]'``), a config or
            tokenizer names custom code (``auto_map``), a weights file is missing, damaged or a
            symlink out of the model directory, the model config
            / tokenizer cannot be read, the tokenizer is slow, the kind is unknown, or
            :func:`check_model_fits_kind` refuses (one line each).
        DataError: a file lacks a column (names the columns it has) or holds no records.
    """
    from hetseq_hpc.tasks.hf.model import load_hf_config, load_tokenizer, model_kind
    from hetseq_hpc.tasks.hf.model_files import check_weights
    from hetseq_hpc.tasks.hf.records import INSTALL_HINT, check_columns

    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(
            "task=hf reads task.data.files with Hugging Face datasets, which is "
            f"not installed: {INSTALL_HINT}"
        )
    config = load_hf_config(task_cfg.model)  # refuses custom code before transformers reads it
    kind = model_kind(task_cfg.model, config)
    tokenizer = load_tokenizer(task_cfg.model)
    if task_cfg.model.path is not None:
        check_weights(task_cfg.model.path)
    check_model_fits_kind(task_cfg.model, config, kind, tokenizer)
    wanted = [(task_cfg.data.text_field, "task.data.text_field")]
    if kind == "seq2seq":
        wanted = [
            (task_cfg.data.source_field, "task.data.source_field"),
            (task_cfg.data.target_field, "task.data.target_field"),
        ]
    if kind == "classification":
        wanted.append((task_cfg.data.label_field, "task.data.label_field"))
    check_columns(task_cfg.data.files, wanted)


#: config attributes holding the number of positions a model can embed
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_positions")


def position_limit(config: Any) -> Optional[int]:
    """The model's largest sequence length (``max_position_embeddings``, ``n_positions``, ...)
    or None where it has no fixed limit (relative positions, e.g. T5)."""
    for name in POSITION_LIMITS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_model_fits_kind(model_cfg: Any, config: Any, kind: str, tokenizer: Any) -> None:
    """The checks that need the model's config and tokenizer: a masked LM's tokenizer has a
    mask token, a seq2seq config a ``decoder_start_token_id``, ``task.model.max_seq_len`` (and
    ``max_target_len``) are within the model's positions. Run before any
    process starts (:func:`check_hf_task`) and again by each rank.

    Raises:
        ConfigError: one line naming the value and the fix.
    """
    if kind == "masked_lm" and tokenizer.mask_token_id is None:
        source = model_cfg.tokenizer or model_cfg.path or model_cfg.config
        raise ConfigError(
            f"the tokenizer of {source!r} has no mask token: "
            "task.model.kind=masked_lm needs one (set tokenizer.mask_token and "
            "save it) or choose another task.model.kind"
        )
    limit = position_limit(config)
    widths = [("task.model.max_seq_len", int(model_cfg.max_seq_len))]
    if kind == "seq2seq":
        from hetseq_hpc.tasks.hf.seq2seq import decoder_start_id

        decoder_start_id(config)
        if model_cfg.max_target_len is not None:
            widths.append(("task.model.max_target_len", int(model_cfg.max_target_len)))
    for key, width in widths:
        if limit and width > limit:
            raise ConfigError(
                f"{key}={width} exceeds the model's {limit} positions: use {key}<={limit}"
            )


def check_dataset_task(task_cfg: Any) -> None:
    """``task=dataset``: ``task.target`` names an importable callable that takes every
    ``task.args`` key (``dropout`` is passed only where it takes one).

    Raises:
        ConfigError: the module cannot be imported, has no such callable, or the callable
            does not take a ``task.args`` key (one line).
    """
    from hetseq_hpc.tasks.dataset_task import build_args, resolve_build

    build = resolve_build(task_cfg.target, task_cfg.path)
    if not callable(build):  # pragma: no cover
        raise ConfigError(f"task.target={task_cfg.target!r} is not callable")
    build_args(build, task_cfg)
