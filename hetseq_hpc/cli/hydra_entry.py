"""The one Hydra entry point (``hetseq-hpc run`` of a new run): pre-check, then Hydra.

:func:`run_with_hydra` composes ``conf/`` with the command-line overrides and validates the
whole configuration once before Hydra does (nothing is created on a bad value), then starts
Hydra's ``@hydra.main`` function, which validates again and hands the run to its launcher
(:mod:`hetseq_hpc.cli.dispatch`). Errors are one line (:data:`hetseq_hpc.errors.EXIT_CODES`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, NoReturn, Optional, Tuple

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from hetseq_hpc.cli.dispatch import dispatch_or_exit
from hetseq_hpc.cli.overrides import run_dir_override, run_dir_problem, run_dir_refusal
from hetseq_hpc.cli.preflight import (
    check_model_fits,
    check_resume,
    check_task_code,
    refuse_rewinding_a_finished_run,
    say_if_finished,
)
from hetseq_hpc.config import (
    CONF_DIR,
    RunConfig,
    compose_run_config,
    register_configs,
    to_run_config,
)
from hetseq_hpc.config.compose import (
    apply_empty_dict_overrides,
    apply_partition_overrides,
    split_partition_overrides,
)
from hetseq_hpc.errors import ConfigError, HetseqError, report_error
from hetseq_hpc.rundir.lock import acquire
from hetseq_hpc.rundir.logs import guard_log_files

#: whether the run directory existed before Hydra started (set by :func:`run_with_hydra`)
_RUN_DIR_EXISTED = False
#: whole partitions from the command line, applied after Hydra composed (set by run_with_hydra)
_PARTITIONS: List[Tuple[str, str]] = []


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Any:
    hydra_cfg = HydraConfig.get()
    guard_log_files()  # Hydra's cli.log: a full disk cannot fail the launcher through it
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    new_dir = not _RUN_DIR_EXISTED
    try:
        apply_empty_dict_overrides(cfg, list(hydra_cfg.overrides.task))
        apply_partition_overrides(cfg, _PARTITIONS)
        run = to_run_config(cfg)
    except ConfigError as exc:
        sys.exit(report_error(exc))
    return dispatch_or_exit(run, run_dir, new_dir)


def exit_one_line(exc: BaseException) -> NoReturn:
    """Exit with the one ``hetseq-hpc: error:`` line of a pre-check's error: a
    :class:`HetseqError` as it is (a bad value 2; a checkpoint that is missing or does not fit
    1), a Hydra parser error (a malformed override) as a :class:`ConfigError` on one line."""
    if not isinstance(exc, HetseqError):
        exc = ConfigError(" ".join(str(exc).split()) or type(exc).__name__)
    sys.exit(report_error(exc))


def precheck_overrides(argv: List[str]) -> Optional[RunConfig]:
    """Compose and validate the config once before Hydra does, so that a bad override (unknown
    key, wrong type, out-of-range value, missing group option) or an unwritable
    ``hydra.run.dir`` is one ``hetseq-hpc: error:`` line with exit code 2 instead of Hydra's
    multi-line report, and nothing is created. Skipped for multirun and Hydra's own flags, which
    Hydra handles.

    Returns:
        The validated run, or None for multirun and Hydra's flags.
    """
    if any(arg.startswith("-") for arg in argv):
        if any(arg in MULTIRUN_FLAGS for arg in argv) and all(
            arg in MULTIRUN_FLAGS or not arg.startswith("-") for arg in argv
        ):
            precheck_sweep([arg for arg in argv if arg not in MULTIRUN_FLAGS])
        return None
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    try:
        run = compose_run_config(overrides)
        check_task_code(run)
        check_model_fits(run)  # from the parameter count: nothing is built
        run_dir = run_dir_override(argv)
        problem = run_dir_problem(run_dir)
        if problem:
            raise run_dir_refusal(run_dir, problem)
        check_resume(run, Path(run_dir) if run_dir != "." else None)
    except (HetseqError, HydraException) as exc:
        exit_one_line(exc)
    return run


#: Hydra's flags for a sweep (one job per point)
MULTIRUN_FLAGS = ("-m", "--multirun")
#: most configurations :func:`precheck_sweep` composes
MAX_SWEEP_CHECKS = 64


def precheck_sweep(argv: List[str]) -> None:
    """``-m`` (multirun): compose and validate every value of every swept override (each with
    the other sweeps at their first value, at most :data:`MAX_SWEEP_CHECKS` configurations: every
    one is a point of the grid), so that a bad value is one ``hetseq-hpc: error:`` line with
    exit code 2 naming it, before Hydra starts (it refused the sweep with a multi-line report).
    Sweeps Hydra cannot enumerate (``interval(...)``, for optimizers) are left to it.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        values = [
            list(o.sweep_string_iterator()) if o.is_sweep_override() else None for o in parsed
        ]
    except HydraException:
        return  # Hydra reports what it cannot parse or enumerate
    firsts = [
        f"{o.get_key_element()}={v[0]}" if v else text
        for o, v, text in zip(parsed, values, overrides)
    ]
    points = [firsts]
    for i, (override, swept) in enumerate(zip(parsed, values)):
        for value in (swept or [])[1:]:
            points.append([*firsts[:i], f"{override.get_key_element()}={value}", *firsts[i + 1 :]])
    try:
        for point in points[:MAX_SWEEP_CHECKS]:
            check_task_code(compose_run_config(point))
    except (HetseqError, HydraException) as exc:
        exit_one_line(exc)


