"""Files the user names on the command line: what a path is, strict JSON reading, output checks.

A wrong path or a damaged file must be one line naming it, never a traceback or a hang:

- :func:`file_problem`: why a path is not a regular file (missing, a directory, a FIFO, a
  device), from ``os.stat`` alone: nothing is opened, so a FIFO cannot block the command.
- :func:`read_json_file`: a regular file's JSON, strict: UTF-8, no ``NaN``/``Infinity``, no
  float that overflows, no integer of more than :data:`MAX_INT_DIGITS` digits, bounded nesting.
- :func:`output_problem`: why a file cannot be written at a path (checked before any work).
- :func:`number`: one figure of a parsed file, checked to be a finite number in a range.

Every error is a :class:`~hetseq_hpc.errors.ConfigError` (exit code 2): bad input.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from hetseq_hpc.errors import ConfigError

PathLike = Union[str, "os.PathLike[str]"]

#: longest integer literal a JSON input may hold (a figure, a count: 20 digits is 1e20)
MAX_INT_DIGITS = 20

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(path: PathLike) -> Optional[str]:
    """What ``path`` is ("a regular file", "a directory", "a FIFO", "a character device", ...),
    from ``os.stat`` (symlinks followed); None when it cannot be stat'ed (missing)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "a special file")


def file_problem(path: PathLike) -> Optional[str]:
    """Why ``path`` is not a readable regular file, as a phrase to follow the path ("does not
    exist", "is a directory, not a file", "is not a regular file (a FIFO)", ...), or None when
    it is one. Uses ``os.stat`` only (symlinks followed); never opens the path, so a FIFO
    cannot block."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except NotADirectoryError:
        return "does not exist (a folder on its path is a file)"
    except PermissionError:
        return "cannot be read (permission denied)"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    kind = kind_of(path)
    if kind == "a regular file":
        return None
    if kind == "a directory":
        return "is a directory, not a file"
    return f"is not a regular file ({kind})"


def describe(value: Any) -> str:
    """The JSON type of a parsed value, for messages: "a list", "a number", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"the integer {text[:12]}... has {len(text.lstrip('-'))} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:24]} overflows a float")
    return value


def _parse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_strict(text: str) -> Any:
    """``json.loads`` without ``NaN``/``Infinity``, overflowing floats or integers longer than
    :data:`MAX_INT_DIGITS` digits.

    Raises:
        ValueError: not JSON, or one of those numbers (the message says which).
        RecursionError: nested deeper than the interpreter's recursion limit.
    """
    return json.loads(
        text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
    )


def read_json_file(path: PathLike, label: str, fix: str) -> Any:
    """The parsed JSON of the regular file ``path`` (:func:`loads_strict`).

    Args:
        path: the file.
        label: how the message names it, e.g. ``"plan.probe='x.json'"``.
        fix: the end of every message: what to pass instead.

    Raises:
        ConfigError: the path is not a regular file, cannot be read, is not UTF-8, is not
            strict JSON, or nests too deeply; one line ``<label> <problem>: <fix>``.
    """
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"{label} {problem}: {fix}")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{label} cannot be read ({exc.strerror or exc}): {fix}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{label} is not UTF-8 text (byte {exc.start} is "
            f"{data[exc.start]:#04x}; binary data?): {fix}"
        ) from None
    try:
        return loads_strict(text)
    except RecursionError:
        raise ConfigError(f"{label} is nested too deeply to be read: {fix}") from None
    except ValueError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{label} is not valid JSON ({detail}): {fix}") from None


def output_problem(path: PathLike) -> Optional[str]:
    """Why a file cannot be written at ``path``, as a phrase to follow the path, or None when
    it can: an existing ``path`` must be a regular file, and its nearest existing folder a
    writable folder (missing folders are created by the writer)."""
    target = Path(path).expanduser().absolute()
    if os.path.lexists(target):
        problem = file_problem(target)
        if problem and problem != "does not exist":  # a dangling symlink is replaced
            return problem
    problem = folder_problem(target.parent)
    return f"cannot be created ({problem})" if problem else None


def folder_problem(path: PathLike) -> Optional[str]:
    """Why a folder cannot be created (or written) at ``path``, or None when it can: its
    nearest existing ancestor must be a writable folder that accepts a new folder (tried: one
    is created and removed at once; ``os.access`` alone says yes to root on procfs)."""
    existing = Path(path).expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hetseq-check-", dir=existing))
    except OSError as exc:
        return f"{existing} refuses a new folder ({exc.strerror or type(exc).__name__})"
    return None


def number(
    value: Any, where: str, fix: str, low: float, high: float, integer: bool = False
) -> Union[int, float]:
    """``value`` as a number in ``[low, high]`` (an integer if ``integer``).

    Raises:
        ConfigError: not a number (a boolean is none), not an integer, or out of range; the
            message names ``where`` and ends with ``fix``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} is {describe(value)}, not a number: {fix}")
    if integer and not float(value).is_integer():
        raise ConfigError(f"{where}={value!r} is not a whole number: {fix}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"{where}={value:g} is out of range [{low:g}, {high:g}]: {fix}")
    return int(value) if integer else value
