"""One way to compose ``conf/`` with overrides, for the CLI pre-check, the planner and the tests.

:func:`compose_run` is Hydra's compose API (https://hydra.cc/docs/advanced/compose_api/) on
``conf/config.yaml`` plus one correction: Hydra *merges* a dict override into the existing
dict, so ``cluster.partitions={}`` used to change nothing; here (and in the CLI's Hydra
entry point, through :func:`apply_empty_dict_overrides`) ``key={}`` empties the node, as
written. :func:`compose_run_config` also validates the result into a :class:`RunConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hetseq_hpc.config.keys import describe_omegaconf_error
from hetseq_hpc.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.config.schema import RunConfig


def apply_empty_dict_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Make every ``key={}`` override of a mapping empty it (Hydra merges it into the old dict).

    Args:
        cfg: the composed configuration (changed in place).
        overrides: the command-line overrides it was composed with.

    Raises:
        ConfigError: an override cannot be parsed (Hydra's grammar).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(describe_omegaconf_error(exc)) from None
    for override in parsed:
        if override.is_delete() or override.is_sweep_override():
            continue
        if override.value() != {}:
            continue
        key = override.key_or_group
        node = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        # only mappings (partitions, env, extra_sbatch): a schema node keeps its fields
        if isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict and len(node) > 0:
            with open_dict(cfg):
                OmegaConf.update(cfg, key, {}, merge=False, force_add=True)


def compose_run(overrides: Sequence[str] = (), config_dir: Optional[Union[str, Path]] = None,
                config_name: str = "config") -> DictConfig:
    """Compose ``<config_dir>/<config_name>.yaml`` (default: the package's ``conf/``) with
    ``overrides``, as ``python -m hetseq_hpc`` would, without starting anything.

    Must not run inside another Hydra context (``initialize_config_dir`` or a ``@hydra.main``
    task function): Hydra has one global state.

    Raises:
        ConfigError: an unknown key or group option, a value of the wrong type, a bad override
            (one line, with the fix).
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from hetseq_hpc.config.aliases import migrate_overrides
    from hetseq_hpc.config.schema import register_configs

    overrides = migrate_overrides(overrides)
    if config_dir is None:
        from hetseq_hpc.config import CONF_DIR

        config_dir = CONF_DIR
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(describe_omegaconf_error(exc)) from None
    apply_empty_dict_overrides(cfg, overrides)
    return cfg


def compose_run_config(overrides: Sequence[str] = (),
                       config_dir: Optional[Union[str, Path]] = None) -> RunConfig:
    """:func:`compose_run`, then :func:`hetseq_hpc.config.to_run_config` (every check runs).

    Raises:
        ConfigError: any invalid override or value (one line, with the fix).
    """
    from hetseq_hpc.config import to_run_config

    return to_run_config(compose_run(overrides, config_dir))
