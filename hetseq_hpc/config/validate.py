"""Checks that span config groups, run before any process or job starts."""

from __future__ import annotations

import codecs
import glob
import importlib.metadata
import importlib.util
import os
import re
from typing import TYPE_CHECKING, List, Optional, Tuple

from hetseq_hpc.config.cluster import visible_gpu_count
from hetseq_hpc.config.hf_tasks import HF_BINARY_SUFFIXES, HfTaskConfig
from hetseq_hpc.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.config.schema import RunConfig

__all__ = [
    "LOGGER_PACKAGES",
    "check_devices",
    "check_grad_combine",
    "check_logger_packages",
    "check_text_file",
    "expand_data_files",
    "planned_world_size",
    "validate_run_config",
    "visible_gpu_count",
]

#: bytes of each data file read before any process starts (the rest is checked while loading);
#: git's binary detection looks at the same first 8000 bytes (xdiff-interface.c, FIRST_FEW_BYTES)
TEXT_PROBE_BYTES = 8000
#: ``trainer.loggers`` entries that need a package besides hetseq_hpc's own dependencies
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def planned_world_size(run: RunConfig) -> int:
    """World size the launch will create: ``cluster.ranks`` (or GPUs, else 2) locally; the sum of
    partition ranks on SLURM (:meth:`ClusterConfig.planned_world_size`)."""
    return run.cluster.planned_world_size()


def expand_data_files(patterns: list) -> list:
    """Expand paths and globs (``~`` too) to a sorted list of files. A pattern that names an
    existing file is that file, even if its name holds glob characters (``data[1].txt``).

    Raises:
        ConfigError: a pattern matches no file.
    """
    files = []
    for pattern in patterns:
        expanded = os.path.expanduser(str(pattern))
        if os.path.isfile(expanded):
            files.append(expanded)
            continue
        matches = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not matches:
            raise ConfigError(
                f"task.data.files entry {str(pattern)!r} matches no file: check the path "
                "(globs like 'data/**/*.txt' are allowed), or drop task.data.files to use the "
                "embedded corpus"
            )
        files.extend(matches)
    return files


def check_text_file(path: str, probe_bytes: int = TEXT_PROBE_BYTES) -> None:
    """A data file must hold UTF-8 text: not empty, no NUL bytes, valid UTF-8 in its first
    ``probe_bytes`` bytes (a multi-byte character cut at the end of the probe is fine).

    Raises:
        ConfigError: the file is unreadable, empty (or only whitespace), binary, or not UTF-8.
    """
    fix = "give UTF-8 text files in task.data.files (convert with iconv -t UTF-8), or drop it"
    try:
        with open(path, "rb") as fh:
            head = fh.read(probe_bytes)
            more = bool(fh.read(1))
    except OSError as exc:
        raise ConfigError(
            f"task.data.files: cannot read {path!r} ({exc.strerror}): {fix}"
        ) from None
    if not head.strip() and not more:
        raise ConfigError(f"task.data.files: {path!r} is empty: {fix}")
    if b"\x00" in head:
        raise ConfigError(f"task.data.files: {path!r} is a binary file (it holds NUL bytes): {fix}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=not more)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"task.data.files: {path!r} is not UTF-8 text (byte {exc.start}: {exc.reason}): {fix}"
        ) from None


def check_logger_packages(loggers: List[str]) -> None:
    """Every ``trainer.loggers`` entry must be importable where the run starts: a logger whose
    package is missing is refused here, before any rank starts, not found missing by rank 0.

    Raises:
        ConfigError: an entry's package (:data:`LOGGER_PACKAGES`) is not installed.
    """
    for name in dict.fromkeys(loggers):
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            rest = [n for n in dict.fromkeys(loggers) if n != name]
            raise ConfigError(
                f"trainer.loggers={list(loggers)} has {name} but the {package} package is not "
                f"installed here: pip install {package}, or drop it "
                f"(trainer.loggers=[{','.join(rest) or 'jsonl'}])"
            )


#: the torch release the project pins (pyproject.toml) and tests: FSDP2 has the sum reductions
#: from it on, so an installed torch of this version or newer is not imported to check them
FSDP2_SUM_REDUCTIONS_FROM = (2, 13)


