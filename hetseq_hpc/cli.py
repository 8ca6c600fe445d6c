"""Command line: ``python -m hetseq_hpc`` / ``hetseq-hpc``: the Hydra entry point of ``run``.

:func:`main` hands ``sys.argv`` to :mod:`hetseq_hpc.commands` (the subcommands: run, plan,
probe, render, report, prepare; ``run`` is the default). ``run`` composes ``conf/`` with the
command-line overrides, validates the whole configuration (nothing starts on a bad value), then
hands the run to the cluster's launcher. Errors are one line on stderr: exit code 2 for
configuration errors, 1 for failures while running.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig

from hetseq_hpc.commands.resume import check_resume
from hetseq_hpc.config import (
    CONF_DIR,
    RunConfig,
    compose_run_config,
    register_configs,
    to_run_config,
)
from hetseq_hpc.config.compose import apply_empty_dict_overrides
from hetseq_hpc.errors import ConfigError, HetseqError, Preempted

log = logging.getLogger("hetseq_hpc")


def dispatch(run: RunConfig, run_dir: Path) -> Dict[str, Any]:
    """Start ``run`` with the launcher its cluster names; returns the launcher's result."""
    if run.cluster.is_local:
        from hetseq_hpc.launch.local import launch_local

        summary = launch_local(run, run_dir)
        _report(summary, run_dir)
        return summary
    from hetseq_hpc.launch.slurm import launch_slurm

    return launch_slurm(run, run_dir)


def _report(summary: Dict[str, Any], run_dir: Path) -> None:
    if not summary:
        return
    val = summary.get("validation") or {}
    log.info(
        "done: %s steps, loss %.4f -> %.4f, validation %s, %.1f samples/s",
        summary.get("final_step"), summary.get("first_loss") or float("nan"),
        summary.get("final_loss") or float("nan"),
        ", ".join(f"{k[4:] if k.startswith('val_') else k} {v:.4g}" for k, v in val.items())
        or "n/a", summary.get("samples_per_s") or 0.0,
    )
    for rank in summary.get("ranks", []):
        thr = rank.get("samples_per_compute_s")
        log.info("  rank %d %-28s %5d samples, %s samples/s", rank["rank"], rank["device"],
                 rank["samples"], f"{thr:.1f}" if thr else "n/a")
    log.info("metrics: %s  allocation: %s", run_dir / "metrics.jsonl", run_dir / "allocation.json")


#: whether the run directory existed before Hydra started (set by :func:`run_with_hydra`)
_RUN_DIR_EXISTED = False


def dispatch_or_exit(run: RunConfig, run_dir: Path, new_dir: bool = False) -> Any:
    """:func:`dispatch`, with every error as one ``hetseq-hpc: error:`` line and its exit
    code. A SLURM run refused before anything was submitted (``sinfo`` checks, ``sbatch``
    refusing, Slurm missing) removes the run directory when it was ``new_dir`` (created by
    Hydra for this attempt): a rejected attempt leaves nothing behind. A job that stopped after
    a checkpoint and will not go on by itself (its requeues used up) exits 3 with the command
    that continues it."""
    try:
        return dispatch(run, run_dir)
    except Preempted as exc:  # not a failure: stopped after a checkpoint
        print(f"hetseq-hpc: {exc}", file=sys.stderr)
        sys.exit(3)
    except HetseqError as exc:
        if new_dir and not run.cluster.is_local and not (run_dir / "job.json").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
    except KeyboardInterrupt:
        print(f"hetseq-hpc: interrupted; the ranks checkpointed after their last step: continue "
              f"with hydra.run.dir={run_dir} trainer.resume=auto", file=sys.stderr)
        sys.exit(130)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Any:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    new_dir = not _RUN_DIR_EXISTED
    try:
        apply_empty_dict_overrides(cfg, list(hydra_cfg.overrides.task))
        run = to_run_config(cfg)
    except ConfigError as exc:
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        sys.exit(2)
    return dispatch_or_exit(run, run_dir, new_dir)


def run_dir_problem(path: str) -> Optional[str]:
    """Why the run directory ``path`` cannot be created or written, or None if it can: its
    nearest existing ancestor must be a writable directory."""
    target = Path(os.path.expanduser(path)).absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def _run_dir_override(argv: List[str]) -> str:
    """The value of the last ``hydra.run.dir=`` override (Hydra's grammar, quotes removed), else
    the working directory (the default run directory lies below it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    wanted = [a for a in argv if a.lstrip("+").startswith("hydra.run.dir=")]
    if not wanted:
        return "."
    parsed = OverridesParser.create().parse_overrides(wanted[-1:])
    return str(parsed[0].value())


def precheck_overrides(argv: List[str]) -> None:
    """Compose and validate the config once before Hydra does, so that a bad override (unknown
    key, wrong type, out-of-range value, missing group option) or an unwritable
    ``hydra.run.dir`` is one ``hetseq-hpc: error:`` line with exit code 2 instead of Hydra's
    multi-line report, and nothing is created. Skipped for multirun and Hydra's own flags, which
    Hydra handles.
    """
    if any(arg.startswith("-") for arg in argv):
        return
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    try:
        run = compose_run_config(overrides)
        run_dir = _run_dir_override(argv)
        problem = run_dir_problem(run_dir)
        if problem:
            raise ConfigError(f"hydra.run.dir={run_dir} cannot be created ({problem}): choose a "
                              "writable directory, e.g. hydra.run.dir=runs/my-run")
        check_resume(run, Path(run_dir) if run_dir != "." else None)
    except ConfigError as exc:
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except HetseqError as exc:  # the checkpoint to resume from is missing or does not fit
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except HydraException as exc:  # Hydra's parser on a malformed hydra.run.dir override
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"hetseq-hpc: error: {message}", file=sys.stderr)
        sys.exit(2)


def run_with_hydra(argv: List[str]) -> None:
    """Pre-check ``argv`` (Hydra overrides and flags), then start Hydra's entry point on it."""
    global _RUN_DIR_EXISTED
    register_configs()
    precheck_overrides(argv)
    explicit = any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv)
    _RUN_DIR_EXISTED = explicit and Path(_run_dir_override(argv)).expanduser().exists()
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()


def main() -> None:
    """Console entry point (``hetseq-hpc``, ``python -m hetseq_hpc``): the subcommands of
    :mod:`hetseq_hpc.commands`."""
    from hetseq_hpc.commands import main as commands_main

    sys.exit(commands_main(sys.argv[1:]))
