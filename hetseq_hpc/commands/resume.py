"""Continue a run from its saved ``hetseq_config.yaml``, and the resume checks that run before
any process starts.

``hetseq-hpc hydra.run.dir=runs/a`` on a directory holding an earlier run continues it: the
saved configuration is the base and the command line's overrides go on top (``cluster.ranks=1``
to resume on fewer ranks), so nothing typed the first time must be typed again. The merged
configuration is validated and checked against the checkpoint the run would resume from
(:func:`hetseq_hpc.train.state.check_fingerprint`, on the checkpoint's stored fingerprint)
BEFORE anything is written; the run then starts without Hydra, so the earlier run's
``.hydra/`` (its original command line) is never overwritten, and ``cli.log`` is appended to.
``trainer.resume=never`` starts over from ``conf/`` as before.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from hetseq_hpc.errors import CheckpointError, ConfigError

log = logging.getLogger("hetseq_hpc")

#: Hydra's default console/file log format (hydra/conf/hydra/job_logging/default.yaml)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def saved_config(argv: Sequence[str]) -> Optional[Path]:
    """``<hydra.run.dir>/hetseq_config.yaml`` when the command line names a run directory
    that holds one, else None."""
    from hetseq_hpc.cli import _run_dir_override
    from hetseq_hpc.worker import CONFIG_NAME

    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        return None
    path = Path(_run_dir_override(list(argv))).expanduser() / CONFIG_NAME
    return path if path.is_file() else None


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def merge_overrides(saved: DictConfig, overrides: Sequence[str],
                    earlier: Sequence[str] = ()) -> DictConfig:
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

    new_keys = [_key(o) for o in overrides]
    kept = [o for o in earlier if not _key(o).startswith("hydra.")
            and not any(_key(o) == k or _key(o).startswith(k + ".") for k in new_keys)]
    fresh = compose_run([*kept, *overrides])
    merged = saved.copy()
    with open_dict(merged):
        for override in OverridesParser.create().parse_overrides(list(overrides)):
            key = override.key_or_group
            value = OmegaConf.select(fresh, key, default=None, throw_on_missing=False)
            if isinstance(value, DictConfig):
                value = OmegaConf.to_container(value, resolve=False)
            OmegaConf.update(merged, key, value, merge=False, force_add=True)
    return merged


def earlier_overrides(run_dir: Path) -> List[str]:
    """The overrides the earlier run was started with (Hydra's ``.hydra/overrides.yaml``)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    try:
        loaded = OmegaConf.load(path)
    except Exception:
        return []
    return [str(o) for o in loaded] if OmegaConf.is_list(loaded) else []


def checkpoint_fingerprint(path: Path) -> Optional[Dict[str, Any]]:
    """The run fingerprint a checkpoint stores (its ``config`` entry), read memory-mapped so
    the weights are not loaded; None when the file cannot be read (the ranks verify it)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return state.get("config") if isinstance(state, dict) else None


def check_resume(run: Any, run_dir: Optional[Path]) -> None:
    """Before any process starts: an explicit ``trainer.resume`` file must exist, and the
    checkpoint the run would resume from must fit it (same checks the ranks make later,
    :func:`hetseq_hpc.train.state.check_fingerprint`).

    Raises:
        CheckpointError: the file is missing, or the checkpoint was trained with other settings
            (the ranks' one-line messages; exit code 1 as when a rank finds it).
    """
    from hetseq_hpc.train.checkpoint import list_checkpoints
    from hetseq_hpc.train.state import check_fingerprint, run_fingerprint

    resume = run.trainer.resume
    if resume == "never":
        return
    if resume == "auto":
        found = list_checkpoints(run_dir) if run_dir is not None else []
        if not found:
            return
        path = found[-1]
    else:
        path = Path(resume).expanduser()
        if not path.is_file():
            raise CheckpointError(f"trainer.resume={resume} does not exist: give the path of a "
                              "checkpoint (RUN_DIR/checkpoints/step_XXXXXXXX.pt), or "
                              "trainer.resume=auto / never")
    saved = checkpoint_fingerprint(path)
    if saved is None:
        return
    check_fingerprint(saved, run_fingerprint(run), str(path), run.trainer.allow_resume_mismatch)


def _log_to(run_dir: Path) -> None:
    """Console and ``<run dir>/cli.log`` (appended), as Hydra sets them up for a new run."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    formatter = logging.Formatter(LOG_FORMAT)
    for handler in (logging.StreamHandler(sys.stdout),
                    logging.FileHandler(run_dir / "cli.log", encoding="utf-8")):
        handler.setFormatter(formatter)
        root.addHandler(handler)


def resume_saved_run(argv: List[str]) -> Optional[int]:
    """Continue the run in ``hydra.run.dir`` from its saved configuration, if there is one and
    ``trainer.resume`` is not ``never``; returns the exit code, or None when there is nothing
    to continue (the caller starts a new run through Hydra).

    Raises:
        ConfigError: a bad override or a saved file that no longer validates.
        CheckpointError: a missing ``trainer.resume`` file or a checkpoint that does not fit
            (nothing is written).
    """
    from hetseq_hpc.cli import dispatch_or_exit
    from hetseq_hpc.config import to_run_config

    path = saved_config(argv)
    if path is None:
        return None
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    try:
        saved = OmegaConf.load(path)
    except Exception as exc:
        raise ConfigError(f"{path} is not valid YAML ({' '.join(str(exc).split())}): fix it, or "
                          "start over with trainer.resume=never") from None
    run = to_run_config(merge_overrides(saved, overrides, earlier_overrides(path.parent)))
    if run.trainer.resume == "never":
        return None
    run_dir = path.parent.resolve()
    check_resume(run, run_dir)
    _log_to(run_dir)
    log.info("continuing %s from its saved %s%s", run_dir, path.name,
             f" with {' '.join(overrides)}" if overrides else "")
    dispatch_or_exit(run, run_dir)
    return 0