def installed_torch_version() -> Optional[Tuple[int, int]]:
    """(major, minor) of the installed torch from its package metadata, without importing it
    (~3 CPU-s, spent before any rank starts); None when it is not installed or unparsable."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_fsdp_available(mode: str) -> None:
    """``sharding.mode=fsdp|auto`` needs PyTorch's FSDP2 with sum reductions
    (``torch.distributed.fsdp.fully_shard``, ``FSDPModule.set_force_sum_reduction_for_comms``):
    a torch of :data:`FSDP2_SUM_REDUCTIONS_FROM` or newer has them (read from its package
    metadata, without importing torch); an older or unknown one is imported and looked at.

    Raises:
        ConfigError: this torch lacks them (one line naming its version and the fix).
    """
    version = installed_torch_version()
    if version is not None and version >= FSDP2_SUM_REDUCTIONS_FROM:
        return
    import torch

    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:
        FSDPModule = None
    if FSDPModule is None or not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise ConfigError(
            f"sharding.mode={mode} needs PyTorch's FSDP2 with sum reductions, which torch "
            f"{torch.__version__} lacks: install torch 2.13 (pip install torch==2.13.0), or "
            "use sharding.mode=none"
        )


def check_grad_combine(grad_combine: str, world: int) -> None:
    """``comm.grad_combine=adasum`` pairs ranks recursively, so the planned world size must be
    a power of two (Horovod refuses others the same way); checked before any rank starts.

    Raises:
        ConfigError: adasum on a world size that is not a power of two.
    """
    if grad_combine == "adasum" and not (world >= 1 and world & (world - 1) == 0):
        lower = 1 << (world.bit_length() - 1)
        raise ConfigError(
            f"comm.grad_combine=adasum needs a power-of-two number of ranks, this run plans "
            f"{world}: use {lower} or {lower * 2} ranks (cluster.ranks, or the partitions' nodes "
            "and gpus_per_node), or comm.grad_combine=sum"
        )


def _data_files(run: RunConfig) -> List[str]:
    files = getattr(getattr(run.task, "data", None), "files", None)
    return list(files) if files else []


def world_source(run: RunConfig, world: int) -> str:
    """Where the world size ``world`` comes from, in words for an error line: ``cluster.ranks=N``
    locally (or its default), the partitions' ranks on SLURM (``a100: 4 + t4: 2 rank(s)``)."""
    parts = getattr(run.cluster, "partitions", None) or {}
    if parts:
        return " + ".join(f"{k}: {p.num_ranks}" for k, p in parts.items()) + " rank(s)"
    if getattr(run.cluster, "ranks", None) is None:
        return "cluster.ranks unset: one rank per visible GPU, else 2"
    return f"cluster.ranks={world}"


def check_min_ranks(run: RunConfig, world: int) -> None:
    """``trainer.elastic.min_ranks`` must not exceed the world size: a run that starts with
    fewer ranks than its minimum would stop at its first lost rank whatever the minimum says.

    Raises:
        ConfigError: one line naming both values and the fix.
    """
    elastic = run.trainer.elastic
    if elastic.min_ranks > world:
        raise ConfigError(
            f"trainer.elastic.min_ranks={elastic.min_ranks} is above the world size {world} "
            f"({world_source(run, world)}): use trainer.elastic.min_ranks={world} (stop at any "
            "lost rank) or fewer, or more ranks"
        )


def check_restarts(run: RunConfig) -> None:
    """``trainer.elastic.restarts`` replaces a lost rank only where it can: the local launcher
    restarts the process, or on Slurm the batch script starts a new step
    (:mod:`hetseq_hpc.launch.slurm_regrow`); the newcomer receives the training state from a
    survivor (DDP or FSDP), and the job's store (``trainer.elastic.enabled``) admits it.
    ``trainer.elastic.spare_nodes`` exist only on Slurm, and only for replacements.

    Raises:
        ConfigError: one line naming the setting that prevents it and the fix.
    """
    elastic = run.trainer.elastic
    if elastic.spare_nodes:
        if run.cluster.is_local:
            raise ConfigError(
                f"trainer.elastic.spare_nodes={elastic.spare_nodes} cannot apply with "
                "cluster=local (one machine, no node to spare): use "
                "trainer.elastic.spare_nodes=0"
            )
        if not elastic.restarts:
            raise ConfigError(
                f"trainer.elastic.spare_nodes={elastic.spare_nodes} reserves nodes for "
                "replacements, but trainer.elastic.restarts=0 starts none: set "
                "trainer.elastic.restarts (e.g. 1) or use trainer.elastic.spare_nodes=0"
            )
    if not elastic.restarts:
        return
    why = None
    if not elastic.enabled:
        why = "trainer.elastic.enabled=false (a lost rank ends the job)"
    elif run.cluster.command:
        why = "cluster.command (the launcher runs your script, not hetseq_hpc's worker)"
    if why is not None:
        raise ConfigError(
            f"trainer.elastic.restarts={elastic.restarts} cannot apply with {why}: "
            "use trainer.elastic.restarts=0"
        )


