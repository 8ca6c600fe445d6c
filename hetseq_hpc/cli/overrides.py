"""Reading the command line before Hydra runs, once (:class:`CommandLine`): Hydra's flags, the
run's overrides apart from Hydra's own, the run directory; and the options of the config
groups. Nothing is composed, imported or written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from hetseq_hpc.config.compose import is_hydra_override
from hetseq_hpc.config.conf_dir import CONF_DIR
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.files.user_input import folder_problem
from hetseq_hpc.rundir.storage import filesystem_problem

#: config groups whose options are files in conf/<group>/
GROUPS = ("task", "cluster", "trainer", "balance", "comm", "precision", "sharding", "optim", "plan")


def group_options(group: str) -> List[str]:
    """The options of a config group: the YAML files in ``conf/<group>/`` (never the
    ``*_schema`` nodes, which only the YAML files build on)."""
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


#: Hydra's flags for a sweep (one job per point)
MULTIRUN_FLAGS = ("-m", "--multirun")


@dataclass(frozen=True)
class CommandLine:
    """One ``hetseq-hpc run`` command line, read once (nothing composed or written).

    Attributes:
        argv: the command line as given (Hydra's flags, overrides), in order.
        flags: Hydra's flags (``-m``, ``--cfg``, ...).
        overrides: the run's own overrides (``key=value``, ``group=option``), in order.
        hydra: Hydra's own overrides (``hydra.run.dir=...``, ``hydra/launcher=...``), in order.
        run_dir: the last ``hydra.run.dir`` value (Hydra's grammar, quotes removed), or None.
    """

    argv: Tuple[str, ...]
    flags: Tuple[str, ...]
    overrides: Tuple[str, ...]
    hydra: Tuple[str, ...]
    run_dir: Optional[str]

    @classmethod
    def parse(cls, argv: Sequence[str]) -> CommandLine:
        """Split ``argv``; Hydra parses the ``hydra.run.dir`` value.

        Raises:
            ConfigError: a ``hydra.run.dir`` value Hydra's grammar rejects (one line).
        """
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException

        argv = tuple(argv)
        plain = [a for a in argv if not a.startswith("-")]
        hydra = tuple(a for a in plain if is_hydra_override(a))
        wanted = [a for a in hydra if a.lstrip("+").startswith("hydra.run.dir=")]
        run_dir = None
        if wanted:
            try:
                run_dir = str(OverridesParser.create().parse_overrides(wanted[-1:])[0].value())
            except HydraException as exc:
                raise ConfigError(" ".join(str(exc).split()) or type(exc).__name__) from None
        return cls(
            argv=argv,
            flags=tuple(a for a in argv if a.startswith("-")),
            overrides=tuple(a for a in plain if not is_hydra_override(a)),
            hydra=hydra,
            run_dir=run_dir,
        )

    @property
    def plain(self) -> List[str]:
        """Every override, the run's and Hydra's, in the order given (the flags left out)."""
        return [a for a in self.argv if not a.startswith("-")]

    @property
    def sweep(self) -> bool:
        """A sweep of the basic kind: ``-m`` (or ``hydra.mode=MULTIRUN``) and no other flag."""
        multirun = any(f in MULTIRUN_FLAGS for f in self.flags) or any(
            a.lstrip("+") == "hydra.mode=MULTIRUN" for a in self.hydra
        )
        return multirun and all(f in MULTIRUN_FLAGS for f in self.flags)

    def value(self, key: str) -> Any:
        """The value the command line gives the run's ``key`` (:func:`override_value`)."""
        return override_value(self.overrides, key)


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
