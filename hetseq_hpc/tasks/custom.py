"""``task=custom task.target=<module>.<Class>``: import a user's :class:`~hetseq_hpc.tasks.Task`.

The module is imported from ``task.path`` (put first on ``sys.path``; the default is the
directory ``python -m hetseq_hpc`` ran in, recorded in the run's config so that every rank,
local or on Slurm, searches the same folder), then from ``PYTHONPATH`` and the installed
packages.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from typing import List, Optional

from hetseq_hpc.errors import ConfigError


def _public_classes(module) -> List[str]:
    return sorted(
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and not name.startswith("_") and obj.__module__ == module.__name__
    )


def _missing_module(target: str, module_name: str, exc: ImportError) -> ConfigError:
    """The error for a target whose module cannot be imported (names the part that exists)."""
    missing = getattr(exc, "name", None)
    if not missing:  # the module raised ImportError itself
        return _failed_import(target, module_name, exc)
    if not (module_name == missing or module_name.startswith(missing + ".")):
        # the module exists but itself imports something that is not installed
        return ConfigError(
            f"task.target={target!r}: importing {module_name!r} failed at "
            f"{_where(exc)} ({exc}): install {missing!r} or fix that import"
        )
    parts, found = module_name.split("."), None
    for i in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
            found = ".".join(parts[:i])
            break
        except ImportError:
            continue
    where = (
        f"{found!r} exists but has no module {parts[len(found.split('.'))]!r}"
        if found
        else f"no module named {parts[0]!r} in task.path, PYTHONPATH or the installed packages"
    )
    return ConfigError(
        f"task.target={target!r} cannot be imported: {where}; run from the folder "
        "that holds your module, set task.path=<that folder>, or add it to "
        "PYTHONPATH"
    )


def _where(exc: BaseException) -> str:
    """``file:line`` where ``exc`` happened while a module was imported: a SyntaxError's own
    place, else the innermost frame outside Python's standard library and installed packages
    (the user's code), else the innermost frame."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")
    ]
    if not frames:
        return "?"
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    mine = [f for f in frames if not any(f.filename.startswith(r + os.sep) for r in roots)]
    frame = (mine or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


def _failed_import(target: str, module_name: str, exc: BaseException) -> ConfigError:
    """The one-line error for a module that raised (or exited) while being imported."""
    where = _where(exc)
    if isinstance(exc, SystemExit):
        return ConfigError(
            f"task.target={target!r}: module {module_name!r} called "
            f"sys.exit({exc.code!r}) while being imported, at {where}: a task "
            "module must not exit on import; move that code under "
            "'if __name__ == \"__main__\":'"
        )
    if isinstance(exc, SyntaxError):
        text = exc.msg
    else:
        lines = str(exc).strip().splitlines()
        text = lines[0] if lines else ""
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return ConfigError(
        f"task.target={target!r}: importing module {module_name!r} failed at "
        f"{where} with {what}: fix the module so that it imports cleanly "
        f"(check with python -c 'import {module_name}')"
    )


def resolve_target(target: str, path: Optional[str] = None) -> type:
    """The task class ``target`` names (``"package.module.ClassName"``).

    Args:
        target: dotted path of the class.
        path: a folder put first on ``sys.path`` before importing (``task.path``).

    Raises:
        ConfigError: the target is malformed, its module cannot be imported (not found, a
            syntax error, an exception or ``sys.exit`` while it is imported: the message names
            the module, the file and line, and the exception), the module has no such class
            (the message lists the classes it has), or the class is not a subclass of
            :class:`hetseq_hpc.tasks.Task`. One line each.
    """
    from hetseq_hpc.tasks.base import Task

    if (
        not target
        or "." not in target.strip(".")
        or any(not p.isidentifier() for p in target.split("."))
    ):
        raise ConfigError(
            f"task.target={target!r} is not a dotted path: use "
            "task.target=<module>.<Class>, e.g. task.target=examples.char_lm.CharLMTask"
        )
    if path and path not in sys.path:
        sys.path.insert(0, path)
    module_name, class_name = target.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _missing_module(target, module_name, exc) from None
    except (Exception, SystemExit) as exc:  # a broken module, or one that exits on import
        raise _failed_import(target, module_name, exc) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        classes = _public_classes(module)
        close = difflib.get_close_matches(class_name, classes, n=1)
        hint = (
            f"did you mean {module_name}.{close[0]}?"
            if close
            else (f"it defines {', '.join(classes[:8]) or 'no classes'}")
        )
        raise ConfigError(
            f"task.target={target!r}: module {module_name!r} "
            f"({getattr(module, '__file__', '?')}) has no {class_name!r}: {hint}"
        )
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        kind = "a class" if inspect.isclass(cls) else f"a {type(cls).__name__}, not a class,"
        raise ConfigError(
            f"task.target={target!r} is {kind} that does not subclass "
            "hetseq_hpc.tasks.Task: write "
            f"'class {class_name}(hetseq_hpc.tasks.Task)' (see docs/tasks.md)"
        )
    return cls


__all__ = ["resolve_target"]