def check_devices(run: RunConfig, gpus: Optional[int] = None) -> None:
    """``cluster.devices`` against this machine and the sharding: a ``cuda`` entry needs a GPU
    torch can use, and ranks that mix ``cuda`` and ``cpu`` (gloo for all) train a replica
    each (DDP over gloo: its broadcast and all-reduce take CUDA tensors). FSDP2 is refused
    there: ``fully_shard`` shards over a ``DeviceMesh``, which has one ``device_type`` for
    every rank (SPMD: "the same program on all ranks"), and communicates on "the mesh's
    device type" (torch's docstrings of ``DeviceMesh`` and ``fully_shard``).

    Args:
        run: the composed run.
        gpus: the GPUs torch sees; None = :func:`visible_gpu_count`.

    Raises:
        ConfigError: one line naming ``cluster.devices`` and the fix.
    """
    kinds = run.cluster.device_kinds()
    if not kinds:
        return
    shown = f"cluster.devices=[{','.join(kinds)}]"
    if "cuda" in kinds and (visible_gpu_count() if gpus is None else gpus) == 0:
        raise ConfigError(
            f"{shown} puts a rank on cuda but torch sees no CUDA GPU here (a CPU-only torch, "
            "or CUDA_VISIBLE_DEVICES hides them): use cpu for that rank, or run where a GPU is"
        )
    if len(set(kinds)) > 1 and run.sharding.mode == "fsdp":
        raise ConfigError(
            f"{shown} mixes GPU and CPU ranks, which sharding.mode=fsdp cannot span (FSDP2's "
            "device mesh has one device type for every rank): use sharding.mode=none, or the "
            "same device on every rank"
        )


def validate_run_config(run: RunConfig) -> None:
    """Cross-group checks: world size against the global batch, ``trainer.elastic.min_ranks``,
    a forced allocation and
    ``grad_combine=adasum``, per-rank cluster settings, logger packages installed, data files
    exist and hold text (``task=hf``'s Parquet files are binary: their reader checks them).

    Raises:
        ConfigError: with the offending values and the fix, in one line.
    """
    world = planned_world_size(run)
    trainer = run.trainer
    if trainer.global_batch_size < world:
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} is smaller than the world size "
            f"{world}: every rank needs at least one sample; raise trainer.global_batch_size to "
            f">= {world} or use fewer ranks"
        )
    check_min_ranks(run, world)
    check_restarts(run)
    allocation = run.balance.allocation
    if allocation is not None and sum(allocation) != trainer.global_batch_size:
        raise ConfigError(
            f"balance.allocation={list(allocation)} sums to {sum(allocation)}, not "
            f"trainer.global_batch_size={trainer.global_batch_size}: make the counts add up to "
            "the global batch"
        )
    if allocation is not None and len(allocation) != world:
        batch = trainer.global_batch_size
        even = [batch // world + (1 if r < batch % world else 0) for r in range(world)]
        example = f", e.g. balance.allocation=[{','.join(map(str, even))}]" if world <= 16 else ""
        raise ConfigError(
            f"balance.allocation={list(allocation)} has {len(allocation)} entries "
            f"but the world size is {world}: set balance.allocation=null to let the ranks "
            f"measure their split, or give {world} sample counts summing to {batch}{example}"
        )
    run.cluster.check_world(world)
    check_devices(run)
    run.precision.check_world(world, list(getattr(run.cluster, "partitions", {}) or {}))
    check_grad_combine(run.comm.grad_combine, world)
    if run.sharding.mode != "none":
        check_fsdp_available(run.sharding.mode)
    if run.sharding.mode != "none" and (
        run.comm.grad_compression != "none" or run.comm.grad_combine != "sum"
    ):
        raise ConfigError(
            f"sharding.mode={run.sharding.mode} reduce-scatters fp32 gradient SUMS: "
            f"comm.grad_compression={run.comm.grad_compression} and comm.grad_combine="
            f"{run.comm.grad_combine} are DDP hooks; use comm.grad_compression=none "
            "comm.grad_combine=sum, or sharding.mode=none"
        )
    check_logger_packages(list(trainer.loggers))
    binary = HF_BINARY_SUFFIXES if isinstance(run.task, HfTaskConfig) else ()
    for path in expand_data_files(_data_files(run)):
        if not path.lower().endswith(binary):
            check_text_file(path)
    if run.optim.schedule_steps is not None and run.optim.schedule_steps < trainer.max_steps:
        raise ConfigError(
            f"optim.schedule_steps={run.optim.schedule_steps} is below trainer.max_steps="
            f"{trainer.max_steps}: the learning rate would reach 0 early; raise it or leave it null"
        )
