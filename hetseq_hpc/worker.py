"""The per-rank entry point, the same under every launcher.

``python -m hetseq_hpc.worker --config RUN_DIR/hetseq_config.yaml`` (local launcher, sbatch
templates) or :func:`run_worker` (submitit pickles it). Each rank:

1. finds its place in the job (:class:`~hetseq_hpc.env.world.WorldInfo`);
2. probes its device (:mod:`~hetseq_hpc.env.hardware`);
3. joins the rendezvous (:mod:`~hetseq_hpc.distributed.rendezvous`);
4. calibrates the real model and agrees with all ranks on one
   :class:`~hetseq_hpc.balance.allocation.Allocation` (written to ``allocation.json``);
5. trains (:class:`~hetseq_hpc.train.trainer.Trainer`) and writes ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import torch

from hetseq_hpc.balance.agree import (
    RankReport,
    agree_on_allocation,
    agree_on_sharding,
    agree_on_units,
    report_curves,
    write_allocation_json,
)
from hetseq_hpc.balance.allocation import Allocation
from hetseq_hpc.balance.calibrate import calibrate
from hetseq_hpc.balance.memory import (
    AUTO_ACTIVATION_SHARE,
    MEMORY_HEADROOM,
    ModelBytes,
    memory_budget_bytes,
    model_bytes,
    model_state_bytes,
)
from hetseq_hpc.balance.peak import MemoryWatch
from hetseq_hpc.balance.placement import (
    RankPlacement,
    calibration_micro_batch,
    placement_for,
)
from hetseq_hpc.balance.rebalance import Rebalancer
from hetseq_hpc.config import RunConfig, load_run_config
from hetseq_hpc.distributed.admission import JOIN_ENV, MEMBER_ENV
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.distributed.membership import STORE_IN_PARENT_ENV, is_peer_failure
from hetseq_hpc.distributed.rendezvous import gloo_for_all, leave, rendezvous
from hetseq_hpc.env.emulation import emulate_speed, exempt_communication_threads
from hetseq_hpc.env.emulation import record as record_emulation
from hetseq_hpc.env.hardware import DeviceProbe, probe
from hetseq_hpc.env.netif import use_route_to_master
from hetseq_hpc.env.preemption import REQUEUE, StopRequest, requeue_job
from hetseq_hpc.env.rank_guard import FAILED, exit_process, report_failure, watch_launcher
from hetseq_hpc.env.startup import BACKGROUND_IMPORTS, PhaseClock, prefetch_imports
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import (
    CheckpointError,
    ConfigError,
    LaunchError,
    Preempted,
    RankExcluded,
    RankFenced,
    StoreLost,
    exit_code,
)
from hetseq_hpc.files import fence
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.plan.gpus import known_gpu, peak_tflops
from hetseq_hpc.rundir.lock import claim_run_dir
from hetseq_hpc.rundir.logs import setup_rank_logging
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.rundir.storage import reported
from hetseq_hpc.tasks import build_task
from hetseq_hpc.tasks.contract import checked_batch
from hetseq_hpc.tasks.prepare_wait import prepare_on_rank0
from hetseq_hpc.train.checkpoint.files import step_of
from hetseq_hpc.train.checkpoint.finished import describe_finished
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, verified_run_id
from hetseq_hpc.train.compile import compiles, eager
from hetseq_hpc.train.contract_check import check_before_training
from hetseq_hpc.train.fsdp_accumulation import agree_on_accumulation
from hetseq_hpc.train.metrics import measured_step_sync
from hetseq_hpc.train.parallel import build_parallel
from hetseq_hpc.train.precision import autocast_factory, resolve_precision
from hetseq_hpc.train.records import RankMeta
from hetseq_hpc.train.recovery.elastic import ElasticWorld
from hetseq_hpc.train.recovery.grow import join_running_job
from hetseq_hpc.train.recovery.run_end import after_training, write_summary_if_missing
from hetseq_hpc.train.sampler import GlobalBatchSampler
from hetseq_hpc.train.task_summary import (
    build_checked_model,
    examples_model,
    finish_task_summary,
    record_inexact,
    seeded_model,
)
from hetseq_hpc.train.trainer import Trainer

log = logging.getLogger("hetseq_hpc.worker")


def pick_device(world: WorldInfo, kinds: Optional[Sequence[str]] = None) -> torch.device:
    """This rank's device. Without ``kinds``: ``cuda:<local rank % visible GPUs>`` when CUDA
    is available, else the CPU. With ``kinds`` (``cluster.devices``, one ``cuda``/``cpu`` per
    rank): the CPU, or the next GPU (``cuda:<cuda entries before this rank % visible GPUs>``).

    Raises:
        ConfigError: ``kinds`` puts this rank on ``cuda`` and torch has no CUDA here (the
            command line refuses it first on the launching machine).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kinds is None:
        index = world.local_rank
    elif kinds[world.rank] == "cpu":
        return torch.device("cpu")
    elif gpus == 0:
        raise ConfigError(
            f"cluster.devices=[{','.join(kinds)}] puts rank {world.rank} on cuda but torch "
            "sees no CUDA GPU on this node: use cpu for that rank, or run where a GPU is"
        )
    else:
        index = list(kinds[: world.rank]).count("cuda")
    if gpus > 0:
        index %= gpus
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def rank_placement(
    run: RunConfig, world: WorldInfo, env: Optional[Dict[str, str]] = None
) -> RankPlacement:
    """This rank's placement (:func:`hetseq_hpc.balance.placement.placement_for`) from the config and
    its place in the job: het component, ``SLURM_CPUS_PER_TASK``, ``LOCAL_WORLD_SIZE``."""
    env = os.environ if env is None else env
    local = str(env.get("LOCAL_WORLD_SIZE", ""))
    return placement_for(
        run,
        world.rank,
        het_group=world.het_group,
        local_world_size=int(local) if local.isdigit() and int(local) > 0 else None,
        cpus_per_task=world.cpus_per_task,
    )


