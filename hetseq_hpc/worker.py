"""The per-rank entry point, the same under every launcher.

``python -m hetseq_hpc.worker --config RUN_DIR/hetseq_config.yaml`` (local launcher, sbatch
templates) or :func:`run_worker` (submitit pickles it). Each rank:

1. finds its place in the job (:class:`~hetseq_hpc.env.world.WorldInfo`);
2. probes its device (:mod:`~hetseq_hpc.env.hardware`);
3. joins the rendezvous (:mod:`~hetseq_hpc.distributed`);
4. calibrates the real model and agrees with all ranks on one
   :class:`~hetseq_hpc.allocation.Allocation` (written to ``allocation.json``);
5. trains (:class:`~hetseq_hpc.train.loop.Trainer`) and writes ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from hetseq_hpc.allocation import Allocation, allocate
from hetseq_hpc.calibrate import calibrate
from hetseq_hpc.config import RunConfig, load_run_config
from hetseq_hpc.distributed import rendezvous
from hetseq_hpc.env.emulation import emulate_speed, record as record_emulation
from hetseq_hpc.env.hardware import DeviceProbe, probe
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import AllocationError, HetseqError, Preempted
from hetseq_hpc.logs import setup_rank_logging
from hetseq_hpc.preemption import REQUEUE, StopRequest, requeue_job
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.loop import RankMeta, Trainer
from hetseq_hpc.train.rebalance import Rebalancer

log = logging.getLogger("hetseq_hpc.worker")

CONFIG_NAME = "hetseq_config.yaml"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def pick_device(world: WorldInfo) -> torch.device:
    """``cuda:<local rank % visible GPUs>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = world.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def set_threads(run: RunConfig, world: WorldInfo, env: Optional[Dict[str, str]] = None) -> int:
    """CPU threads for this rank: ``cluster.threads_per_rank``, else ``HETSEQ_THREADS`` (set by the
    local launcher), else the scheduler's ``SLURM_CPUS_PER_TASK``, else torch's default."""
    env = os.environ if env is None else env
    threads = getattr(run.cluster, "threads_per_rank", None)
    if not threads and env.get("HETSEQ_THREADS", "").isdigit():
        threads = int(env["HETSEQ_THREADS"])
    if not threads and world.cpus_per_task:
        threads = world.cpus_per_task
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def precision_context(run: RunConfig, device: torch.device, dev: DeviceProbe):
    """``(name, context factory)`` for ``trainer.precision``: bf16 autocast where the device
    supports it (compute capability >= 8.0) under ``auto``; fp32 otherwise."""
    wanted = run.trainer.precision
    bf16_ok = device.type == "cuda" and (dev.compute_capability or (0, 0)) >= (8, 0)
    if wanted == "bf16" and device.type == "cuda" and not bf16_ok:
        log.warning("trainer.precision=bf16 but %s has compute capability %s < 8.0: using fp32",
                    dev.name, dev.compute_capability)
    if wanted in ("auto", "bf16") and bf16_ok:
        return "bf16", lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return "fp32", contextlib.nullcontext


def _partition_of(run: RunConfig, world: WorldInfo):
    """This rank's PartitionConfig (het component k = k-th partition), or None."""
    parts = getattr(run.cluster, "partitions", None)
    if not parts:
        return None
    keys = list(parts)
    if world.het_group is None:
        return parts[keys[0]] if len(keys) == 1 else None
    return parts[keys[world.het_group]] if world.het_group < len(keys) else None


def emulated_speed(run: RunConfig, world: WorldInfo, env: Optional[Dict[str, str]] = None) -> float:
    """Speed factor to emulate: ``HETSEQ_EMULATE_SPEED`` (set by the local launcher from
    ``cluster.speeds``), else the partition's ``emulate_speed``, else 1."""
    env = os.environ if env is None else env
    if env.get("HETSEQ_EMULATE_SPEED"):
        return float(env["HETSEQ_EMULATE_SPEED"])
    part = _partition_of(run, world)
    return float(part.emulate_speed) if part is not None else 1.0


def memory_budget_bytes(run: RunConfig, dev: DeviceProbe, env: Optional[Dict[str, str]] = None,
                        world: Optional[WorldInfo] = None) -> float:
    """Memory this rank may plan its micro-batch with: ``memory_budget_gb`` if configured
    (cluster-wide, or per partition), else free GPU memory, else this rank's share of RAM."""
    env = os.environ if env is None else env
    configured = getattr(run.cluster, "memory_budget_gb", None)
    part = _partition_of(run, world) if world is not None else None
    if part is not None and part.memory_budget_gb:
        configured = part.memory_budget_gb
    if env.get("HETSEQ_MEMORY_BUDGET_GB"):
        configured = float(env["HETSEQ_MEMORY_BUDGET_GB"])
    if configured:
        return float(configured) * 2**30
    if dev.kind == "cuda":
        return float(dev.memory_free_bytes)
    local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    return float(dev.memory_free_bytes) / max(local, 1)


