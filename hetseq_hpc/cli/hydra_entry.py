"""Hydra's part of ``hetseq-hpc run``: the run directory and ``.hydra/`` of a new run, sweeps
(``-m``, with Hydra's sweeper and launcher plugins), and Hydra's own flags.

Hydra is started on the composition that was checked (:func:`hydra_app`: the
:class:`~hetseq_hpc.config.composer.Composer` becomes Hydra's config loader, so nothing is
composed twice). Hydra's task function is a :class:`NewRunJob` (a new run, already validated)
or a :class:`ComposedJob` (a point of a sweep, or a run under Hydra's flags, validated as it
starts); both hand the run to its launcher (:mod:`hetseq_hpc.cli.dispatch`). Errors are one
line (:data:`hetseq_hpc.errors.EXIT_CODES`). Design: docs/design/configuration.md.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

from hydra import initialize_config_dir, version

# @hydra.main reads sys.argv; the entry point behind it reads a parsed command line (hydra-core
# is pinned below 1.4, where these two are)
from hydra._internal.utils import _run_hydra, get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hetseq_hpc.cli.dispatch import dispatch_or_exit
from hetseq_hpc.cli.overrides import CommandLine
from hetseq_hpc.cli.preflight import check_task_code
from hetseq_hpc.config import RunConfig, register_configs, to_run_config
from hetseq_hpc.config.compose import job_config, split_partition_overrides
from hetseq_hpc.config.composer import Composer
from hetseq_hpc.config.conf_dir import CONF_DIR, CONFIG_NAME, VERSION_BASE
from hetseq_hpc.config.keys import describe_omegaconf_error
from hetseq_hpc.errors import ConfigError, report_error
from hetseq_hpc.rundir.logs import guard_log_files
from hetseq_hpc.rundir.paths import RunDir

#: most sweep points :func:`check_sweep` composes and validates before Hydra starts
MAX_SWEEP_CHECKS = 64
#: what Hydra writes into a job's directory before the task function starts
HYDRA_FILES = frozenset({RunDir.HYDRA_NAME, RunDir.CLI_LOG_NAME})


@contextmanager
def hydra_app(composer: Composer) -> Iterator[Any]:
    """Hydra's application on ``conf/`` (as ``@hydra.main`` sets it up) whose config loader is
    ``composer``: what Hydra composes for a run, a sweep or a sweep point is ``composer``'s
    composition, made once. Yields Hydra's ``Hydra`` object (``.run``, ``.multirun``)."""
    with initialize_config_dir(config_dir=str(composer.config_dir), version_base=VERSION_BASE):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        hydra.config_loader = composer
        yield hydra


@dataclass(frozen=True)
class NewRunJob:
    """Hydra's task function of a new run validated before Hydra started (Hydra has just made
    its directory and written ``.hydra/``): hand ``run`` to its launcher.

    Args:
        run: the validated configuration (:func:`hetseq_hpc.cli.load.load_run`).
        new_dir: the run directory did not exist before this command (a SLURM submission
            refused before anything was submitted removes it).
    """

    run: RunConfig
    new_dir: bool

    def __call__(self, cfg: DictConfig) -> Any:
        """Start the run (``cfg`` is Hydra's copy of the same composition)."""
        guard_log_files()  # Hydra's cli.log: a full disk cannot fail the launcher through it
        run_dir = RunDir(Path(HydraConfig.get().runtime.output_dir).resolve())
        return dispatch_or_exit(self.run, run_dir, self.new_dir)


@dataclass(frozen=True)
class ComposedJob:
    """Hydra's task function of a run Hydra composed (a sweep point, or a run under Hydra's
    flags): validate ``cfg`` with the job's overrides (no composing), then hand it to its
    launcher. Picklable, for launcher plugins that run jobs elsewhere.

    Args:
        partitions: whole partitions of the command line (``+cluster.partitions.x={...}``),
            which Hydra cannot compose: added to every job's configuration.
    """

    partitions: Tuple[Tuple[str, str], ...] = ()

    def __call__(self, cfg: DictConfig) -> Any:
        """Validate and start the job's run; a bad value exits with its one line."""
        hydra_cfg = HydraConfig.get()
        guard_log_files()
        run_dir = RunDir(Path(hydra_cfg.runtime.output_dir).resolve())
        try:
            run = to_run_config(job_config(cfg, list(hydra_cfg.overrides.task), self.partitions))
        except ConfigError as exc:
            sys.exit(report_error(exc))
        # nothing but what Hydra just wrote: a directory of this job (removed when a SLURM
        # submission is refused), not an earlier run's
        new_dir = {p.name for p in run_dir.root.iterdir()} <= HYDRA_FILES
        return dispatch_or_exit(run, run_dir, new_dir)