def set_threads(placement: RankPlacement) -> int:
    """Give torch the placement's CPU threads; returns the number torch uses."""
    torch.set_num_threads(int(placement.threads))
    return torch.get_num_threads()


def precision_context(placement: RankPlacement, device: torch.device, dev: DeviceProbe):
    """``(name, context factory)`` for the placement's precision (per-rank override, else
    ``precision.default``), resolved for this device by
    :func:`hetseq_hpc.train.precision.resolve_precision`: ``auto`` = bf16 autocast on compute
    capability >= 8.0, fp16 on 7.x, fp32 on older GPUs and the CPU; explicit bf16/fp16 also
    on the CPU (torch's cpu autocast)."""
    precision, warning = resolve_precision(placement.precision, device.type, dev.compute_capability)
    if warning:
        log.warning("%s (%s)", warning, dev.name)
    return precision, autocast_factory(precision, device.type)


def calibrate_rank(
    model: torch.nn.Module,
    parallel: Any,
    task: Any,
    run: RunConfig,
    world: WorldInfo,
    device: torch.device,
    budget: float,
    autocast: Any,
    rdv: Gang,
    static: float,
    param_bytes: float,
) -> Any:
    """This rank's cost curve and micro-batch cap (:func:`hetseq_hpc.balance.calibrate.calibrate`).

    DDP: on the whole model; a rank done early times more passes while slower ones go on.
    FSDP, where the whole weights and gradients fit beside the shard on every rank (2 x the
    parameter bytes, with room for activations; one small all-gather): on the gathered model without collectives
    (:meth:`~hetseq_hpc.train.parallel.Sharded.local_passes`), so each rank times its own speed;
    the optimizer step's fixed cost is not timed then (a whole-model copy would not fit).
    Otherwise on the shards, the same passes on every rank (each pass waits for the slowest
    rank's all-gathers, so the split comes out even: a warning says so)."""

    def make(n: int) -> Any:
        return checked_batch(task, list(range(min(n, task.num_train))), 0, "train")

    args = (
        make,
        device,
        calibration_micro_batch(run, world.world_size, device.type),
        run.balance.calibration_steps,
        budget,
        run.balance.max_micro_batch,
        autocast,
    )
    if not parallel.sharded:
        return calibrate(model, *args, wait_for_peers=rdv.post_barrier, static_bytes=static)
    room = budget * MEMORY_HEADROOM * (1.0 - AUTO_ACTIVATION_SHARE)
    # every rank alike (the sharded path runs collectives in each pass): gathered only where
    # the whole weights and gradients fit EVERY rank (ranks' budgets differ on a mix)
    if all(rdv.all_gather_objects(bool(2 * param_bytes + static <= room))):
        with parallel.local_passes() as whole:
            return calibrate(
                whole, *args, step_fixed=False, wait_for_peers=rdv.post_barrier, static_bytes=static
            )
    log.warning(
        "sharding.mode=fsdp: the whole weights and gradients do not fit beside the shard "
        "for calibration: timed on the shards, where every pass waits for the slowest "
        "rank, so the split is about even; force balance.allocation for a mixed cluster"
    )
    return calibrate(model, *args, wait_for_peers=None, static_bytes=static)


