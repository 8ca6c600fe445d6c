"""One loading of a ``hetseq-hpc run`` command line, new run or resumed: the validated run and
its run directory, composed once, checked before anything is written (:func:`load_run`).

A command line naming a run directory that holds an earlier run's ``hetseq_config.yaml``
(and not ``trainer.resume=never``) continues it: the saved configuration with the command
line's overrides on top (:mod:`hetseq_hpc.cli.resume`). Any other starts a new run from
``conf/``: composed once with Hydra's node, and that composition is the one Hydra starts the
run from (:class:`HydraStart`, :mod:`hetseq_hpc.cli.hydra_entry`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

from omegaconf import OmegaConf

from hetseq_hpc.cli.overrides import CommandLine, run_dir_problem, run_dir_refusal
from hetseq_hpc.cli.preflight import check_model_fits, check_resume, check_task_code
from hetseq_hpc.cli.resume import earlier_overrides, guard_saved_task, merge_overrides
from hetseq_hpc.config import RunConfig, to_run_config
from hetseq_hpc.config.aliases import migrate_overrides
from hetseq_hpc.config.compose import job_config, split_partition_overrides
from hetseq_hpc.config.composer import Composer
from hetseq_hpc.config.conf_dir import CONF_DIR
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.rundir.paths import RunDir


@dataclass(frozen=True)
class HydraStart:
    """What Hydra starts a new run from: the :class:`~hetseq_hpc.config.composer.Composer`
    that composed it (Hydra's config loader then, so it is not composed again) and the
    command line Hydra is given (the run's overrides, Hydra's, ``hydra.run.dir``,
    ``hydra.mode=RUN``: recorded in ``.hydra/``)."""

    composer: Composer
    overrides: Tuple[str, ...]


@dataclass(frozen=True)
class LoadedRun:
    """A command line's run, validated and checked; nothing written yet.

    Attributes:
        run: the validated configuration.
        run_dir: its run directory (as the command line names it, or Hydra's default).
        existed: whether the run directory existed before this command.
        hydra: how Hydra starts it (a new run), or None (a resumed run starts without Hydra,
            so the earlier run's ``.hydra/`` stays as it was).
        saved: the ``hetseq_config.yaml`` a resumed run continues, else None.
        overrides: the command line's run overrides.
        task_code: a user task module only the saved configuration names, trusted
            (``"<file> (task.target=...)"``), to name in the log; else None.
    """

    run: RunConfig
    run_dir: RunDir
    existed: bool
    hydra: Optional[HydraStart]
    saved: Optional[Path] = None
    overrides: Tuple[str, ...] = ()
    task_code: Optional[str] = None


def load_run(argv: Union[Sequence[str], CommandLine]) -> LoadedRun:
    """The run of a ``hetseq-hpc run`` command line without Hydra's flags: a resumed run
    (:func:`load_saved_run`) or a new one (:func:`load_new_run`), composed once and checked.

    Raises:
        ConfigError: a bad override or value (one line, exit 2), an unwritable, read-only or
            full run directory, or a saved file that no longer validates.
        CheckpointError: a missing ``trainer.resume`` file or a checkpoint that does not fit.
    """
    cmd = argv if isinstance(argv, CommandLine) else CommandLine.parse(argv)
    if cmd.flags:
        raise ValueError(f"load_run reads a command line without Hydra's flags: {cmd.flags}")
    resumed = load_saved_run(cmd)
    return resumed if resumed is not None else load_new_run(cmd)


def default_run_dir() -> str:
    """Hydra's default run directory (``hydra.run.dir`` of ``conf/config.yaml``, e.g.
    ``outputs/<date>/<time>``) resolved now, as Hydra would resolve it (read from the file:
    nothing is composed)."""
    from hydra.core.utils import setup_globals

    setup_globals()  # Hydra's resolvers (${now:...})
    return str(OmegaConf.load(CONF_DIR / "config.yaml").hydra.run.dir)


def load_new_run(cmd: CommandLine) -> LoadedRun:
    """A new run: ``conf/`` composed once with the command line and Hydra's node (the default
    run directory resolved first and given to Hydra, so the lock and Hydra agree on it),
    validated, the user's task class imported and checked, the model's size checked against a
    rank's memory, the run directory checked writable and the checkpoint it would resume
    from checked to fit.

    Raises:
        ConfigError, CheckpointError: as :func:`load_run`.
    """
    overrides, partitions = split_partition_overrides(migrate_overrides(list(cmd.overrides)))
    hydra = list(cmd.hydra)
    if cmd.run_dir is None:
        hydra.append(f"hydra.run.dir={default_run_dir()}")
    if not any(a.lstrip("+").startswith("hydra.mode=") for a in hydra):
        hydra.append("hydra.mode=RUN")  # as Hydra's own entry point adds it
    composer = Composer()
    cfg = composer.compose([*overrides, *hydra])
    run = to_run_config(job_config(cfg, overrides, partitions))
    check_task_code(run)
    check_model_fits(run)  # from the parameter count: nothing is built
    shown = str(cfg.hydra.run.dir)  # the directory Hydra creates (relative to here)
    problem = run_dir_problem(shown)
    if problem:
        raise run_dir_refusal(shown, problem)
    run_dir = RunDir(shown)
    check_resume(run, run_dir)
    return LoadedRun(
        run=run,
        run_dir=run_dir,
        existed=os.path.exists(shown),
        hydra=HydraStart(composer, (*overrides, *hydra)),
        overrides=tuple(cmd.overrides),
    )


def saved_config(cmd: CommandLine) -> Optional[Path]:
    """``<hydra.run.dir>/hetseq_config.yaml`` when the command line names a run directory
    that holds one, else None."""
    if cmd.run_dir is None:
        return None
    path = RunDir(Path(cmd.run_dir).expanduser()).config
    return path if path.is_file() else None


def load_saved_run(cmd: CommandLine) -> Optional[LoadedRun]:
    """The run ``hydra.run.dir`` holds, continued from its saved configuration with the
    command line's overrides on top (:func:`~hetseq_hpc.cli.resume.merge_overrides`: composed
    once), validated and checked; None when there is nothing to continue (no saved
    configuration, or ``trainer.resume=never``: a new run).

    Raises:
        ConfigError: a bad override, a saved file that is not YAML or no longer validates, a
            user task module only the saved file names (not imported), or a run directory on
            a read-only or full filesystem (nothing is written).
    """
    path = saved_config(cmd)
    if path is None:
        return None
    overrides = list(cmd.overrides)
    try:
        saved = OmegaConf.load(path)
    except Exception as exc:
        raise ConfigError(
            f"{path} is not valid YAML ({' '.join(str(exc).split())}): fix it, or "
            "start over with trainer.resume=never"
        ) from None
    resume = cmd.value("trainer.resume")
    if (resume if resume is not None else OmegaConf.select(saved, "trainer.resume")) == "never":
        return None  # a new run: nothing of the saved configuration is used (or imported)
    run_dir = RunDir(path.parent).resolve()
    problem = run_dir_problem(str(run_dir))  # read-only or full: refused, nothing written
    if problem:
        raise run_dir_refusal(str(run_dir), problem)
    merged = merge_overrides(saved, overrides, earlier_overrides(run_dir))
    task_code = guard_saved_task(merged, overrides, run_dir)
    run = to_run_config(merged)
    check_task_code(run)  # imports the task module the user named (or trusted)
    check_model_fits(run)
    return LoadedRun(
        run=run,
        run_dir=run_dir,
        existed=True,
        hydra=None,
        saved=path,
        overrides=tuple(overrides),
        task_code=task_code,
    )