def agree_on_allocation(run: RunConfig, reports: List[Dict[str, Any]], rdv) -> Allocation:
    """Compute the allocation from every rank's report and check that all ranks got the same.

    Raises:
        AllocationError: a rank cannot fit one sample, ranks mix CUDA and CPU, or digests differ.
    """
    kinds = {r["probe"]["kind"] for r in reports}
    if len(kinds) > 1:
        where = ", ".join(f"rank {i}: {r['probe']['kind']}" for i, r in enumerate(reports))
        raise AllocationError(
            f"ranks mix CUDA and CPU devices ({where}): one all-reduce cannot span both; give "
            "every rank a GPU, or run all on CPU (CUDA_VISIBLE_DEVICES=)"
        )
    caps = [int(r["calibration"]["max_micro_batch"]) for r in reports]
    for i, cap in enumerate(caps):
        if cap < 1:
            cal = reports[i]["calibration"]
            raise AllocationError(
                f"rank {i} ({reports[i]['probe']['name']}) cannot fit one sample: needs "
                f"{(cal['static_bytes'] + cal['activation_bytes_per_sample']) / 2**30:.2f} GiB, has "
                f"{cal['memory_budget_bytes'] / 2**30:.2f} GiB; shrink task.model or leave that "
                "device out"
            )
    throughputs = [float(r["calibration"]["samples_per_s"]) for r in reports]
    allocation = allocate(throughputs, run.trainer.global_batch_size, caps,
                          forced=run.trainer.allocation)
    digests = rdv.all_gather_objects(allocation.digest())
    if len(set(digests)) != 1:
        raise AllocationError(
            f"ranks computed different allocations (digests {sorted(set(digests))}): mixed "
            "hetseq_hpc versions? install the same version on every node"
        )
    return allocation