def install_fence(
    run_dir: RunDir,
    elastic: ElasticWorld,
    stop: StopRequest,
    env: Optional[Mapping[str, str]] = None,
) -> None:
    """Every write into the run directory from here on checks that this rank is current
    (:mod:`hetseq_hpc.files.fence`, ``elastic.fence``). Under the local launcher, which
    serves the job's store (``HETSEQ_STORE_IN_PARENT``), a killed launcher takes the store
    with it for every rank: a rank confirmed current just before its parent died (the
    parent-death SIGHUP, :attr:`StopRequest.parent_gone_at`) then writes its last checkpoint
    without asking a store that is gone
    (:meth:`~hetseq_hpc.distributed.fence.GenerationFence.store_dies_with`)."""
    env = os.environ if env is None else env
    token = elastic.fence
    if env.get(STORE_IN_PARENT_ENV) == "1":
        token.store_dies_with(lambda: stop.parent_gone_at)
    fence.install(run_dir, token.check, token.identity)


def elastic_store(run: RunConfig, world: Any, env: Dict[str, str]) -> Any:
    """The job's store for in-job recovery (:mod:`hetseq_hpc.train.recovery.elastic`), or None: off by
    ``trainer.elastic.enabled=false``, without a store from the launcher (Slurm) and for one
    rank. Under FSDP a recovery reloads the last checkpoint
    (:mod:`hetseq_hpc.train.recovery.sharded`)."""
    from hetseq_hpc.distributed.membership import job_store

    cfg = run.trainer.elastic
    if not cfg.enabled or world.world_size < 2:
        return None
    store = job_store(run.cluster.collective_timeout_s, env)
    if store is None and world.is_master:
        log.info(
            "trainer.elastic: off (no job store: started by hand or by an older script; "
            "a lost rank ends the job as before)"
        )
    return store


def state_bytes_for(
    run: RunConfig, task: Any, sizes: ModelBytes, mode: str, device: torch.device
) -> Callable[[int], float]:
    """``world size -> bytes`` of model state one rank holds at its peak (the micro-batch
    caps of a re-formed world are recomputed from it; :func:`model_state_bytes`), for a model
    of ``sizes`` (:func:`model_bytes`, read before sharding) held as ``mode``."""
    return lambda n: model_state_bytes(
        sizes.total,
        mode,
        n,
        sizes.block,
        run.sharding.cpu_offload and device.type == "cuda",
        gathered_weights=not task.evaluates_in_fixed_passes(),
        root_bytes=sizes.root,
    )


