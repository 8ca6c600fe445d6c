"""Where this process sits in the job: rank, local rank, world size, rendezvous master.

:meth:`WorldInfo.from_env` reads an injectable environment (default ``os.environ``): explicit
torch variables first (torchrun, the local launcher), then SLURM task variables
(:data:`SLURM_VARIABLES`, het jobs included), else a single process; the port is derived from
the job id unless ``MASTER_PORT`` is set. The het-job facts, checked on a real Slurm 22.05:
docs/design/slurm-launch.md, "Rank, local rank, world size, master".
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import Dict, Mapping, Optional

from hetseq_hpc.env.hostlist import expand_hostlist
from hetseq_hpc.errors import WorldError

#: role -> SLURM variable (one table, like submitit's ``SlurmJobEnvironment._env``).
SLURM_VARIABLES: Dict[str, str] = {
    "job_id": "SLURM_JOB_ID",
    "global_rank": "SLURM_PROCID",
    "world_size": "SLURM_NTASKS",
    "local_rank": "SLURM_LOCALID",
    "node_rank": "SLURM_NODEID",
    "node_name": "SLURMD_NODENAME",
    "nodelist": "SLURM_JOB_NODELIST",
    "step_nodelist": "SLURM_STEP_NODELIST",
    "partition": "SLURM_JOB_PARTITION",
    "het_size": "SLURM_HET_SIZE",
    "cpus_per_task": "SLURM_CPUS_PER_TASK",
}
#: per-component variables of a het job; ``{k}`` is the component index.
SLURM_HET_VARIABLES: Dict[str, str] = {
    "ntasks": "SLURM_NTASKS_HET_GROUP_{k}",
    "nodelist": "SLURM_JOB_NODELIST_HET_GROUP_{k}",
    "partition": "SLURM_JOB_PARTITION_HET_GROUP_{k}",
    "cpus_per_task": "SLURM_CPUS_PER_TASK_HET_GROUP_{k}",
}

#: first port of the range derived from the SLURM job id (15000 + id % 20000).
SLURM_PORT_BASE = 15000
#: the step's tasks per het component, comma-separated, set by the batch script when the step
#: runs on part of the allocation (``trainer.elastic.spare_nodes``): Slurm's
#: ``SLURM_NTASKS_HET_GROUP_<k>`` then count the allocation's tasks, not the step's
HET_NTASKS_ENV = "HETSEQ_HET_NTASKS"


def slurm_job_port(job_id: int) -> int:
    """The rendezvous port every rank of Slurm job ``job_id`` derives (``15000 + id % 20000``)
    when ``MASTER_PORT`` is unset."""
    return SLURM_PORT_BASE + int(job_id) % 20000


def _int_var(env: Mapping[str, str], name: str, *, minimum: int = 0, hint: str = "") -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise WorldError(f"{name} is not set: {hint or 'export it before starting the worker'}")
    try:
        value = int(raw)
    except ValueError:
        raise WorldError(
            f"{name}={raw!r} is not an integer: {hint or 'fix the variable'}"
        ) from None
    if value < minimum:
        raise WorldError(f"{name}={value} must be >= {minimum}: {hint or 'fix the variable'}")
    return value


#: ``SLURM_STEP_ID`` values of steps that are not an srun step (batch script, extern step)
_NOT_SRUN_STEPS = {"4294967294", "4294967293", "batch", "extern"}


def _require_step(env: Mapping[str, str]) -> None:
    """Refuse to run in a job's batch script itself: there ``SLURM_STEP_ID`` is unset (measured
    on Slurm 22.05; every srun step has it), ``SLURM_PROCID`` is 0 and ``SLURM_NTASKS`` counts
    ranks that only an srun step would start, so rank 0 would wait for them forever."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if env.get("SLURM_JOB_ID") and (not step or step in _NOT_SRUN_STEPS):
        raise WorldError(
            f"SLURM_JOB_ID={env.get('SLURM_JOB_ID')} is set but SLURM_STEP_ID={step!r}: this "
            "worker runs in the batch script itself and would wait forever for ranks that never "
            "start; launch it with srun (srun python -m hetseq_hpc.worker ..., see "
            "slurm/hetjob.sbatch)"
        )


