"""Checks made before any process starts or anything is written: the checkpoint a run would
resume from must exist and fit the run (the same checks the ranks make later), the user's task
class must import, and the model must fit the memory of a rank (from its parameter count)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hetseq_hpc.errors import PROG, CheckpointError, ConfigError
from hetseq_hpc.files.user_input import file_problem
from hetseq_hpc.rundir.paths import RunDir


def checkpoint_fingerprint(path: Path) -> Optional[Dict[str, Any]]:
    """The run fingerprint a checkpoint stores (its ``config`` entry), read without its
    weights (and without torch where it can:
    :func:`~hetseq_hpc.train.checkpoint.files.stored_entry`); None when the file cannot be
    read (the ranks verify it)."""
    from hetseq_hpc.train.checkpoint.files import stored_entry

    try:
        saved = stored_entry(path, "config")
    except CheckpointError:
        return None
    return saved if isinstance(saved, dict) else None


def check_resume(run: Any, run_dir: Optional[RunDir]) -> None:
    """Before any process starts: an explicit ``trainer.resume`` file must exist, and the
    checkpoint the run would resume from must fit it (same checks the ranks make later,
    :func:`hetseq_hpc.train.state.check_fingerprint`).

    Raises:
        CheckpointError: the file is missing or has no checksum sidecar (not a checkpoint
            hetseq_hpc wrote, or cut off while saving), or the checkpoint was trained with other
            settings (the ranks' one-line messages; exit code 1 as when a rank finds it).
    """
    from hetseq_hpc.train.checkpoint.files import checkpoints_in, stored_checksum

    resume = run.trainer.resume
    if resume == "never":
        return
    if resume == "auto":
        found = checkpoints_in(run_dir.checkpoints) if run_dir is not None else []
        if not found:
            return
        path = found[-1]
    else:
        path = Path(resume).expanduser()
        problem = file_problem(path)
        if problem:
            raise CheckpointError(
                f"trainer.resume={resume} {problem}: give the path of a "
                "checkpoint (RUN_DIR/checkpoints/step_XXXXXXXX.pt), or "
                "trainer.resume=auto / never"
            )
        stored_checksum(path)  # a file hetseq_hpc did not write (no sidecar): refused here
    from hetseq_hpc.train.state import check_fingerprint, run_fingerprint

    saved = checkpoint_fingerprint(path)
    if saved is None:
        return
    check_fingerprint(saved, run_fingerprint(run), str(path), run.trainer.allow_resume_mismatch)


def say_if_finished(run: Any, run_dir: RunDir) -> bool:
    """Whether the checkpoint the run would resume from is at ``trainer.max_steps`` or later
    (:func:`hetseq_hpc.train.checkpoint.finished.finished_run`: a finished run, nothing to train); if so,
    its one line (steps, final loss, summary, how to train further) is printed on stdout."""
    from hetseq_hpc.train.checkpoint.finished import finished_run

    finished = finished_run(run.trainer.resume, run.trainer.max_steps, run_dir)
    if finished is not None:
        print(f"{PROG}: {finished.line()}", flush=True)
    return finished is not None


def refuse_rewinding_a_finished_run(run: Any, run_dir: RunDir) -> None:
    """Refuse ``trainer.resume=<an older checkpoint>`` of a run directory whose run is complete
    (:func:`hetseq_hpc.train.checkpoint.finished.completed_run`): training again from there would drop
    its ``metrics.jsonl`` rows after that step and overwrite its ``summary.json`` and
    checkpoints.

    Raises:
        CheckpointError: one line naming the checkpoint, the finished run and the ways on
            (resume a copy of the directory, or start over, which keeps the finished run).
    """
    from hetseq_hpc.train.checkpoint.files import step_of
    from hetseq_hpc.train.checkpoint.finished import completed_run

    if run.trainer.resume in ("auto", "never"):
        return
    path = Path(run.trainer.resume).expanduser()
    if path.resolve().parent != run_dir.checkpoints.resolve():
        return  # another directory's checkpoint: nothing of that run is written
    try:
        step = step_of(path)
    except ValueError:
        return
    done = completed_run(run_dir)
    if done is None or step >= done.step:
        return
    raise CheckpointError(
        f"trainer.resume={path} would train again from step {step} in {run_dir}, whose run is "
        f"complete at step {done.step}: its metrics.jsonl rows after step {step}, summary.json "
        f"and checkpoints would be overwritten: copy the run directory first (cp -r {run_dir} "
        "<new dir>) and resume the copy, or start over with trainer.resume=never (the "
        "finished run is moved to previous/)"
    )


def check_task_code(run: Any) -> None:
    """Import the user's task class that ``task.target`` names (``task=custom``) and check it,
    or check ``task=hf``'s model and data columns / ``task=dataset``'s build function
    (:mod:`hetseq_hpc.tasks.hf.checks`),
    before any process starts: a missing module, class or base class is one line here rather
    than a failure on every rank (:func:`hetseq_hpc.tasks.custom.resolve_target`).

    Raises:
        ConfigError: the target cannot be imported or is not a Task subclass (one line).
    """
    if run.task.name in ("hf", "dataset"):
        from hetseq_hpc.tasks.hf.checks import check_dataset_task, check_hf_task

        (check_hf_task if run.task.name == "hf" else check_dataset_task)(run.task)
        return
    target = getattr(run.task, "target", None)
    if target:
        from hetseq_hpc.tasks.custom import resolve_target

        resolve_target(target, getattr(run.task, "path", None))


def _gib(nbytes: float) -> str:
    gib = nbytes / 2**30
    return f"{gib:.3g} GiB" if gib < 1000 else f"{gib:,.0f} GiB"


def _local_gpus() -> int:
    """Visible GPUs, asked of torch only where an NVIDIA driver is loaded (cheap otherwise)."""
    if not Path("/proc/driver/nvidia").exists():
        return 0
    from hetseq_hpc.config.cluster import visible_gpu_count

    return visible_gpu_count()


def rank_memory_limits(run: Any) -> List[Tuple[str, float, str, str]]:
    """The memory one rank may use, per kind of rank, as the runtime budgets it
    (:func:`hetseq_hpc.balance.memory.memory_budget_bytes`): ``[(where, bytes, why, fix)]``.
    cluster=local: ``cluster.memory_budgets_gb`` (one per rank), else
    ``cluster.memory_budget_gb``, else the RAM this machine (and its memory
    cgroup) still has, shared by the ranks (none on GPUs: their memory is not asked here);
    SLURM: each partition's ``memory_budget_gb``, else its GPU's memory (known GPU classes),
    else ``mem_gb`` per rank of a node."""
    from hetseq_hpc.config.validate import planned_world_size
    from hetseq_hpc.env.hardware import read_meminfo
    from hetseq_hpc.env.memcg import cgroup_memory_room
    from hetseq_hpc.plan.gpus import known_gpu

    cluster = run.cluster
    if cluster.is_local:
        fix = "fewer ranks (cluster.ranks) or a bigger cluster.memory_budget_gb"
        if cluster.memory_budgets_gb:
            return [
                (
                    f"rank {i}",
                    gb * 2**30,
                    f"cluster.memory_budgets_gb[{i}]={gb:g}",
                    f"a bigger cluster.memory_budgets_gb[{i}]",
                )
                for i, gb in enumerate(cluster.memory_budgets_gb)
            ]
        if cluster.memory_budget_gb:
            return [
                (
                    "a rank",
                    cluster.memory_budget_gb * 2**30,
                    f"cluster.memory_budget_gb={cluster.memory_budget_gb:g}",
                    fix,
                )
            ]
        if _local_gpus():
            return []
        ranks = planned_world_size(run)
        available = read_meminfo()[1]
        room = cgroup_memory_room()
        if room is not None and (not available or room < available):
            available, what = room, "left under this process's memory cgroup limit"
        else:
            what = "of RAM available on this machine"
        if not available:
            return []
        return [
            (
                "a rank on this machine",
                available / ranks,
                f"{_gib(available)} {what} / {ranks} ranks",
                fix,
            )
        ]
    limits = []
    for key, part in cluster.partitions.items():
        where, ranks = f"a rank of partition {key}", part.ranks_per_node_effective
        budget = part.memory_budget_gb or cluster.memory_budget_gb
        gpu = known_gpu(part.gpu_type) if part.gpu_type else None
        if budget:
            name = "cluster.partitions." + key if part.memory_budget_gb else "cluster"
            limits.append(
                (
                    where,
                    budget * 2**30,
                    f"{name}.memory_budget_gb={budget:g}",
                    f"a bigger {name}.memory_budget_gb or a partition with more memory",
                )
            )
        elif gpu is not None:
            limits.append(
                (
                    where,
                    gpu.memory_gib * 2**30,
                    f"{gpu.label} GPU memory",
                    "a partition with bigger GPUs",
                )
            )
        elif not part.gpu_type:
            limits.append(
                (
                    where,
                    part.mem_gb * 2**30 / ranks,
                    f"cluster.partitions.{key}.mem_gb={part.mem_gb:g} / {ranks} ranks per node",
                    f"fewer ranks per node or a bigger cluster.partitions.{key}.mem_gb",
                )
            )
    return limits


def evaluates_in_fixed_passes(task_cfg: Any) -> bool:
    """The task's own rule (:meth:`hetseq_hpc.tasks.base.Task.evaluates_in_fixed_passes`, as
    the runtime and the planner ask it): whether an FSDP run validates on the shards. A task
    that cannot be built here says True (no whole weights counted): the pre-flight check only
    refuses what cannot fit, and the ranks check the built model again."""
    from hetseq_hpc.tasks import build_task

    try:
        return bool(build_task(task_cfg, 0).evaluates_in_fixed_passes())
    except Exception:
        return True


def check_model_fits(run: Any) -> None:
    """Refuse, before any process starts, a model whose state alone exceeds the memory a rank
    may use (:func:`rank_memory_limits`): under ``sharding.mode=none`` a full replica
    (weights, gradients and AdamW state: :data:`~hetseq_hpc.balance.memory.STATIC_PARAM_COPIES`
    fp32 copies; the message says when ``sharding.mode=fsdp`` would fit), under ``fsdp`` and
    ``auto`` this rank's shard (:data:`~hetseq_hpc.balance.memory.SHARDED_STATE_COPIES` copies /
    world size, none with ``sharding.cpu_offload`` on GPUs) plus what FSDP2 gathers at its
    peak (the root unit and the largest block, :func:`hetseq_hpc.tasks.sizes.unit_param_counts`)
    or the whole weights gathered for validation where the task decodes
    (:func:`evaluates_in_fixed_passes`): the runtime's formula,
    :func:`~hetseq_hpc.balance.memory.model_state_bytes`. The parameter count comes from the
    task's configuration (:func:`hetseq_hpc.tasks.sizes.param_count`; no model is built); a
    task whose size depends on its data or code is not checked here.

    Raises:
        ConfigError: one line with the parameter count, the bytes needed, the limit and the fix.
    """
    from hetseq_hpc.balance.memory import (
        PARAM_BYTES,
        SHARDED_STATE_COPIES,
        STATIC_PARAM_COPIES,
        model_state_bytes,
    )
    from hetseq_hpc.config.validate import planned_world_size
    from hetseq_hpc.tasks.sizes import param_count, unit_param_counts

    count = param_count(run.task)
    if not count:
        return
    world = planned_world_size(run)
    replica = model_state_bytes(float(count) * PARAM_BYTES)
    offload = bool(run.sharding.cpu_offload) and not run.cluster.is_local  # GPU partitions
    root, block = unit_param_counts(run.task) or (count, 0)

    def shard_bytes(whole: bool) -> float:
        return model_state_bytes(
            float(count) * PARAM_BYTES,
            "fsdp",
            world,
            float(block) * PARAM_BYTES,
            offload,
            gathered_weights=whole,
            root_bytes=float(root) * PARAM_BYTES,
        )

    # the larger of the two: the task (and torch with it) is built only where it decides
    upper = max(shard_bytes(True), shard_bytes(False))
    gathers_whole = functools.lru_cache(maxsize=1)(lambda: not evaluates_in_fixed_passes(run.task))
    mode = run.sharding.mode
    for where, limit, why, fix in rank_memory_limits(run):
        if (mode == "none" and replica <= limit) or (mode != "none" and upper <= limit):
            continue
        whole = gathers_whole()
        shard = shard_bytes(whole)
        gathered = (
            "the whole weights gathered for validation"
            if whole
            else "the root unit and the largest block gathered"
        )
        if mode == "none" and replica > limit:
            sharded = (
                f"sharding.mode=fsdp (a shard needs {_gib(shard)} on {world} ranks), "
                if shard < limit
                else ""
            )
            raise ConfigError(
                f"task={run.task.name} has about {count:,} parameters: weights, gradients and "
                f"AdamW state need {_gib(replica)} ({STATIC_PARAM_COPIES} x {PARAM_BYTES} bytes "
                f"per parameter) but {where} may use {_gib(limit)} ({why}): use {sharded}a "
                f"smaller task.model (hidden size, layers), {fix}"
            )
        if mode != "none" and shard > limit:
            raise ConfigError(
                f"task={run.task.name} has about {count:,} parameters: even sharded over {world} "
                f"ranks, weights, gradients and AdamW state need {_gib(shard)} per rank "
                f"({SHARDED_STATE_COPIES} x {PARAM_BYTES} bytes per parameter / {world}, plus "
                f"{gathered}) but {where} may use {_gib(limit)} ({why}): use more ranks, a "
                f"smaller task.model (hidden size, layers), {fix}"
            )
