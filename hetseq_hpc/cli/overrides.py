"""Reading the command line's Hydra overrides before Hydra runs: keys, values, the run
directory, and the options of the config groups. Nothing is composed, imported or written."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Sequence

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.files.user_input import folder_problem
from hetseq_hpc.rundir.storage import filesystem_problem

#: config groups whose options are files in conf/<group>/
GROUPS = ("task", "cluster", "trainer", "balance", "comm", "precision", "sharding", "optim", "plan")


def group_options(group: str) -> List[str]:
    """The options of a config group: the YAML files in ``conf/<group>/`` (never the
    ``*_schema`` nodes, which only the YAML files build on)."""
    from hetseq_hpc.config import CONF_DIR

    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def refuse_internal_options(overrides: Sequence[str]) -> None:
    """Refuse ``group=<name>_schema``: the schemas are internal building blocks.

    Raises:
        ConfigError: one line naming the real options.
    """
    for arg in overrides:
        key, _, value = arg.lstrip("+~").partition("=")
        if key in GROUPS and value.strip().endswith("_schema"):
            options = ", ".join(group_options(key))
            raise ConfigError(
                f"{key}={value} is an internal schema, not an option: choose one "
                f"of {options} (e.g. {key}={group_options(key)[0]})"
            )


def override_key(override: str) -> str:
    """The key (or group) an override sets: ``+a.b=1`` -> ``a.b``."""
    return override.lstrip("+~").partition("=")[0]


def override_value(overrides: Sequence[str], key: str) -> Any:
    """The value the last override of ``key`` gives (Hydra's grammar: ``true`` is True), or
    None when the command line does not set it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    wanted = [o for o in overrides if override_key(o) == key]
    if not wanted:
        return None
    return OverridesParser.create().parse_overrides(wanted[-1:])[0].value()


def run_dir_override(argv: Sequence[str]) -> str:
    """The value of the last ``hydra.run.dir=`` override (Hydra's grammar, quotes removed), else
    the working directory (the default run directory lies below it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    wanted = [a for a in argv if a.lstrip("+").startswith("hydra.run.dir=")]
    if not wanted:
        return "."
    parsed = OverridesParser.create().parse_overrides(wanted[-1:])
    return str(parsed[0].value())


def run_dir_problem(path: str) -> Optional[str]:
    """Why the run directory ``path`` cannot be created or written, or None if it can: its
    filesystem must be neither read-only nor full
    (:func:`hetseq_hpc.rundir.storage.filesystem_problem`), and its nearest existing ancestor a
    writable directory (:func:`hetseq_hpc.files.user_input.folder_problem`)."""
    return filesystem_problem(path) or folder_problem(path)


def run_dir_refusal(path: str, problem: str) -> ConfigError:
    """The one line that refuses run directory ``path`` for ``problem``
    (:func:`run_dir_problem`), before anything is created in it."""
    verb = "written" if Path(path).expanduser().exists() else "created"
    fix = "choose a writable directory, e.g. hydra.run.dir=runs/my-run"
    if problem.startswith("no space left"):
        fix = f"free space there, or {fix}"
    elif problem.endswith("is read-only"):
        fix += " (copy a run there to continue it)"
    return ConfigError(f"hydra.run.dir={path} cannot be {verb} ({problem}): {fix}")
