"""A run directory's saved configuration with a new command line on top: how a resumed run's
configuration is made (:func:`hetseq_hpc.cli.load.load_saved_run` reads it).

``hetseq-hpc hydra.run.dir=runs/a`` on a directory holding an earlier run continues it: the
saved ``hetseq_config.yaml`` is the base and the command line's overrides go on top
(``cluster.ranks=1`` to resume on fewer ranks, :func:`merge_overrides`), so nothing typed the
first time must be typed again; a user task module only the saved file names is not imported
unless the command line names it (:func:`guard_saved_task`). The run then starts without Hydra
(:func:`hetseq_hpc.cli.start.continue_saved_run`), so the earlier run's ``.hydra/`` (its
original command line) is never overwritten. ``trainer.resume=never`` starts over from
``conf/`` as before.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from hetseq_hpc.cli.overrides import override_key, override_value
from hetseq_hpc.config import compose_run
from hetseq_hpc.config.aliases import migrate_overrides
from hetseq_hpc.config.compose import is_hydra_override, split_partition_overrides
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.rundir.paths import RunDir


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
    overrides, partitions = split_partition_overrides(overrides)
    new_keys = [override_key(o) for o in overrides]
    kept = [
        o
        for o in earlier
        if not is_hydra_override(o)
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


def earlier_overrides(run_dir: RunDir) -> List[str]:
    """The overrides the earlier run was started with (Hydra's ``.hydra/overrides.yaml``)."""
    path = run_dir.hydra_overrides
    try:
        loaded = OmegaConf.load(path)
    except Exception:
        return []
    if not OmegaConf.is_list(loaded):
        return []
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


def guard_saved_task(
    merged: DictConfig, overrides: Sequence[str], run_dir: RunDir
) -> Optional[str]:
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
            f"{run_dir.config} names task.target={target} (code in {shown}), "
            "which is not imported unless you name it: repeat task.target="
            f"{target} task.path={folder} on the command line, or add "
            "trainer.trust_saved_task=true if you trust that file"
        )
    return f"{shown} (task.target={target})"