def default_run_dir() -> str:
    """Hydra's default run directory (``hydra.run.dir`` of ``conf/config.yaml``, e.g.
    ``outputs/<date>/<time>``) resolved now, as Hydra would resolve it."""
    from hydra.core.utils import setup_globals

    setup_globals()  # Hydra's resolvers (${now:...})
    return str(OmegaConf.load(CONF_DIR / "config.yaml").hydra.run.dir)


def run_with_hydra(argv: List[str]) -> None:
    """Pre-check ``argv`` (Hydra overrides and flags), then start Hydra's entry point on it.

    A single run takes the run directory's lock first (:func:`hetseq_hpc.rundir.lock.acquire`,
    the default directory resolved here so the lock and Hydra agree on it): a directory in use
    by another run is refused in one line before Hydra writes ``.hydra/`` or anything else, and
    the launcher then holds the same lock. A run with nothing left to train (a finished run
    re-run: :func:`~hetseq_hpc.cli.preflight.say_if_finished`) says so and starts nothing.
    """
    global _RUN_DIR_EXISTED, _PARTITIONS
    register_configs()
    run = precheck_overrides(argv)
    argv, _PARTITIONS = split_partition_overrides(argv)
    if run is None:  # multirun, Hydra's flags: Hydra decides the directories
        explicit = any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv)
        _RUN_DIR_EXISTED = explicit and Path(run_dir_override(argv)).expanduser().exists()
        sys.argv = [sys.argv[0], *argv]
        _hydra_main()
        return
    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        argv = [*argv, f"hydra.run.dir={default_run_dir()}"]
    run_dir = Path(run_dir_override(argv)).expanduser()
    _RUN_DIR_EXISTED = run_dir.exists()
    # a new directory can only hold nothing to train through a trainer.resume file: said
    # before the directory is created
    if not _RUN_DIR_EXISTED and say_if_finished(run, run_dir):
        return
    try:
        lock = acquire(run_dir)
    except HetseqError as exc:
        exit_one_line(exc)
    try:
        if _RUN_DIR_EXISTED:
            refuse_rewinding_a_finished_run(run, run_dir)
            if say_if_finished(run, run_dir):
                return
        sys.argv = [sys.argv[0], *argv]
        _hydra_main()
    finally:
        lock.release()
