"""Continue a run from its saved ``hetseq_config.yaml`` (``hetseq-hpc run`` on a used run
directory), without Hydra.

``hetseq-hpc hydra.run.dir=runs/a`` on a directory holding an earlier run continues it: the
saved configuration is the base and the command line's overrides go on top (``cluster.ranks=1``
to resume on fewer ranks), so nothing typed the first time must be typed again. The merged
configuration is validated and checked against the checkpoint the run would resume from
(:func:`hetseq_hpc.train.state.check_fingerprint`, on the checkpoint's stored fingerprint)
BEFORE anything is written; the run then starts without Hydra, so the earlier run's
``.hydra/`` (its original command line) is never overwritten, and ``cli.log`` is appended to.
A finished run says so in one line and starts nothing. ``trainer.resume=never`` starts over
from ``conf/`` as before.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from hetseq_hpc.cli.dispatch import dispatch_or_exit
from hetseq_hpc.cli.overrides import (
    override_key,
    override_value,
    run_dir_override,
    run_dir_problem,
    run_dir_refusal,
)
from hetseq_hpc.cli.preflight import (
    check_model_fits,
    check_resume,
    check_task_code,
    refuse_rewinding_a_finished_run,
    say_if_finished,
)
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.rundir.lock import lock_run_dir
from hetseq_hpc.rundir.logs import open_run_log
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger("hetseq_hpc")

#: Hydra's default console/file log format (hydra/conf/hydra/job_logging/default.yaml)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def saved_config(argv: Sequence[str]) -> Optional[Path]:
    """``<hydra.run.dir>/hetseq_config.yaml`` when the command line names a run directory
    that holds one, else None."""
    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        return None
    path = RunDir(Path(run_dir_override(argv)).expanduser()).config
    return path if path.is_file() else None


def merge_overrides(
    saved: DictConfig, overrides: Sequence[str], earlier: Sequence[str] = ()
) -> DictConfig:
    """``saved`` with ``overrides`` applied on top. Hydra parses and types them: they are
    composed onto ``conf/`` after the ``earlier`` run's own overrides (its
    ``.hydra/overrides.yaml``: the same group choices), minus those the new ones replace; then
    a group choice (``cluster=mixed``) replaces the whole group in ``saved`` and ``key=value``
    one value.

    Raises:
        ConfigError: an override Hydra rejects (one line).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hetseq_hpc.config import compose_run
    from hetseq_hpc.config.compose import split_partition_overrides

    overrides, partitions = split_partition_overrides(overrides)
    new_keys = [override_key(o) for o in overrides]
    kept = [
        o
        for o in earlier
        if not override_key(o).startswith("hydra.")
        and not any(override_key(o) == k or override_key(o).startswith(k + ".") for k in new_keys)
    ]
    fresh = compose_run([*kept, *overrides])
    merged = saved.copy()
    with open_dict(merged):
        for override in OverridesParser.create().parse_overrides(list(overrides)):
            key = override.key_or_group
            value = OmegaConf.select(fresh, key, default=None, throw_on_missing=False)
            if isinstance(value, DictConfig):
                value = OmegaConf.to_container(value, resolve=False)
            OmegaConf.update(merged, key, value, merge=False, force_add=True)
        for name, text in partitions:  # a whole partition: merged into the saved one
            value = OverridesParser.create().parse_overrides([f"x={text}"])[0].value()
            saved_part = OmegaConf.select(merged, f"cluster.partitions.{name}", default=None)
            whole = OmegaConf.merge(saved_part, value) if saved_part is not None else value
            OmegaConf.update(
                merged, f"cluster.partitions.{name}", whole, merge=False, force_add=True
            )
    return merged