def _port_var(env: Mapping[str, str]) -> Optional[int]:
    if not env.get("MASTER_PORT"):
        return None
    port = _int_var(env, "MASTER_PORT", minimum=1, hint="use a free TCP port in 1024..65535")
    if port > 65535:
        raise WorldError(f"MASTER_PORT={port} is not a TCP port: use one in 1024..65535")
    return port


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a currently free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class WorldInfo:
    """This process's place in the job. Frozen and range-checked on construction.

    Attributes:
        rank: global rank in ``[0, world_size)``.
        local_rank: rank among the processes of this node (selects the GPU).
        world_size: number of processes in the rendezvous.
        master_addr: host name or address of rank 0 (the rendezvous store).
        master_port: TCP port of the store on ``master_addr``.
        source: ``"torch"`` (explicit torch variables), ``"slurm"`` or ``"single"``.
        node_name: this node's name (``SLURMD_NODENAME`` or the host name).
        job_id: the scheduler's job id (a het job's leader id), else None.
        het_group: index of this task's het component, None outside a het job.
        het_size: number of het components (1 outside a het job).
        partition: Slurm partition of this task's component, if known.
        cpus_per_task: CPU cores reserved for this rank by the scheduler, if known.
    """

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str = "single"
    node_name: str = ""
    job_id: Optional[str] = None
    het_group: Optional[int] = None
    het_size: int = 1
    partition: Optional[str] = None
    cpus_per_task: Optional[int] = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise WorldError(f"world size {self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise WorldError(
                f"rank {self.rank} is outside [0, world size {self.world_size}): the launcher "
                "started more processes than it announced"
            )
        if self.local_rank < 0:
            raise WorldError(f"local rank {self.local_rank} must be >= 0")
        if not self.master_addr:
            raise WorldError("master address is empty: set MASTER_ADDR to rank 0's host")
        if not 1 <= self.master_port <= 65535:
            raise WorldError(f"master port {self.master_port} is not a TCP port (1..65535)")
        if self.het_group is not None and not 0 <= self.het_group < self.het_size:
            raise WorldError(f"het group {self.het_group} is outside [0, {self.het_size})")

    @property
    def is_master(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    def to_dict(self) -> dict:
        """Plain dict (for JSON logs)."""
        return asdict(self)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> WorldInfo:
        """Build the world description from ``env`` (default ``os.environ``).

        Raises:
            WorldError: a variable is missing, malformed or inconsistent; the message names it,
                shows the value seen and says what was expected.
        """
        env = os.environ if env is None else env
        if "RANK" in env or "WORLD_SIZE" in env:
            return cls._from_torch(env)
        if env.get("SLURM_PROCID") is not None and env.get("SLURM_NTASKS") is not None:
            return cls._from_slurm(env)
        port = _port_var(env)
        return cls(
            rank=0,
            local_rank=0,
            world_size=1,
            master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
            master_port=port if port is not None else free_port(),
            source="single",
            node_name=socket.gethostname(),
        )

    @classmethod
    def _from_torch(cls, env: Mapping[str, str]) -> WorldInfo:
        hint = "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together (as torchrun does)"
        world = _int_var(env, "WORLD_SIZE", minimum=1, hint=hint)
        rank = _int_var(env, "RANK", minimum=0, hint=hint)
        if not env.get("MASTER_ADDR"):
            raise WorldError(f"MASTER_ADDR is not set but RANK is: {hint}")
        port = _port_var(env)
        if port is None:
            raise WorldError(f"MASTER_PORT is not set but RANK is: {hint}")
        if rank >= world:
            raise WorldError(f"RANK={rank} is not below WORLD_SIZE={world}: {hint}")
        local_rank = _int_var(env, "LOCAL_RANK", hint=hint) if env.get("LOCAL_RANK") else 0
        het_hint = "HETSEQ_HET_GROUP/HETSEQ_HET_SIZE describe the het component; fix or unset them"
        het_group = (
            _int_var(env, "HETSEQ_HET_GROUP", hint=het_hint)
            if env.get("HETSEQ_HET_GROUP")
            else None
        )
        het_size = (
            _int_var(env, "HETSEQ_HET_SIZE", minimum=1, hint=het_hint)
            if env.get("HETSEQ_HET_SIZE")
            else 1
        )
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            master_addr=env["MASTER_ADDR"],
            master_port=port,
            source="torch",
            node_name=env.get("SLURMD_NODENAME") or socket.gethostname(),
            job_id=env.get("SLURM_JOB_ID"),
            het_group=het_group,
            het_size=het_size,
            partition=env.get("HETSEQ_PARTITION") or None,
        )

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str]) -> WorldInfo:
        v = SLURM_VARIABLES
        hint = "run the worker inside an srun step of the job"
        _require_step(env)
        rank = _int_var(env, v["global_rank"], hint=hint)
        world = _int_var(env, v["world_size"], minimum=1, hint=hint)
        if rank >= world:
            raise WorldError(
                f"{v['global_rank']}={rank} is not below {v['world_size']}={world}: {hint}"
            )
        local_rank = _int_var(env, v["local_rank"], hint=hint) if env.get(v["local_rank"]) else 0
        job_id = env.get(v["job_id"])
        cpus = env.get(v["cpus_per_task"])
        het_size_raw = env.get(v["het_size"])
        het_group: Optional[int] = None
        het_size = 1
        if het_size_raw:
            het_size = _int_var(env, v["het_size"], minimum=1, hint=hint)
            het_group, master_list, partition = cls._het_component(env, rank, world, het_size)
            list_var = SLURM_HET_VARIABLES["nodelist"].format(k=0)
            cpus = env.get(SLURM_HET_VARIABLES["cpus_per_task"].format(k=het_group)) or cpus
        else:
            list_var = v["step_nodelist"] if env.get(v["step_nodelist"]) else v["nodelist"]
            master_list = env.get(list_var) or ""
            partition = env.get(v["partition"])
        port = _port_var(env)
        if port is None:
            if not job_id or not job_id.isdigit():
                raise WorldError(
                    f"SLURM_JOB_ID={job_id!r} is not a job number, so no port can be derived: "
                    "set MASTER_PORT"
                )
            port = slurm_job_port(int(job_id))
        master = env.get("MASTER_ADDR")
        if not master:
            hosts = expand_hostlist(master_list, list_var)
            if not hosts:
                raise WorldError(
                    f"no node list in the SLURM environment ({list_var} is empty): "
                    f"{hint}, or set MASTER_ADDR"
                )
            master = hosts[0]
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            master_addr=master,
            master_port=port,
            source="slurm",
            node_name=env.get(v["node_name"]) or socket.gethostname(),
            job_id=job_id,
            het_group=het_group,
            het_size=het_size,
            partition=partition or None,
            cpus_per_task=int(cpus) if cpus and cpus.isdigit() else None,
        )

    @staticmethod
    def _het_component(env: Mapping[str, str], rank: int, world: int, het_size: int):
        """(component of ``rank``, nodelist of component 0, partition of the component)."""
        hv = SLURM_HET_VARIABLES
        counts = []
        step_counts = env.get(HET_NTASKS_ENV, "").strip()
        if step_counts:  # a step on part of the allocation (spare nodes): its own counts
            counts = [
                _int_var({HET_NTASKS_ENV: c}, HET_NTASKS_ENV, minimum=1, hint="unset it")
                for c in step_counts.split(",")
            ]
            if len(counts) != het_size:
                raise WorldError(
                    f"{HET_NTASKS_ENV}={step_counts!r} names {len(counts)} component(s) but "
                    f"SLURM_HET_SIZE={het_size}: give one count per het component"
                )
        for k in range(het_size if not counts else 0):
            name = hv["ntasks"].format(k=k)
            counts.append(
                _int_var(
                    env,
                    name,
                    minimum=1,
                    hint="start the step with srun --het-group=0-"
                    f"{het_size - 1} so that every component takes part",
                )
            )
        if sum(counts) != world:
            raise WorldError(
                f"SLURM_NTASKS={world} but SLURM_NTASKS_HET_GROUP_* add up to {sum(counts)} "
                f"({counts}): start one step over all components, srun --het-group=0-{het_size - 1}"
            )
        start = 0
        group = het_size - 1
        for k, count in enumerate(counts):
            if rank < start + count:
                group = k
                break
            start += count
        master_list = env.get(hv["nodelist"].format(k=0), "")
        if not master_list and not env.get("MASTER_ADDR"):
            raise WorldError(
                "SLURM_JOB_NODELIST_HET_GROUP_0 is not set in a het job: the rendezvous master "
                "cannot be found; set MASTER_ADDR to the first node of component 0"
            )
        partition = env.get(hv["partition"].format(k=group))
        return group, master_list, partition
