"""The one place that composes ``hetseq_hpc/conf/``: Hydra's config loader, each command line once.

:class:`Composer` is a :class:`hydra.core.config_loader.ConfigLoader` around Hydra's own that
keeps every composition it made: a run's command line composed to validate it before anything
is written is the composition Hydra then starts the run from (handed to Hydra as its config
loader), and a sweep point composed to check it is the one Hydra's sweeper and launcher
plugins get. Design: docs/design/configuration.md.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from hydra import initialize_config_dir
from hydra.core.config_loader import ConfigLoader
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.errors import HydraException
from hydra.plugins.config_source import ConfigSource
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hetseq_hpc.config.conf_dir import CONF_DIR, CONFIG_NAME, VERSION_BASE
from hetseq_hpc.config.keys import describe_omegaconf_error
from hetseq_hpc.config.schema import register_configs
from hetseq_hpc.errors import ConfigError

#: a composition's key: config name, overrides, run or multirun
_Key = Tuple[Optional[str], Tuple[str, ...], RunMode]


class Composer(ConfigLoader):
    """Hydra's config loader of ``config_dir`` that composes each command line once.

    The first :meth:`load_configuration` of a (config name, overrides, mode) composes it with
    Hydra's loader; every later one returns a copy of that composition (Hydra changes what it
    is handed). Everything else is Hydra's loader's. Picklable, as launcher plugins that
    start jobs in other processes pickle their config loader (compositions included).

    Args:
        config_dir: the YAML config groups (default :data:`CONF_DIR`).
    """

    def __init__(self, config_dir: Optional[Union[str, Path]] = None) -> None:
        register_configs()
        self.config_dir = Path(config_dir if config_dir is not None else CONF_DIR).resolve()
        with initialize_config_dir(config_dir=str(self.config_dir), version_base=VERSION_BASE):
            hydra = GlobalHydra.instance().hydra
            assert hydra is not None
            self._hydra_loader: ConfigLoader = hydra.config_loader
        self._composed: Dict[_Key, DictConfig] = {}

    def compose(self, overrides: Sequence[str], run_mode: RunMode = RunMode.RUN) -> DictConfig:
        """The composition of ``conf/config.yaml`` with ``overrides``, Hydra's node included
        (``hydra.run.dir``, ``hydra.overrides``, ...), composed once.

        Raises:
            ConfigError: an unknown key or option, a bad value or override (one line).
        """
        try:
            # from_shell=False: Hydra's compose API's messages (only they differ)
            return self.load_configuration(CONFIG_NAME, list(overrides), run_mode, from_shell=False)
        except (HydraException, OmegaConfBaseException) as exc:
            raise ConfigError(describe_omegaconf_error(exc)) from None

    # ------------------------------------------------------------ Hydra's ConfigLoader
    def load_configuration(
        self,
        config_name: Optional[str],
        overrides: List[str],
        run_mode: RunMode,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        """Hydra's composition of ``config_name`` with ``overrides``; a copy of the earlier
        one when this command line was composed before."""
        key = (config_name, tuple(overrides), run_mode)
        if key not in self._composed:
            self._composed[key] = self._hydra_loader.load_configuration(
                config_name=config_name,
                overrides=list(overrides),
                run_mode=run_mode,
                from_shell=from_shell,
                validate_sweep_overrides=validate_sweep_overrides,
            )
        return copy.deepcopy(self._composed[key])

    def load_sweep_config(
        self, master_config: DictConfig, sweep_overrides: List[str]
    ) -> DictConfig:
        """One point of a sweep, as Hydra's loader builds it (the sweep's own Hydra overrides,
        then the point's; resolver caches copied, so timestamps agree), composed once."""
        hydra_overrides = OmegaConf.to_container(master_config.hydra.overrides.hydra)
        assert isinstance(hydra_overrides, list)
        point = self.load_configuration(
            config_name=master_config.hydra.job.config_name,
            overrides=[*map(str, hydra_overrides), *sweep_overrides],
            run_mode=RunMode.RUN,
        )
        OmegaConf.copy_cache(from_config=master_config, to_config=point)
        return point

    def get_search_path(self) -> ConfigSearchPath:
        """Hydra's loader's search path."""
        return self._hydra_loader.get_search_path()

    def get_sources(self) -> List[ConfigSource]:
        """Hydra's loader's config sources."""
        return self._hydra_loader.get_sources()

    def list_groups(self, parent_name: str) -> List[str]:
        """Hydra's loader's config groups under ``parent_name``."""
        return self._hydra_loader.list_groups(parent_name)

    def get_group_options(
        self,
        group_name: str,
        results_filter: Optional[ObjectType] = ObjectType.CONFIG,
        config_name: Optional[str] = None,
        overrides: Optional[List[str]] = None,
    ) -> List[str]:
        """Hydra's loader's options of ``group_name`` (glob sweeps ask it)."""
        return self._hydra_loader.get_group_options(
            group_name, results_filter, config_name, overrides
        )

    def compute_defaults_list(
        self, config_name: Optional[str], overrides: List[str], run_mode: RunMode
    ) -> Any:
        """Hydra's loader's defaults list."""
        return self._hydra_loader.compute_defaults_list(config_name, overrides, run_mode)