def run_worker(
    run: RunConfig, run_dir: RunDir, env: Optional[Dict[str, str]] = None
) -> Dict[str, Any]:
    """Run one rank to the end; returns the training summary (same on every rank).

    ``run_dir`` is the run directory as the launcher names it (made absolute here).

    Raises:
        HetseqError: a bad environment, an impossible allocation, a corrupt checkpoint ...
    """
    clock = PhaseClock()
    prefetch = prefetch_imports(BACKGROUND_IMPORTS)
    run_dir_path = run_dir.resolve()
    env = os.environ if env is None else env
    world = WorldInfo.from_env(env)
    setup_rank_logging(world.rank, run_dir_path)
    use_route_to_master(world, env)
    placement = rank_placement(run, world, env)
    threads = set_threads(placement)
    kinds = run.cluster.device_kinds()  # cluster.devices: gloo for all with a CPU rank
    device = pick_device(world, kinds)
    dev = probe(device.index if device.type == "cuda" else None)
    log.info(
        "rank %d/%d on %s (node %s): %s",
        world.rank,
        world.world_size,
        dev.label,
        world.node_name,
        dev.note or "probed",
    )
    if (
        device.type == "cpu"
        and kinds is None
        and (env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES"))
    ):
        log.warning(
            "GPUs were allocated (CUDA_VISIBLE_DEVICES=%s) but torch has no CUDA here: "
            "training on CPU with gloo",
            env.get("CUDA_VISIBLE_DEVICES"),
        )
    stop_request = StopRequest().install()
    emulation = emulate_speed(placement.emulate_speed, threads)
    precision, autocast = precision_context(placement, device, dev)
    task = build_task(run.task, run.trainer.seed)
    clock.mark("probe")
    try:
        job = elastic_store(run, world, env)
    except LaunchError as exc:
        if not env.get(JOIN_ENV):
            raise
        # a replacement that cannot even reach the job's store (another job's token): the
        # run goes on without it
        raise RankExcluded(f"this replacement cannot join the running job: {exc}") from None
    if env.get(JOIN_ENV) and job is not None:  # a replacement: it joins the running job
        member = int(env.get(MEMBER_ENV, "0"))
        with claim_run_dir(run_dir_path, False, env):
            try:
                return join_worker(
                    run, run_dir_path, world, device, task, job, member, stop_request, autocast
                )
            finally:
                leave()
    with (
        claim_run_dir(run_dir_path, world.is_master, env),
        rendezvous(
            world,
            device,
            run.cluster.collective_timeout_s,
            job,
            run.trainer.elastic.timeout_s if job is not None else None,
            kinds,
        ) as rdv,
    ):
        clock.mark("rendezvous")
        if emulation.method != "none":  # a slower device, not a slower network
            emulation = exempt_communication_threads(emulation)
            record_emulation(emulation, run_dir_path, world.rank)
        # the others wait outside the gloo timeout, on rank 0's marker and heartbeat
        prepare_on_rank0(task, rdv, run_dir_path, run.cluster.collective_timeout_s)
        task.load()
        # a global batch larger than the data is refused now, not after calibration
        GlobalBatchSampler(task.num_train, run.trainer.global_batch_size, run.trainer.seed)
        clock.mark("data")
        label = dev.label if emulation.method == "none" else f"{dev.label} @{emulation.speed:g}"
        meta = RankMeta(
            rank=world.rank,
            device=label,
            node=world.node_name,
            het_group=world.het_group,
            partition=world.partition,
            gres=placement.gres,
            precision=precision,
            compiled=compiles(run.trainer.compile, device),
        )
        if prefetch is not None:
            prefetch.join()  # nothing may import these modules while the thread does
        budget = memory_budget_bytes(
            placement, dev.kind, dev.memory_free_bytes, placement.ranks_on_node
        )
        chosen: Dict[str, Any] = {}

        def place(bare: torch.nn.Module) -> torch.nn.Module:
            # DDP or FSDP from the model's size (every rank alike), then moved or sharded there
            sizes = model_bytes(task, bare)
            param_bytes = sizes.total
            mode = agree_on_sharding(
                run.sharding.mode, param_bytes, budget, rdv, device.type, gloo_for_all(kinds)
            )
            chosen["param_bytes"] = param_bytes
            if mode == "fsdp":  # on the whole CPU model, before sharding: never whole on the device
                check_before_training(task, bare, run, torch.device("cpu"), rdv, early)
            # FSDP gathers parameters in one dtype on every rank: bf16 only if all compute in it
            precisions = rdv.all_gather_objects(precision) if mode == "fsdp" else [precision]
            # FSDP: the task's units as one group where a replica would fit (every rank alike)
            units = len(list(task.sharding_units(bare))) if hasattr(task, "sharding_units") else 0
            grouped = mode == "fsdp" and agree_on_units(
                run.sharding.units, param_bytes, budget, units, rdv
            )
            chosen["parallel"] = build_parallel(run, task, bare, device, mode, precisions, grouped)
            if grouped:  # the memory rules see the group as one unit, as the strategy does
                sizes = chosen["parallel"].sizes
            chosen["static_for"] = state_bytes_for(run, task, sizes, mode, device)
            chosen["static"] = chosen["static_for"](world.world_size)
            return chosen["parallel"].model

        early: Dict[str, Any] = {}  # the FSDP contract check's record, if it was skipped
        # the peak the budget bounds, measured (hetseq_hpc.balance.peak)
        watch = MemoryWatch(device, budget, bool(placement.memory_budget_gb)).begin()
        model, task_info = build_checked_model(task, run, device, place)  # refuses BatchNorm
        parallel = chosen["parallel"]
        if parallel.sharded:
            if early.get("inexact"):
                record_inexact(task_info, early["inexact"])
        else:
            with eager():  # trainer.compile: the checks and calibration run the eager model
                check_before_training(task, model, run, device, rdv, task_info)  # sum, count
        clock.mark("model")
        watch.start_window(parallel.model)  # from the placed model: calibration, training
        parallel.memory_watch = watch
        with eager():  # no compile inside the timed passes (docs/configuration.md)
            cal = calibrate_rank(
                model,
                parallel,
                task,
                run,
                world,
                device,
                budget,
                autocast,
                rdv,
                chosen["static"],
                chosen["param_bytes"],
            )
        clock.mark("calibration")
        reports = [
            RankReport.of(r)
            for r in rdv.all_gather_objects(
                RankReport(
                    world=world,
                    probe=dev,
                    calibration=cal,
                    meta=meta,
                    precision=precision,
                    threads=threads,
                    emulation=emulation,
                    placement=placement,
                ).to_dict()
            )
        ]
        allocation = agree_on_allocation(run, reports, rdv)
        agree_on_accumulation(run.sharding, parallel, allocation, reports, rdv)  # FSDP only
        clock.mark("allocation")

        live: Dict[str, Any] = {}  # the elastic world, once there is one

        def on_allocation(new: Allocation, extra: Optional[Dict[str, Any]] = None) -> None:
            if torch.distributed.get_rank() == 0:  # of the current world (it may have re-formed)
                members = live["elastic"].membership.members if live else range(len(reports))
                known = live["elastic"].reports if live else reports  # a newcomer's too
                write_allocation_json(
                    run_dir_path,
                    new,
                    [known[m] for m in members],
                    {"startup": clock.to_dict(), **(extra or {})},
                )

        metas = [r.meta for r in reports]
        rebalancer = None
        if parallel.sharded and run.balance.rebalance_interval and world.world_size > 1:
            log.info(
                "sharding.mode=fsdp: online re-balancing is off (every pass waits for the "
                "all-gathers, so a rank's step time shows the slowest rank's pace); the "
                "calibrated split is kept"
            )
        elif run.balance.rebalance_interval and world.world_size > 1:
            rebalancer = Rebalancer(
                caps=[s.max_micro_batch for s in allocation.shares],
                threshold=run.balance.rebalance_threshold,
                curves=report_curves(reports),
            )
        elastic = (
            ElasticWorld(
                run,
                job,
                rdv,
                reports,
                device,
                rebuild=lambda: seeded_model(task, run.trainer.seed),
                static_for=chosen["static_for"] if parallel.sharded else None,
            )
            if job is not None
            else None
        )
        if elastic is not None:
            live["elastic"] = elastic
            install_fence(run_dir_path, elastic, stop_request, env)
        trainer = Trainer(
            run,
            run_dir_path,
            rdv,
            task,
            model,
            device,
            allocation,
            metas,
            autocast=autocast,
            on_allocation=on_allocation,
            stop_request=stop_request,
            rebalancer=rebalancer,
            parallel=parallel,
            elastic=elastic,
        )
        if trainer.step >= run.trainer.max_steps:  # a finished run: its files stay as they are
            if elastic is not None:
                elastic.close()
            return finished_summary(run, run_dir_path, trainer, world.is_master)
        if world.is_master:  # after the Trainer chose the run (a new run archives the old one)
            clock.log()
            path = write_allocation_json(
                run_dir_path, allocation, reports, {"startup": clock.to_dict()}
            )
            log.info(
                "allocation %s (%s; micro-batch x accumulation %s) -> %s",
                allocation.samples,
                allocation.source,
                [f"{s.micro_batch}x{s.accum_steps}" for s in allocation.shares],
                path,
            )
        return finish_training(
            run, run_dir_path, trainer, task, task_info, elastic, on_allocation, rebalancer
        )


def finish_training(
    run: RunConfig,
    run_dir_path: RunDir,
    trainer: Trainer,
    task: Any,
    task_info: Dict[str, Any],
    elastic: Optional[ElasticWorld],
    on_allocation: Callable[..., None],
    rebalancer: Optional[Rebalancer] = None,
) -> Dict[str, Any]:
    """Train to the end and write what a finished run leaves (``summary.json`` by rank 0 of
    the world at the end, the plot); returns the summary. Every rank, a replacement too."""
    summary = trainer.fit()
    master = trainer.rank == 0  # of the current world (rank 0 may have been lost)
    examples = after_training(
        elastic,
        lambda: examples_model(task, trainer.parallel, master),
        "gathering the weights for the examples",
        None,
    )
    finish_task_summary(summary, task, examples, task_info, master)
    summary["mfu"] = steady_mfu(summary, trainer.metas)
    final: Dict[str, Any] = {}  # what plans read from a finished run (plan.probe)
    if rebalancer is not None and all(rebalancer.fitted):  # the refitted curves
        final["fitted_curves"] = [c.to_dict() for c in rebalancer.fitted]
    measured = measured_step_sync(trainer.history, trainer.allocation.samples)
    if measured is not None:
        final["measured_step"] = measured
    if final:
        on_allocation(trainer.allocation, final)
    summary["world_size"] = trainer.world.world_size
    if elastic is not None:  # the original ranks whose place is empty at the end
        summary["lost_ranks"] = sorted(
            set(elastic.slots.values()) - {elastic.slots[m] for m in elastic.membership.members}
        )
        elastic.close()
    if master:
        atomic_write_json(run_dir_path.summary, {**summary, **fence.stamp()})
    if (
        not after_training(
            elastic, lambda: trainer.rdv.barrier() or True, "the final barrier", False
        )
        and not master
    ):
        write_summary_if_missing(run_dir_path, summary)  # rank 0 may be the one lost
    if master and run.trainer.plot:  # after the barrier: no rank waits for it
        draw_plot(summary, run_dir_path)
    return summary


@contextlib.contextmanager
def left_out_if_a_peer_fails(member: int) -> Iterator[None]:
    """While a replacement joins (the grown world's groups, the state's broadcast, the split,
    loading the state): a rank lost meanwhile makes the survivors re-form without the
    newcomer too, so a collective failure here ends it as left out (:class:`RankExcluded`,
    exit 4: the launcher starts it again while it has restarts), not as a failed run (the
    chaos soak saw a run end so).

    Raises:
        RankExcluded: a peer failure (:func:`is_peer_failure`) inside the block.
    """
    try:
        yield
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        raise RankExcluded(
            f"member {member}: a rank was lost while the grown world formed "
            f"({type(exc).__name__}); the others go on without this replacement"
        ) from None


def join_worker(
    run: RunConfig,
    run_dir_path: RunDir,
    world: WorldInfo,
    device: torch.device,
    task: Any,
    job: Any,
    member: int,
    stop_request: StopRequest,
    autocast: Any,
) -> Dict[str, Any]:
    """A replacement rank (started by the local launcher for ``trainer.elastic.restarts``):
    build the model, ask to join the running job in rank ``world.rank``'s place, receive the
    training state from a survivor (:func:`hetseq_hpc.train.recovery.grow.join_running_job`)
    and train to the end with the others. Returns ``{}`` when the job ended first.

    Raises:
        RankExcluded: the survivors refused it (their one line; exit 4), or a rank was lost
            while it joined (:func:`left_out_if_a_peer_fails`).
    """
    task.load()
    # on the CPU until the job says how it holds the model (DDP: moved; FSDP: sharded)
    model, task_info = build_checked_model(task, run, device, place=lambda bare: bare)
    sizes = model_bytes(task, model)
    with left_out_if_a_peer_fails(member):
        joined = join_running_job(
            run,
            job,
            world,
            device,
            member,
            lambda: bool(stop_request.code),
            rebuild=lambda: seeded_model(task, run.trainer.seed),
            # the job's grouping of the units (sent with its state) picks the sizes, so the
            # split's caps follow the shards exactly as the survivors' do
            static_for=lambda grouped: state_bytes_for(
                run, task, sizes.grouped() if grouped else sizes, "fsdp", device
            ),
        )
        if joined is None:
            return {}
        elastic, rdv = joined.elastic, joined.rdv
        install_fence(run_dir_path, elastic, stop_request)
        metas = [joined.state["metas"][m] for m in elastic.membership.members]
        sharding = joined.state.get("sharding", "ddp")
        parallel = None
        if sharding == "fsdp":  # sharded over the grown world, as the survivors re-shard theirs
            parallel = build_parallel(
                run,
                task,
                model,
                device,
                "fsdp",
                [m.precision for m in metas],
                bool(joined.state.get("units_grouped", False)),
            )
            agree_on_accumulation(
                run.sharding, parallel, joined.allocation, elastic.split_reports, rdv
            )
            model = parallel.model
        else:
            model = model.to(device)

        def on_allocation(new: Allocation, extra: Optional[Dict[str, Any]] = None) -> None:
            if torch.distributed.get_rank() == 0:  # a replacement of rank 0 writes it too
                write_allocation_json(
                    run_dir_path,
                    new,
                    [elastic.reports[m] for m in elastic.membership.members],
                    extra or {},
                )

        trainer = Trainer(
            run,
            run_dir_path,
            rdv,
            task,
            model,
            device,
            joined.allocation,
            metas,
            autocast=autocast,
            on_allocation=on_allocation,
            stop_request=stop_request,
            sharding=sharding,
            parallel=parallel,
            elastic=elastic,
            joined=joined.state,
        )
        trainer.join_event = joined.event
    log.info(
        "member %d: joined the running job as rank %d of %d at step %d (split %s)",
        member,
        rdv.world.rank,
        rdv.world.world_size,
        trainer.step,
        joined.allocation.samples,
    )
    return finish_training(run, run_dir_path, trainer, task, task_info, elastic, on_allocation)


def steady_mfu(summary: Dict[str, Any], metas: Sequence[RankMeta]) -> Optional[float]:
    """Model FLOPs utilisation at the steady-state rate: ``steady_samples_per_s`` x the task's
    FLOPs per sample / the sum of the ranks' datasheet peaks in their precisions
    (:func:`hetseq_hpc.plan.gpus.peak_tflops`); None when a rank's device has no known peak
    (a CPU, an unlisted GPU) or a figure is missing."""
    rate = summary.get("steady_samples_per_s")
    flops = (summary.get("task") or {}).get("flops_per_sample")
    peaks = []
    for meta in metas:
        gpu = known_gpu(meta.device) if meta.device and meta.device != "cpu" else None
        if gpu is None:
            return None
        peaks.append(peak_tflops(gpu, meta.precision or "fp32"))
    if not rate or not flops or not peaks:
        return None
    return float(rate) * float(flops) / (sum(peaks) * 1e12)


def finished_summary(
    run: RunConfig, run_dir: RunDir, trainer: Trainer, master: bool
) -> Dict[str, Any]:
    """Ranks that resumed a finished run (the checkpoint at ``trainer.max_steps`` or later; the
    command line refuses to start one, but a second queued job or a job script submitted by
    hand can reach it): nothing is trained and nothing is written (``summary.json``,
    ``allocation.json``, ``metrics.jsonl``, the checkpoints and the plot stay as they are).
    Rank 0 logs the one line of :class:`~hetseq_hpc.train.checkpoint.finished.FinishedRun`.

    Returns:
        The run's ``summary.json`` when it records that step, else ``{}``.
    """
    finished = describe_finished(
        run_dir, Path(trainer.resumed_from or ""), trainer.step, run.trainer.max_steps
    )
    if master:
        log.info("%s", finished.line())
    if finished.summary is None:
        return {}
    return json.loads(finished.summary.read_text(encoding="utf-8"))


def draw_plot(summary: Dict[str, Any], run_dir: RunDir) -> None:
    """Rank 0 at the end of a run: ``ranks.png`` (:func:`hetseq_hpc.report.plots.plot_run`),
    its path logged and added to ``summary`` and ``summary.json``. A failure only warns: a
    picture never fails a finished run (but a rank the others left out draws nothing:
    ``RankFenced``)."""
    fence.check_write(run_dir.plot)
    try:
        from hetseq_hpc.report.plots import plot_run

        summary["plot"] = str(plot_run(run_dir.root))
    except Exception as exc:
        log.warning(
            "could not draw the run's plot (%s): draw it later with hetseq-hpc report %s",
            " ".join(str(exc).split()) or type(exc).__name__,
            run_dir,
        )
        return
    log.info("plot: %s", summary["plot"])
    atomic_write_json(run_dir.summary, summary)


def handle_preempted(exc: Preempted, run: RunConfig) -> None:
    """After a stop at a step boundary: on USR2, rank 0 requeues the job (through the leader id)
    unless it already restarted ``cluster.max_num_timeout`` times; after an elastic world fell
    below ``trainer.elastic.min_ranks``, its current rank 0 does (:meth:`Preempted.leads`)."""
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")) or 0)
    log.warning("rank %d: %s", rank, exc)
    if exc.code == REQUEUE and exc.leads(rank):
        requeue_job(max_requeues=run.cluster.max_requeues)


def last_checkpoint_words(run_dir: RunDir) -> str:
    """Words on the run's last checkpoint for a rank cut off from the job's store (it only
    reads): ``last checkpoint step N verified (PATH)``, why it does not verify, or none yet."""
    found = CheckpointManager(run_dir).list()
    if not found:
        return "no checkpoint written yet"
    try:
        verified_run_id(found[-1])
    except (CheckpointError, OSError) as exc:
        return f"the last checkpoint {found[-1]} does not verify: {exc}"
    return f"last checkpoint step {step_of(found[-1])} verified: {found[-1]}"


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m hetseq_hpc.worker --config FILE [--run-dir DIR]``; exit 0 on success, 3 when
    stopped by the scheduler after a checkpoint, 1 on a failure (its one-line reason goes to the
    rank's log, stderr and ``logs/rank<N>.error.json``, marked when it is only a peer's
    disconnection: :func:`hetseq_hpc.env.rank_guard.report_failure`). Started by the local
    launcher, the rank also ends itself if that launcher dies (``watch_launcher``)."""
    parser = argparse.ArgumentParser(
        prog="python -m hetseq_hpc.worker", description="Run one hetseq_hpc rank."
    )
    parser.add_argument("--config", required=True, help=f"the run's {RunDir.CONFIG_NAME}")
    parser.add_argument("--run-dir", help="run directory (default: the config's directory)")
    args = parser.parse_args(argv)
    run_dir = RunDir(Path(args.run_dir or Path(args.config).parent).resolve())
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)
    if os.environ.get("HETSEQ_IGNORE_SIGINT"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_launcher()
    run = None
    try:
        run = load_run_config(args.config)
        run_worker(run, run_dir)
        return 0
    except Preempted as exc:
        if exc.after_lost_rank:  # no teardown of the broken world (see FAILED)
            FAILED.append(exc)
        if run is not None:
            handle_preempted(exc, run)
        return 3
    except (RankExcluded, RankFenced) as exc:  # the job went on without this rank
        FAILED.append(exc)  # see FAILED
        line = str(exc)
        if isinstance(exc, StoreLost):
            line = f"{line} ({last_checkpoint_words(run_dir)})"
        # one line on stderr; the rank's log file refuses it (the fence), nothing is written
        log.warning("rank %d: %s", rank, line)
        return exit_code(exc)
    except BaseException as exc:  # every failure is reported, then re-signalled
        if isinstance(exc, KeyboardInterrupt):
            return 130
        FAILED.append(exc)  # see FAILED
        # a write to a full or read-only run directory, wherever it was: one line, no traceback
        one_line = report_failure(reported(exc, run_dir), rank, run_dir.error_file(rank))
        if not logging.getLogger().handlers:
            print(f"rank {rank}: {type(exc).__name__}: {one_line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    exit_process(main())
