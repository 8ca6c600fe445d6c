"""The files of a ``task=hf`` model directory, checked before transformers reads any of them:
before any rank starts (:func:`hetseq_hpc.tasks.hf.checks.check_hf_task`) and again
wherever the config or tokenizer is loaded (:mod:`hetseq_hpc.tasks.hf.model`).

- :func:`check_no_custom_code`: a ``config.json`` or ``tokenizer_config.json`` with
  ``auto_map`` names Python code of the directory; transformers would ask "Do you wish to run
  the custom code?" under a terminal and run it on a ``y``. Refused; every transformers call
  also passes ``trust_remote_code=False``.
- :func:`check_weights`: the safetensors files ``from_pretrained`` reads (``model.safetensors``,
  or the shards of ``model.safetensors.index.json``) have sound headers
  (:func:`~hetseq_hpc.files.safetensors_file.safetensors_problem`), and none is a symlink
  leaving the directory (a Hugging Face cache snapshot's links into its ``blobs/`` are fine).

Each failure is one :class:`~hetseq_hpc.errors.ConfigError` line naming the file and the fix.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.files.safetensors_file import safetensors_problem
from hetseq_hpc.files.user_input import file_problem

#: files of a model or tokenizer directory whose ``auto_map`` transformers follows into code
CODE_MAP_FILES = ("config.json", "tokenizer_config.json")
#: largest config / tokenizer config read here (real ones are kilobytes to a few megabytes)
MAX_CONFIG_BYTES = 64 << 20
#: what from_pretrained reads, in its order (transformers' SAFE_WEIGHTS_NAME, ..._INDEX_NAME)
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
#: the fix of every weights refusal
WEIGHTS_FIX = (
    "re-save the model (model.save_pretrained(dir, safe_serialization=True)) or fetch it "
    "again (hf download NAME --local-dir DIR)"
)


def read_config_json(path: str, label: str) -> Dict[str, object]:
    """The JSON object of a config file of a model directory.

    Raises:
        ConfigError: not a regular file, larger than :data:`MAX_CONFIG_BYTES`, not UTF-8 JSON,
            or not an object (one line: ``<label> ...``).
    """
    fix = "give a directory written by save_pretrained"
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"{label} {problem}: {fix}")
    size = os.stat(path).st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{label} is {size:,} bytes, far more than a config holds: {fix}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        detail = " ".join(str(exc).split())[:120]
        raise ConfigError(f"{label} is not valid JSON ({detail}): {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{label} holds a {type(data).__name__}, not a JSON object: {fix}")
    return data


def _code_map_files(source: str) -> List[str]:
    """The files of ``source`` (a directory, or one config file) that could name code."""
    if os.path.isdir(source):
        return [p for p in (os.path.join(source, n) for n in CODE_MAP_FILES) if os.path.lexists(p)]
    return [source] if os.path.lexists(source) else []


def check_no_custom_code(source: str, key: str) -> None:
    """Refuse a model or tokenizer whose ``config.json`` / ``tokenizer_config.json`` has an
    ``auto_map`` (code of the directory that transformers would import); ``source`` is a
    directory (symlinks followed) or one config file, ``key`` the option that named it.

    Raises:
        ConfigError: one line naming the file, the entry and the fix; or the file cannot be
            read as a JSON object (:func:`read_config_json`).
    """
    for path in _code_map_files(source):
        name = os.path.basename(path)
        data = read_config_json(path, f"{key}={source!r}: {name}")
        auto_map = data.get("auto_map")
        if auto_map:
            entry = auto_map
            if isinstance(auto_map, dict):
                entry = "{}: {}".format(*next(iter(auto_map.items())))
            raise ConfigError(
                f"{key}={source!r}: {name} names custom code (auto_map {entry}): hetseq_hpc "
                "never runs code from a model directory; use a model of a transformers "
                f"architecture, or delete auto_map from {name} if its model_type is one"
            )


def _allowed_root(directory: str) -> List[str]:
    """Where a weights file of ``directory`` (resolved) may lie: inside it, and for a Hugging
    Face cache snapshot (``.../models--org--name/snapshots/<rev>``) also in that repo's
    ``blobs/``, where the snapshot's symlinks point."""
    roots = [directory]
    parent = os.path.dirname(directory)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def weight_files(directory: str, key: str) -> List[str]:
    """The safetensors files ``from_pretrained`` would read from ``directory``: the file its
    ``config.json`` names as ``transformers_weights``, else ``model.safetensors``, else every
    shard ``model.safetensors.index.json`` names.

    Raises:
        ConfigError: none is there, or the index is not JSON, has no ``weight_map``, or a name
            leaves the directory (one line).
    """
    label = f"{key}={directory!r}"
    config = os.path.join(directory, "config.json")
    named = read_config_json(config, f"{label}: config.json").get("transformers_weights")
    name = str(named) if named else WEIGHTS_NAME
    if not named and not os.path.lexists(os.path.join(directory, WEIGHTS_NAME)):
        name = WEIGHTS_INDEX_NAME
    if not os.path.lexists(os.path.join(directory, name)):
        raise ConfigError(
            f"{label} has no {name}"
            + ("" if named else f" (nor {WEIGHTS_INDEX_NAME})")
            + f", the weights transformers reads: {WEIGHTS_FIX}"
        )
    names = [name]
    if name.endswith(".index.json"):
        index = read_config_json(os.path.join(directory, name), f"{label}: {name}")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{label}: {name} has no weight_map: {WEIGHTS_FIX}")
        names = sorted(set(map(str, weight_map.values())))
    for one in names:
        parts = one.replace("\\", "/").split("/")
        if not one or os.path.isabs(one) or ".." in parts:
            raise ConfigError(
                f"{label} names the weights file {one!r}, not a file of the directory: "
                f"{WEIGHTS_FIX}"
            )
    return [os.path.join(directory, one) for one in names]


def weights_problem(path: str, roots: List[str]) -> Optional[str]:
    """Why the weights file ``path`` cannot be read safely: a symlink resolving outside
    ``roots``, or a damaged safetensors header; None when it is sound."""
    real = os.path.realpath(path)
    if os.path.islink(path) and not any(_inside(real, root) for root in roots):
        return f"is a symlink to {real}, outside the model directory"
    return safetensors_problem(real)


def check_weights(directory: str, key: str = "task.model.path") -> None:
    """Check the safetensors headers of every weights file of ``directory`` (what
    ``from_pretrained`` reads, :func:`weight_files`), following a symlinked directory.

    Raises:
        ConfigError: a file is missing, a symlink leaving the directory, not a regular file or
            a damaged safetensors file: one line naming it and the fix.
    """
    real_dir = os.path.realpath(directory)
    roots = _allowed_root(real_dir)
    for path in weight_files(directory, key):
        problem = weights_problem(path, roots)
        if problem:
            raise ConfigError(
                f"{key}={directory!r}: {os.path.basename(path)} {problem}: {WEIGHTS_FIX}"
            )
