"""Schema dataclasses of the run configuration, registered in Hydra's ConfigStore.

Each group's schema has its own module (``task``, ``cluster``, ``trainer``/``optim``,
``balance``, ``comm``, ``precision``, ``sharding``, ``plan``) and checks its fields in
``__post_init__``; this module ties them into :class:`RunConfig` and registers them in one
place (:func:`register_configs`). Cross-group checks: :mod:`hetseq_hpc.config.validate`; moved
keys: :mod:`hetseq_hpc.config.aliases`. Units are in the field names: ``*_s`` seconds,
``*_min`` minutes, ``*_gb`` GiB. Which module reads each group:
docs/design/configuration.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from omegaconf import MISSING

# the group schemas, re-exported: ``from hetseq_hpc.config.schema import PartitionConfig`` works
from hetseq_hpc.config.balance import BalanceConfig as BalanceConfig
from hetseq_hpc.config.cluster import ClusterConfig as ClusterConfig
from hetseq_hpc.config.cluster import LocalClusterConfig as LocalClusterConfig
from hetseq_hpc.config.cluster import PartitionConfig as PartitionConfig
from hetseq_hpc.config.cluster import SlurmClusterConfig as SlurmClusterConfig
from hetseq_hpc.config.comm import CommConfig as CommConfig
from hetseq_hpc.config.common import check_sbatch_value as check_sbatch_value
from hetseq_hpc.config.hf_tasks import DatasetTaskConfig as DatasetTaskConfig
from hetseq_hpc.config.hf_tasks import HfTaskConfig as HfTaskConfig
from hetseq_hpc.config.plan import PlanConfig, register_plan_config
from hetseq_hpc.config.rank_precision import PrecisionConfig as PrecisionConfig
from hetseq_hpc.config.sharding import ShardingConfig as ShardingConfig
from hetseq_hpc.config.tasks import BertDataConfig as BertDataConfig
from hetseq_hpc.config.tasks import BertModelConfig as BertModelConfig
from hetseq_hpc.config.tasks import BertTaskConfig as BertTaskConfig
from hetseq_hpc.config.tasks import CustomTaskConfig as CustomTaskConfig
from hetseq_hpc.config.tasks import ImageTaskConfig as ImageTaskConfig
from hetseq_hpc.config.tasks import TranslationTaskConfig as TranslationTaskConfig
from hetseq_hpc.config.trainer import OptimConfig as OptimConfig
from hetseq_hpc.config.trainer import TrainerConfig as TrainerConfig


@dataclass
class RunConfig:
    """The whole run: one field per config group."""

    # the task's schema is chosen by task.name (TASK_SCHEMAS)
    task: Any = MISSING
    # LocalClusterConfig or SlurmClusterConfig, chosen by cluster.name (CLUSTER_SCHEMAS)
    cluster: ClusterConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # the split of the global batch over the ranks, measured and re-balanced
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    # gradient communication between the ranks
    comm: CommConfig = field(default_factory=CommConfig)
    # each rank's compute precision (the one source of it)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    # replicated (DDP) or sharded (FSDP2) model state
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # planner options (python -m hetseq_hpc.plan); recorded, not read, by a training run
    plan: PlanConfig = field(default_factory=PlanConfig)

    def __post_init__(self) -> None:
        # optim.lr null (optim=finetune's default): a fine-tuning rate for pretrained weights,
        # a pre-training one for a random init (OptimConfig.default_lr); the saved run config
        # holds the number
        if self.optim.lr is None:
            self.optim.lr = self.optim.default_lr(self.random_init)

    @property
    def random_init(self) -> bool:
        """Whether the model starts from a random init rather than pretrained weights that
        the user names (``task=hf`` with ``task.model.config``); hetseq_hpc's own tasks and the
        user's ``task=custom`` / ``task=dataset`` models count as trained from scratch."""
        return isinstance(self.task, HfTaskConfig) and self.task.model.path is None


#: task name -> schema; the ``name`` field of a task config selects its schema.
TASK_SCHEMAS: Dict[str, type] = {
    "bert": BertTaskConfig,
    "image": ImageTaskConfig,
    "translation": TranslationTaskConfig,
    "custom": CustomTaskConfig,
    "hf": HfTaskConfig,
    "dataset": DatasetTaskConfig,
}
#: cluster name -> schema, chosen by the ``name`` field (``slurm`` for every SLURM cluster file).
CLUSTER_SCHEMAS: Dict[str, type] = {"local": LocalClusterConfig, "slurm": SlurmClusterConfig}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent: once per process, again only
    when the store no longer holds them; each registration converts ~20 dataclasses to
    OmegaConf, ~0.06 CPU-s, which every composition paid).

    ``conf/config.yaml`` starts from ``run_schema``; ``conf/task/*.yaml`` and
    ``conf/cluster/*.yaml`` start from ``<name>_schema`` in their group. The other groups'
    files merge into the nodes ``run_schema`` types (their schemas stay registered for a
    user's own group file; docs/design/configuration.md).
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "run_schema.yaml" in cs.repo and "plan" in cs.repo:  # registered (plan: the last)
        return
    cs.store(name="run_schema", node=RunConfig)
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="task", name=f"{name}_schema", node=schema)
    for name, schema in CLUSTER_SCHEMAS.items():
        cs.store(group="cluster", name=f"{name}_schema", node=schema)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="balance", name="balance_schema", node=BalanceConfig)
    cs.store(group="comm", name="comm_schema", node=CommConfig)
    cs.store(group="precision", name="precision_schema", node=PrecisionConfig)
    cs.store(group="sharding", name="sharding_schema", node=ShardingConfig)
    cs.store(group="optim", name="adamw_schema", node=OptimConfig)
    register_plan_config(cs)
