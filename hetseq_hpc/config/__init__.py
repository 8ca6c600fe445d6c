"""Run configuration: schemas, composition, loading/saving, and validation.

- :mod:`~hetseq_hpc.config.tasks`, :mod:`~hetseq_hpc.config.cluster`,
  :mod:`~hetseq_hpc.config.trainer`, :mod:`~hetseq_hpc.config.balance`,
  :mod:`~hetseq_hpc.config.comm`, :mod:`~hetseq_hpc.config.rank_precision`,
  :mod:`~hetseq_hpc.config.plan`: the groups' schema dataclasses (each checks its fields);
- :mod:`~hetseq_hpc.config.aliases`: keys that moved between groups, still accepted;
  :mod:`~hetseq_hpc.config.schema`: :class:`RunConfig` and the Hydra ConfigStore registration;
- :mod:`~hetseq_hpc.config.compose`: :func:`compose_run` / :func:`compose_run_config`, the one way
  to compose ``conf/`` (package data) with overrides (command line, planner, tests), through
  :mod:`~hetseq_hpc.config.composer` (Hydra's config loader, each command line once);
- :mod:`~hetseq_hpc.config.keys`: unknown keys ("did you mean") and one-line type errors;
- :mod:`~hetseq_hpc.config.validate`: checks that span groups (world size, data files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hetseq_hpc.config.aliases import migrate_saved
from hetseq_hpc.config.compose import compose_run, compose_run_config
from hetseq_hpc.config.conf_dir import CONF_DIR
from hetseq_hpc.config.keys import check_known_keys, describe_omegaconf_error
from hetseq_hpc.config.schema import (
    CLUSTER_SCHEMAS,
    TASK_SCHEMAS,
    BalanceConfig,
    BertTaskConfig,
    ClusterConfig,
    CommConfig,
    LocalClusterConfig,
    OptimConfig,
    PartitionConfig,
    PrecisionConfig,
    RunConfig,
    SlurmClusterConfig,
    TrainerConfig,
    register_configs,
)
from hetseq_hpc.config.validate import planned_world_size, validate_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.files.atomic import atomic_write_text
from hetseq_hpc.files.user_input import file_problem

__all__ = [
    "CONF_DIR",
    "BalanceConfig",
    "BertTaskConfig",
    "ClusterConfig",
    "CommConfig",
    "LocalClusterConfig",
    "OptimConfig",
    "PartitionConfig",
    "PrecisionConfig",
    "RunConfig",
    "SlurmClusterConfig",
    "TrainerConfig",
    "compose_run",
    "compose_run_config",
    "load_run_config",
    "planned_world_size",
    "register_configs",
    "save_run_config",
    "to_run_config",
    "validate_run_config",
]


def _typed(cfg: Any) -> DictConfig:
    """Merge a plain or composed config onto the schemas its ``task.name``/``cluster.name`` pick."""
    raw = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    saved = OmegaConf.to_container(raw, resolve=False, throw_on_missing=False)
    if isinstance(saved, dict):
        migrated = migrate_saved(saved)  # a config written before keys moved between groups
        if migrated != saved:
            raw = OmegaConf.create(migrated)
    task_name = OmegaConf.select(raw, "task.name", default=None)
    cluster_name = OmegaConf.select(raw, "cluster.name", default=None)
    if task_name not in TASK_SCHEMAS:
        raise ConfigError(
            f"task={task_name!r} is unknown: choose one of {sorted(TASK_SCHEMAS)} (e.g. task=bert)"
        )
    if cluster_name not in CLUSTER_SCHEMAS:
        raise ConfigError(
            f"cluster.name={cluster_name!r} is unknown: use local or slurm "
            "(e.g. cluster=local, cluster=mixed)"
        )
    container = OmegaConf.to_container(raw, resolve=False, throw_on_missing=False)
    if isinstance(container, dict):
        check_known_keys(container, RunConfig, TASK_SCHEMAS, CLUSTER_SCHEMAS)
    base = OmegaConf.structured(RunConfig)
    base.task = OmegaConf.structured(TASK_SCHEMAS[task_name])
    base.cluster = OmegaConf.structured(CLUSTER_SCHEMAS[cluster_name])
    return OmegaConf.merge(base, raw)


def to_run_config(cfg: Union[DictConfig, dict]) -> RunConfig:
    """Turn a composed Hydra config (or a plain dict of the same shape) into a validated RunConfig.

    Every schema's ``__post_init__`` runs, then :func:`validate_run_config` checks values that
    span groups. Nothing is started.

    Raises:
        ConfigError: a value is missing, of the wrong type, or out of range (one line, with fix).
    """
    try:
        typed = _typed(cfg)
        run = OmegaConf.to_object(typed)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        # OmegaConf wraps errors raised in __post_init__; surface ours unchanged.
        cause = exc.__cause__ or exc.__context__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(describe_omegaconf_error(exc)) from None
    if not isinstance(run, RunConfig):  # pragma: no cover - OmegaConf returns the schema type
        raise ConfigError(f"configuration did not build a RunConfig (got {type(run).__name__})")
    validate_run_config(run)
    return run


def save_run_config(run: RunConfig, path: Union[str, Path]) -> Path:
    """Write ``run`` as resolved YAML (what workers and sbatch templates read back)."""
    return atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.structured(run)))


def load_run_config(path: Union[str, Path]) -> RunConfig:
    """Read a YAML written by :func:`save_run_config` (or by hand) and validate it.

    Raises:
        ConfigError: the file is missing, not YAML, or holds invalid values.
    """
    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise ConfigError(
            f"config file {str(path)!r} {problem}: pass the hetseq_config.yaml of a run "
            "directory (written by python -m hetseq_hpc)"
        )
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends
        detail = " ".join(str(exc).split())
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML ({detail}): fix or rewrite it"
        ) from None
    return to_run_config(raw)