def start_with_hydra(composer: Composer, overrides: Sequence[str], job: NewRunJob) -> None:
    """Start the new run whose command line ``overrides`` (Hydra's, ``hydra.mode=RUN``
    included) ``composer`` composed: Hydra makes its directory, writes ``.hydra/`` and
    ``cli.log`` as for any Hydra application, then calls ``job``."""
    with hydra_app(composer) as hydra:
        hydra.run(config_name=CONFIG_NAME, task_function=job, overrides=list(overrides))


def sweep_points(master: DictConfig, loader: Composer) -> List[List[str]]:
    """The points of the grid that :func:`check_sweep` checks, written as Hydra's basic
    sweeper writes them (``hydra.sweeper.params`` first, then the command line's overrides;
    ``BasicSweeper.split_arguments``): every override at its first value, then each other value
    of each swept override with the rest at their first.

    Raises:
        HydraException: a sweep the basic sweeper cannot enumerate (``interval(...)``).
    """
    params = OmegaConf.select(master, "hydra.sweeper.params", default=None) or {}
    arguments = [f"{k}={v}" for k, v in params.items()]
    arguments += [str(o) for o in master.hydra.overrides.task]
    values = {}  # key -> its values as "key=value", in the sweeper's order (the last one wins)
    for override in OverridesParser.create(config_loader=loader).parse_overrides(arguments):
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={v}" for v in override.sweep_string_iterator()]
        else:
            raise HydraException(f"{override.input_line} is not a discrete sweep")
    lists = [v for v in values.values() if v]
    firsts = [v[0] for v in lists]
    points = [firsts]
    for i, swept in enumerate(lists):
        points += [[*firsts[:i], value, *firsts[i + 1 :]] for value in swept[1:]]
    return points


def check_sweep(
    composer: Composer, overrides: Sequence[str], partitions: Sequence[Tuple[str, str]]
) -> None:
    """``-m``: compose the sweep, then compose and validate each value of each swept override
    (:func:`sweep_points`, at most :data:`MAX_SWEEP_CHECKS`) before Hydra starts, so that a bad
    value is one ``hetseq-hpc: error:`` line with exit code 2 naming it and no sweep directory
    is made. Hydra's sweeper and launcher then get these compositions from ``composer``.
    Sweeps the basic sweeper cannot enumerate (``interval(...)``, for optimizers) are left to
    the sweeper; each job still validates its own configuration.

    Raises:
        ConfigError: a value that does not compose or validate (one line).
    """
    try:
        master = composer.load_configuration(CONFIG_NAME, list(overrides), RunMode.MULTIRUN)
        try:
            points = sweep_points(master, composer)
        except HydraException:
            return  # the sweeper reports what it cannot enumerate
        for point in points[:MAX_SWEEP_CHECKS]:
            cfg = composer.load_sweep_config(master, point)
            task = list(cfg.hydra.overrides.task)
            check_task_code(to_run_config(job_config(cfg, task, partitions)))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(describe_omegaconf_error(exc)) from None


def run_sweep(cmd: CommandLine) -> int:
    """``-m``: every point checked first (:func:`check_sweep`), then Hydra's sweeper and
    launcher (plugins included: ``hydra/sweeper=...``, ``hydra/launcher=...``) run one
    :class:`ComposedJob` per point, on the compositions already made.

    Raises:
        ConfigError: a bad value of any point checked (nothing is made), or one Hydra rejects.
    """
    overrides, partitions = split_partition_overrides(cmd.plain)
    if not any(a.lstrip("+").startswith("hydra.mode=") for a in overrides):
        overrides.append("hydra.mode=MULTIRUN")  # as Hydra's own entry point adds it
    composer = Composer()
    check_sweep(composer, overrides, partitions)
    try:
        with hydra_app(composer) as hydra:
            hydra.multirun(
                config_name=CONFIG_NAME,
                task_function=ComposedJob(tuple(partitions)),
                overrides=overrides,
            )
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(describe_omegaconf_error(exc)) from None
    return 0


def run_hydra_flags(cmd: CommandLine) -> int:
    """A command line with Hydra's flags: a sweep (only ``-m``: :func:`run_sweep`), or any
    other (``--cfg job``, ``--info``, ``--hydra-help``, ``-cd DIR``, ...) handed to Hydra's
    own entry point as it is, with a :class:`ComposedJob` as the task function."""
    if cmd.sweep:
        return run_sweep(cmd)
    argv, partitions = split_partition_overrides(list(cmd.argv))
    register_configs()
    version.setbase(VERSION_BASE)
    parser = get_args_parser()
    _run_hydra(
        args=parser.parse_args(argv),
        args_parser=parser,
        task_function=ComposedJob(tuple(partitions)),
        config_path=str(CONF_DIR),
        config_name=CONFIG_NAME,
    )
    return 0
