"""Command line: ``python -m hetseq_hpc`` / ``hetseq-hpc`` (Hydra).

Composes ``conf/`` with the command-line overrides, validates the whole configuration
(nothing starts on a bad value), then hands the run to the cluster's launcher. Errors are one
line on stderr: exit code 2 for configuration errors, 1 for failures while running.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Dict, List

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from hetseq_hpc.config import CONF_DIR, RunConfig, register_configs, to_run_config
from hetseq_hpc.errors import ConfigError, HetseqError

log = logging.getLogger("hetseq_hpc")


def dispatch(run: RunConfig, run_dir: Path) -> Dict[str, Any]:
    """Start ``run`` with the launcher its cluster names; returns the launcher's result."""
    if run.cluster.name == "local":
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
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    try:
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


def precheck_overrides(argv: List[str]) -> None:
    """Compose the config once before Hydra does, so that a bad override (unknown key, wrong
    type, missing group option) is one ``hetseq-hpc: error:`` line with exit code 2 instead of
    Hydra's multi-line report. Skipped for multirun and Hydra's own flags, which Hydra handles.
    """
    if any(arg.startswith("-") for arg in argv):
        return
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        key = getattr(exc, "full_key", None)
        if key and key not in message:
            message = f"{key}: {message}"
        print(f"hetseq-hpc: error: {message}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    """Console entry point (``hetseq-hpc``)."""
    register_configs()
    precheck_overrides(sys.argv[1:])
    _hydra_main()
