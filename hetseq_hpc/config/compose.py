"""One way to compose ``conf/`` with overrides, for the command line, the planner and the tests.

:func:`compose_run` is Hydra's composition (:class:`hetseq_hpc.config.composer.Composer`, the
one place that composes) of ``conf/config.yaml`` plus two corrections (:func:`job_config`):
Hydra *merges* a dict override into the existing dict, so ``cluster.partitions={}`` used to
change nothing; here ``key={}`` empties the node, as written; and a whole new partition
(``+cluster.partitions.xp={...}``), which Hydra cannot add, is added after it composed.
:func:`compose_run_config` also validates the result into a :class:`RunConfig`.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hetseq_hpc.config.keys import describe_omegaconf_error
from hetseq_hpc.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.config.schema import RunConfig


def is_hydra_override(override: str) -> bool:
    """Whether ``override`` sets Hydra's own configuration, as Hydra tells them apart
    (``hydra.run.dir=runs/a``, ``hydra/launcher=joblib``), not the run's."""
    key = override.lstrip("+~").partition("=")[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def run_overrides(argv: Sequence[str]) -> List[str]:
    """The overrides of the run itself in a command line: Hydra's flags (``-m``) and Hydra's
    own overrides (:func:`is_hydra_override`) left out, the order kept."""
    return [a for a in argv if not a.startswith("-") and not is_hydra_override(a)]


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


#: ``[+|++]cluster.partitions.<name>={...}``: a whole partition given on the command line
_NEW_PARTITION = re.compile(r"\+{0,2}cluster\.partitions\.([^.=]+)=(\{.*\})", re.S)
#: ``[+|++]cluster.partitions.<name>=<anything else>``: not a partition
_NOT_A_PARTITION = re.compile(r"\+{0,2}(cluster\.partitions\.[^.=]+)=(.*)", re.S)


def split_partition_overrides(overrides: Sequence[str]) -> Tuple[List[str], List[Tuple[str, str]]]:
    """``(the other overrides, [(partition name, its {...} value)])``.

    Hydra cannot add a mapping as a new entry of ``cluster.partitions`` (a dict of typed
    :class:`~hetseq_hpc.config.cluster.PartitionConfig` nodes: "dict is not a subclass of
    PartitionConfig"), so ``+cluster.partitions.xp={gpu_type: titan_xp, nodes: 2}`` is taken
    out before Hydra composes and applied after (:func:`apply_partition_overrides`), with the
    same validation as a partition written in YAML.

    Raises:
        ConfigError: a partition given a value that is not a ``{...}`` mapping
            (``+cluster.partitions.xp=5``), a whole partition swept, or given whole and by field.
    """
    rest, parts = [], []
    for override in overrides:
        match = _NEW_PARTITION.fullmatch(override.strip())
        if match:
            parts.append((match.group(1), match.group(2)))
            continue
        other = _NOT_A_PARTITION.fullmatch(override.strip())
        if other:
            key, value = other.groups()
            raise ConfigError(
                f"{key}={value} is not a partition: give its fields in braces, "
                f"e.g. +{key}={{gpu_type: t4, nodes: 2, gpus_per_node: 4}} (quote "
                "it for the shell), or set one field, e.g. "
                f"{key}.nodes=2"
            )
        rest.append(override)
    for name, text in parts:
        key = f"cluster.partitions.{name}"
        if "},{" in text.replace(" ", ""):
            raise ConfigError(
                f"{key}={text} looks like a sweep: a whole partition cannot be "
                f"swept; sweep its fields instead, e.g. -m {key}.nodes=1,2"
            )
        others = [
            o
            for o in rest
            if o.lstrip("+~").startswith(key + ".") or o.lstrip("+~").split("=")[0] == key
        ]
        if others:
            raise ConfigError(
                f"{key} is given whole ({{...}}) and again by {others[0]}: put "
                f"every field into the one value, e.g. +{key}={{nodes: 2, ...}}"
            )
    return rest, parts


def apply_partition_overrides(cfg: DictConfig, parts: Sequence[Tuple[str, str]]) -> None:
    """Add (or merge into) ``cluster.partitions.<name>`` each ``{...}`` value, in order; an
    entry without ``partition`` is the Slurm partition of the same name.

    Raises:
        ConfigError: the cluster has no partitions (``cluster=local``), or a value does not parse
            or does not fit the partition schema (one line, naming the key).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from hetseq_hpc.config.cluster import PartitionConfig

    for name, text in parts:
        key = f"cluster.partitions.{name}"
        node = OmegaConf.select(cfg, "cluster.partitions", default=None)
        if not isinstance(node, DictConfig):
            raise ConfigError(
                f"{key}={text} needs a Slurm cluster: cluster=local has no "
                "partitions (choose one, e.g. cluster=mixed)"
            )
        try:
            value = OverridesParser.create().parse_overrides([f"x={text}"])[0].value()
            base = (
                node[name]
                if name in node
                else OmegaConf.structured(PartitionConfig(partition=name))
            )
            merged = OmegaConf.merge(base, value)
        except (HydraException, OmegaConfBaseException, ValueError) as exc:
            raise ConfigError(
                f"{key}={text} is not a valid partition "
                f"({describe_omegaconf_error(exc)}): give its fields, e.g. "
                f"+{key}={{gpu_type: t4, nodes: 2, gpus_per_node: 4}}"
            ) from None
        with open_dict(cfg):
            node[name] = merged


def job_config(
    cfg: DictConfig, overrides: Sequence[str], partitions: Sequence[Tuple[str, str]] = ()
) -> DictConfig:
    """A copy of Hydra's composition ``cfg`` as the run reads it: Hydra's node removed, then
    every ``key={}`` of ``overrides`` emptied (:func:`apply_empty_dict_overrides`) and the whole
    ``partitions`` added (:func:`apply_partition_overrides`). ``cfg`` stays as Hydra wrote it.

    Raises:
        ConfigError: an override or a partition that does not fit (one line).
    """
    job = copy.deepcopy(cfg)
    if "hydra" in job:
        with open_dict(job):
            del job["hydra"]
    apply_empty_dict_overrides(job, overrides)
    apply_partition_overrides(job, partitions)
    return job


def _migrated(overrides: Sequence[str]) -> List[str]:
    from hetseq_hpc.config.aliases import migrate_overrides

    return list(migrate_overrides(overrides))


def _compose(overrides: Sequence[str], config_dir: Optional[Union[str, Path]] = None) -> DictConfig:
    """Hydra's composition of ``<config_dir>/config.yaml`` (default :data:`CONF_DIR`) with
    ``overrides``, Hydra's node included (:meth:`Composer.compose
    <hetseq_hpc.config.composer.Composer.compose>`).

    Raises:
        ConfigError: an unknown key or option, a bad value or override (one line).
    """
    from hetseq_hpc.config.composer import Composer

    return Composer(config_dir).compose(overrides)


def compose_run(
    overrides: Sequence[str] = (), config_dir: Optional[Union[str, Path]] = None
) -> DictConfig:
    """Compose ``<config_dir>/config.yaml`` (default: the package's ``conf/``) with
    ``overrides``, as ``hetseq-hpc run`` would, without starting anything.

    Must not run inside another Hydra context (``initialize_config_dir`` or a Hydra task
    function): Hydra has one global state.

    Raises:
        ConfigError: an unknown key or group option, a value of the wrong type, a bad override
            (one line, with the fix).
    """
    overrides, partitions = split_partition_overrides(_migrated(overrides))
    return job_config(_compose(overrides, config_dir), overrides, partitions)


def group_choices(
    overrides: Sequence[str] = (), config_dir: Optional[Union[str, Path]] = None
) -> Dict[str, str]:
    """The option each config group takes under ``overrides``, as Hydra records it
    (``hydra.runtime.choices``): ``{"cluster": "mixed", "task": "bert", ...}``, the file names
    in ``conf/<group>/`` (a cluster's ``cluster.name`` is only its kind, ``local`` or
    ``slurm``). Schema entries (``*_schema``) and Hydra's own groups are left out.

    Raises:
        ConfigError: as :func:`compose_run`.
    """
    overrides, _ = split_partition_overrides(_migrated(overrides))
    cfg = _compose(overrides, config_dir)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    assert isinstance(choices, dict)
    return {
        str(group): str(option)
        for group, option in choices.items()
        if option is not None
        and not str(group).startswith("hydra")
        and not str(option).endswith("_schema")
    }


def compose_run_config(
    overrides: Sequence[str] = (), config_dir: Optional[Union[str, Path]] = None
) -> RunConfig:
    """:func:`compose_run`, then :func:`hetseq_hpc.config.to_run_config` (every check runs).

    Raises:
        ConfigError: any invalid override or value (one line, with the fix).
    """
    from hetseq_hpc.config import to_run_config

    return to_run_config(compose_run(overrides, config_dir))
