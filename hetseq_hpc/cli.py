"""Command line: ``python -m hetseq_hpc`` / ``hetseq-hpc`` (Hydra).

Composes ``conf/`` with the command-line overrides, validates the whole configuration
(nothing starts on a bad value), then hands the run to the cluster's launcher. Errors are one
line on stderr: exit code 2 for configuration errors, 1 for failures while running.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig

from hetseq_hpc.config import (
    CONF_DIR,
    RunConfig,
    compose_run_config,
    register_configs,
    to_run_config,
)
from hetseq_hpc.config.compose import apply_empty_dict_overrides
from hetseq_hpc.errors import ConfigError, HetseqError

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
        "done: %s steps, loss %.4f -> %.4f, validation loss %s (ppl %s), %.1f samples/s",
        summary.get("final_step"), summary.get("first_loss") or float("nan"),
        summary.get("final_loss") or float("nan"),
        f"{val['val_loss']:.4f}" if val else "n/a", f"{val['val_ppl']:.1f}" if val else "n/a",
        summary.get("samples_per_s") or 0.0,
    )
    for rank in summary.get("ranks", []):
        thr = rank.get("samples_per_compute_s")
        log.info("  rank %d %-28s %5d samples, %s samples/s", rank["rank"], rank["device"],
                 rank["samples"], f"{thr:.1f}" if thr else "n/a")
    log.info("metrics: %s  allocation: %s", run_dir / "metrics.jsonl", run_dir / "allocation.json")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Any:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    try:
        apply_empty_dict_overrides(cfg, list(hydra_cfg.overrides.task))
        run = to_run_config(cfg)
        return dispatch(run, run_dir)
    except ConfigError as exc:
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except HetseqError as exc:
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"hetseq-hpc: interrupted; the ranks checkpointed after their last step: continue "
              f"with hydra.run.dir={run_dir} trainer.resume=auto", file=sys.stderr)
        sys.exit(130)


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
        compose_run_config(overrides)
        run_dir = _run_dir_override(argv)
        problem = run_dir_problem(run_dir)
        if problem:
            raise ConfigError(f"hydra.run.dir={run_dir} cannot be created ({problem}): choose a "
                              "writable directory, e.g. hydra.run.dir=runs/my-run")
    except ConfigError as exc:
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except HydraException as exc:  # Hydra's parser on a malformed hydra.run.dir override
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"hetseq-hpc: error: {message}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    """Console entry point (``hetseq-hpc``)."""
    register_configs()
    precheck_overrides(sys.argv[1:])
    _hydra_main()