def earlier_overrides(run_dir: Path) -> List[str]:
    """The overrides the earlier run was started with (Hydra's ``.hydra/overrides.yaml``)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    try:
        loaded = OmegaConf.load(path)
    except Exception:
        return []
    if not OmegaConf.is_list(loaded):
        return []
    from hetseq_hpc.config.aliases import migrate_overrides

    return migrate_overrides([str(o) for o in loaded])  # a run started before keys moved


def task_module_file(target: str, path: Optional[str]) -> Optional[Path]:
    """The file that importing ``target``'s module would run, found WITHOUT importing anything
    (``task.path`` first, then ``sys.path``); None when it is not found."""
    parts = str(target).rsplit(".", 1)[0].split(".")
    roots = ([path] if path else []) + [entry or os.getcwd() for entry in sys.path]
    for root in roots:
        base = Path(os.path.expanduser(str(root))).joinpath(*parts)
        for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate.resolve()
    return None


def guard_saved_task(merged: DictConfig, overrides: Sequence[str], run_dir: Path) -> Optional[str]:
    """Refuse to import a user task module that only the saved configuration names.

    Continuing a run directory (maybe copied or shared by someone else) would import the
    module its ``hetseq_config.yaml`` names in ``task.target``/``task.path``: code the person
    typing the command never named. It is imported only when the command line names it again
    (``task.target=...``, ``task.path=...`` or ``task=...``) or says
    ``trainer.trust_saved_task=true``.

    Returns:
        ``"<file> (task.target=...)"`` to name in the console, or None for a built-in task.

    Raises:
        ConfigError: the saved configuration alone names the module (one line: the file and
            the two ways to go on). Nothing has been imported or written.
    """
    target = OmegaConf.select(merged, "task.target", default=None)
    if not target:
        return None
    folder = OmegaConf.select(merged, "task.path", default=None)
    where = task_module_file(str(target), folder)
    shown = str(where) if where else f"module {str(target).rsplit('.', 1)[0]!r} (not found)"
    named = {override_key(o) for o in overrides} & {"task", "task.target", "task.path"}
    # the command line's own word only: a saved config's value could be the directory's writer's
    if not named and override_value(overrides, "trainer.trust_saved_task") is not True:
        raise ConfigError(
            f"{run_dir / 'hetseq_config.yaml'} names task.target={target} (code in {shown}), "
            "which is not imported unless you name it: repeat task.target="
            f"{target} task.path={folder} on the command line, or add "
            "trainer.trust_saved_task=true if you trust that file"
        )
    return f"{shown} (task.target={target})"


def _log_to(run_dir: Path) -> None:
    """Console and ``<run dir>/cli.log`` (appended), as Hydra sets them up for a new run."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    formatter = logging.Formatter(LOG_FORMAT)
    for handler in (logging.StreamHandler(sys.stdout), open_run_log(RunDir(run_dir).cli_log)):
        if handler is not None:  # cli.log that cannot be opened: one warning, console only
            handler.setFormatter(formatter)
            root.addHandler(handler)


def resume_saved_run(argv: List[str]) -> Optional[int]:
    """Continue the run in ``hydra.run.dir`` from its saved configuration, if there is one and
    ``trainer.resume`` is not ``never``; returns the exit code, or None when there is nothing
    to continue (the caller starts a new run through Hydra).

    The run directory is locked (:func:`hetseq_hpc.rundir.lock.lock_run_dir`) before anything
    is written; a finished run (the checkpoint at ``trainer.max_steps``) says so in one line,
    exit 0, and nothing starts.

    Raises:
        ConfigError: a bad override, a saved file that no longer validates, or a run
            directory on a read-only or full filesystem (nothing is written).
        CheckpointError: a missing ``trainer.resume`` file or a checkpoint that does not fit
            (nothing is written).
        LaunchError: another run holds the run directory (nothing is written).
    """
    from hetseq_hpc.config import to_run_config

    path = saved_config(argv)
    if path is None:
        return None
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    try:
        saved = OmegaConf.load(path)
    except Exception as exc:
        raise ConfigError(
            f"{path} is not valid YAML ({' '.join(str(exc).split())}): fix it, or "
            "start over with trainer.resume=never"
        ) from None
    resume = override_value(overrides, "trainer.resume")
    if (resume if resume is not None else OmegaConf.select(saved, "trainer.resume")) == "never":
        return None  # a new run: nothing of the saved configuration is used (or imported)
    run_dir = path.parent.resolve()
    problem = run_dir_problem(str(run_dir))  # read-only or full: refused, nothing written
    if problem:
        raise run_dir_refusal(str(run_dir), problem)
    merged = merge_overrides(saved, overrides, earlier_overrides(path.parent))
    task_code = guard_saved_task(merged, overrides, run_dir)
    run = to_run_config(merged)
    check_task_code(run)  # imports the task module the user named (or trusted)
    check_model_fits(run)
    with lock_run_dir(run_dir):  # before anything is written: a run turned away writes nothing
        check_resume(run, run_dir)
        refuse_rewinding_a_finished_run(run, run_dir)
        if say_if_finished(run, run_dir):  # a finished run: nothing started or rewritten
            return 0
        _log_to(run_dir)
        log.info(
            "continuing %s from its saved %s%s",
            run_dir,
            path.name,
            f" with {' '.join(overrides)}" if overrides else "",
        )
        if task_code:
            log.info("task code imported from %s", task_code)
        dispatch_or_exit(run, run_dir)
    return 0
