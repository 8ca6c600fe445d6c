"""A Lightning / Fabric cluster environment that reads the job the way the native worker does
(:meth:`hetseq_hpc.env.world.WorldInfo.from_env`), Slurm het jobs included.

Lightning's ``SLURMEnvironment`` is wrong in a het job (measured on Slurm 22.05): every task
sees the merged, name-sorted node list, so ``main_address`` can name a node that does not run
rank 0; ``SLURM_NTASKS_PER_NODE`` reads 1 on a node that runs two tasks, so ``devices=2``
raises and ``devices=1`` makes ``root_device`` index past the device list. Here rank, local
rank and world size come from the task variables, the master from the first node of het
component 0 (where rank 0 runs), the port from the job id (or ``MASTER_PORT``); the world is
the job's tasks, whatever ``devices`` and ``num_nodes`` say; gloo's and NCCL's interface is
the one on this node's route to that master (:mod:`hetseq_hpc.env.netif`).
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional, Sequence

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment

from hetseq_hpc.env.netif import use_route_to_master
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import ConfigError

log = logging.getLogger(__name__)

#: ``SLURM_STEP_ID`` values of a job's batch script or extern step (no srun step)
NOT_SRUN_STEPS = ("4294967294", "4294967293", "batch", "extern")


def launched_for_us(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is one task of a job that started every rank itself: an srun step
    (``SLURM_PROCID`` with a step id), or an external launcher that set ``RANK`` and
    ``WORLD_SIZE`` (``hetseq-hpc run cluster=local``). torchrun is left to Lightning's own
    ``TorchElasticEnvironment``."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_RUN_ID"):
        return False
    if env.get("RANK") and env.get("WORLD_SIZE"):
        return True
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return bool(
        env.get("SLURM_PROCID") is not None
        and env.get("SLURM_NTASKS")
        and step
        and step not in NOT_SRUN_STEPS
    )


class HetJobEnvironment(ClusterEnvironment):
    """The job's world from :class:`~hetseq_hpc.env.world.WorldInfo` (processes are started
    by srun or the launcher, never by Lightning).

    Args:
        env: the environment to read (default ``os.environ``).

    Raises:
        WorldError: the variables are missing or inconsistent (one line naming them).
    """

    def __init__(self, env: Optional[Mapping[str, str]] = None):
        self._env = dict(os.environ if env is None else env)
        self.world = WorldInfo.from_env(self._env)
        if env is None:  # this process's own job: gloo/NCCL on the route to rank 0's node
            use_route_to_master(self.world, os.environ)

    @property
    def creates_processes_externally(self) -> bool:
        """Always True: srun or the launcher started every rank."""
        return True

    @property
    def main_address(self) -> str:
        """Rank 0's node (het component 0's first node)."""
        return self.world.master_addr

    @property
    def main_port(self) -> int:
        """``MASTER_PORT``, else derived from the job id."""
        return self.world.master_port

    @staticmethod
    def detect() -> bool:
        """:func:`launched_for_us` on ``os.environ``."""
        return launched_for_us()

    def world_size(self) -> int:
        """Tasks in the job (every het component)."""
        return self.world.world_size

    def set_world_size(self, size: int) -> None:
        """Ignored: the job's tasks define the world."""
        if size != self.world.world_size:
            log.debug("world size %d asked, the job has %d: kept", size, self.world.world_size)

    def global_rank(self) -> int:
        """``SLURM_PROCID`` (or ``RANK``)."""
        return self.world.rank

    def set_global_rank(self, rank: int) -> None:
        """Ignored: node rank x devices + local rank is wrong when nodes run different
        numbers of tasks."""

    def local_rank(self) -> int:
        """``SLURM_LOCALID`` (or ``LOCAL_RANK``)."""
        return self.world.local_rank

    def node_rank(self) -> int:
        """``SLURM_NODEID`` (or ``NODE_RANK``), for logs only."""
        raw = self._env.get("SLURM_NODEID") or self._env.get("NODE_RANK") or "0"
        return int(raw) if raw.isdigit() else 0

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """``devices`` and ``num_nodes`` do not shape the world here; only a job of ONE task
        asked for several devices is refused (Lightning would not start the others).

        Raises:
            ConfigError: one task but ``devices x num_nodes > 1``.
        """
        if self.world.world_size == 1 and num_devices * num_nodes > 1:
            raise ConfigError(
                f"devices={num_devices}, num_nodes={num_nodes} but the job started 1 task: start "
                "one task per rank (srun --ntasks=N, or hetseq-hpc run with cluster.command), or "
                "run the script without srun to let Lightning start the ranks"
            )


def native_root_device(
    devices: Sequence[torch.device], environment: object, local_rank: int
) -> Optional[torch.device]:
    """The device a Lightning or Fabric strategy's rank trains on by hetseq_hpc's rule, or None
    to keep the framework's: the CPU for CPU devices whatever the local rank; under
    :class:`HetJobEnvironment` the GPU ``local rank % visible GPUs`` (a het component's ranks
    number their GPUs from 0 on every node).

    Args:
        devices: the strategy's ``parallel_devices`` (empty when not set yet).
        environment: the strategy's cluster environment.
        local_rank: the rank's index on its node.
    """
    if devices and devices[0].type == "cpu":
        return torch.device("cpu")
    if devices and devices[0].type == "cuda" and isinstance(environment, HetJobEnvironment):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return None


__all__ = ["NOT_SRUN_STEPS", "HetJobEnvironment", "launched_for_us", "native_root_device"]