def write_allocation_json(run_dir: Path, allocation: Allocation, reports: List[Dict[str, Any]],
                          extra: Optional[Dict[str, Any]] = None) -> Path:
    """Rank 0 writes ``allocation.json``: the split, the digest, and every rank's world, probe,
    calibration and placement (het component, partition, GRES)."""
    data = {
        "allocation": allocation.to_dict(),
        "digest": allocation.digest(),
        "ranks": [
            {**r["meta"], "world": r["world"], "probe": r["probe"], "calibration": r["calibration"],
             "precision": r["precision"], "emulation": r.get("emulation"),
             "share": allocation.to_dict()["shares"][i]}
            for i, r in enumerate(reports)
        ],
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if extra:
        data.update(extra)
    path = Path(run_dir) / "allocation.json"
    _write_json(path, data)
    return path


def _gres_of(run: RunConfig, world: WorldInfo) -> Optional[str]:
    """GRES type of this rank's partition: het component k is the k-th configured partition."""
    part = _partition_of(run, world)
    return part.gpu_type if part is not None else None


def run_worker(run: RunConfig, run_dir: str, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run one rank to the end; returns the training summary (same on every rank).

    Raises:
        HetseqError: a bad environment, an impossible allocation, a corrupt checkpoint ...
    """
    run_dir_path = Path(run_dir).resolve()
    env = os.environ if env is None else env
    world = WorldInfo.from_env(env)
    setup_rank_logging(world.rank, run_dir_path)
    threads = set_threads(run, world, env)
    device = pick_device(world)
    dev = probe(device.index if device.type == "cuda" else None)
    log.info("rank %d/%d on %s (node %s): %s", world.rank, world.world_size, dev.label,
             world.node_name, dev.note or "probed")
    if device.type == "cpu" and (env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES")):
        log.warning("GPUs were allocated (CUDA_VISIBLE_DEVICES=%s) but torch has no CUDA here: "
                    "training on CPU with gloo", env.get("CUDA_VISIBLE_DEVICES"))
    stop_request = StopRequest().install()
    emulation = emulate_speed(emulated_speed(run, world, env), threads)
    if emulation.method != "none":
        record_emulation(emulation, run_dir_path, world.rank)
    precision, autocast = precision_context(run, device, dev)
    task = build_task(run.task, run.trainer.seed)
    with rendezvous(world, device, run.cluster.collective_timeout_s) as rdv:
        inject = env.get("HETSEQ_INJECT_FAILURE", "")
        if inject.isdigit() and int(inject) == world.rank:
            raise RuntimeError(f"injected failure on rank {world.rank} (HETSEQ_INJECT_FAILURE="
                               f"{inject}): unset it to train")
        if world.is_master:
            task.prepare()
        rdv.barrier()
        task.load()
        label = dev.label if emulation.method == "none" else f"{dev.label} @{emulation.speed:g}"
        meta = RankMeta(rank=world.rank, device=label, node=world.node_name,
                        het_group=world.het_group, partition=world.partition,
                        gres=_gres_of(run, world))
        torch.manual_seed(run.trainer.seed)
        model = task.build_model().to(device)
        cal_micro = run.trainer.calibration_micro_batch or max(
            1, min(16, run.trainer.global_batch_size // world.world_size))
        cal = calibrate(
            model, lambda n: task.make_batch(list(range(min(n, task.num_train))), 0, "train"),
            device, cal_micro, run.trainer.calibration_steps, memory_budget_bytes(run, dev, env, world),
            run.trainer.max_micro_batch, autocast,
        )
        reports = rdv.all_gather_objects({
            "world": world.to_dict(), "probe": dev.to_dict(), "calibration": cal.to_dict(),
            "meta": meta.__dict__, "precision": precision, "threads": threads,
            "emulation": emulation.to_dict(),
        })
        allocation = agree_on_allocation(run, reports, rdv)
        if world.is_master:
            path = write_allocation_json(run_dir_path, allocation, reports)
            log.info("allocation %s (%s; micro-batch x accumulation %s) -> %s", allocation.samples,
                     allocation.source,
                     [f"{s.micro_batch}x{s.accum_steps}" for s in allocation.shares], path)

        def on_allocation(new: Allocation) -> None:
            if world.is_master:
                write_allocation_json(run_dir_path, new, reports)

        metas = [RankMeta(**r["meta"]) for r in reports]
        rebalancer = None
        if run.trainer.rebalance_every:
            rebalancer = Rebalancer(caps=[s.max_micro_batch for s in allocation.shares],
                                    threshold=run.trainer.rebalance_threshold)
        trainer = Trainer(run, run_dir_path, rdv, task, model, device, allocation, metas,
                          autocast=autocast, on_allocation=on_allocation,
                          stop_request=stop_request, rebalancer=rebalancer)
        summary = trainer.fit()
        if world.is_master and run.trainer.plot:
            try:
                from hetseq_hpc.report import plot_run

                summary["plot"] = str(plot_run(run_dir_path))
            except Exception as exc:  # a picture must never fail a finished run
                log.warning("could not draw the per-rank plot: %s", exc)
        summary["world_size"] = world.world_size
        if world.is_master:
            _write_json(run_dir_path / "summary.json", summary)
        rdv.barrier()
    return summary


def handle_preempted(exc: Preempted, run: RunConfig) -> None:
    """After a stop at a step boundary: on USR2, rank 0 requeues the job (through the leader id)
    unless it already restarted ``cluster.max_num_timeout`` times."""
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")) or 0)
    log.warning("rank %d: %s", rank, exc)
    if exc.code == REQUEUE and rank == 0:
        requeue_job(max_requeues=getattr(run.cluster, "max_num_timeout", 3))


def run_in_job(run: RunConfig, run_dir: str) -> Dict[str, Any]:
    """:func:`run_worker` inside a SLURM job started by submitit. A preempted rank exits with
    ``SystemExit`` so that submitit writes no result for it: the requeued job will."""
    try:
        return run_worker(run, run_dir)
    except Preempted as exc:
        handle_preempted(exc, run)
        raise SystemExit(3) from None


def error_file(run_dir: Path, rank: int) -> Path:
    """``<run dir>/logs/rank<N>.error.json``: a failed rank's one-line reason (launchers read it)."""
    return Path(run_dir) / "logs" / f"rank{rank}.error.json"


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m hetseq_hpc.worker --config FILE [--run-dir DIR]``; exit 0 on success, 3 when
    stopped by the scheduler after a checkpoint, 1 on a failure (its one-line reason goes to the
    rank's log, stderr and ``logs/rank<N>.error.json``)."""
    parser = argparse.ArgumentParser(prog="python -m hetseq_hpc.worker",
                                     description="Run one hetseq_hpc rank.")
    parser.add_argument("--config", required=True, help=f"the run's {CONFIG_NAME}")
    parser.add_argument("--run-dir", help="run directory (default: the config's directory)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir or Path(args.config).parent).resolve()
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)
    if os.environ.get("HETSEQ_IGNORE_SIGINT"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    run = None
    try:
        run = load_run_config(args.config)
        run_worker(run, str(run_dir))
        return 0
    except Preempted as exc:
        if run is not None:
            handle_preempted(exc, run)
        return 3
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then re-signalled
        if isinstance(exc, KeyboardInterrupt):
            return 130
        one_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, HetseqError):
            logging.getLogger("hetseq_hpc.worker").error("rank %d failed:\n%s", rank,
                                                          traceback.format_exc())
        logging.getLogger("hetseq_hpc.worker").error("rank %d: %s: %s", rank,
                                                      type(exc).__name__, one_line)
        try:
            path = error_file(run_dir, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_json(path, {"rank": rank, "type": type(exc).__name__, "message": one_line,
                               "time": time.time()})
        except OSError:
            pass
        if not logging.getLogger().handlers:
            print(f"rank {rank}: {type(exc).__name__}: {one_line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
