"""``hetseq-hpc probe``: measure this node's devices on the configured task, for the planner.

Each device (every visible GPU, else this CPU) gets the pynvml facts of
:mod:`hetseq_hpc.env.hardware` and a short calibration of the task's real model
(:func:`hetseq_hpc.balance.calibrate.calibrate`, the same measurement a run makes). The JSON file has
the shape of a run's ``allocation.json`` (``ranks``: ``partition``, ``gres``, ``probe``,
``calibration``), so ``hetseq-hpc plan plan.probe=<file>`` reads it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.files.user_input import output_problem, read_json_file

log = logging.getLogger(__name__)

DESCRIPTION = (
    "Probe this node's devices (pynvml: name, memory, SMs, compute capability, "
    "clocks) and time the configured task's model on each (a short calibration); "
    "write a JSON file that plan.probe= reads, and print its path."
)
EPILOG = """A lab probes each partition once, then plans from measurements:
  srun -p a100 -N1 --gres=gpu:1 hetseq-hpc probe task=bert --out lab.json --append
  srun -p v100 -N1 --gres=gpu:1 hetseq-hpc probe task=bert --out lab.json --append
  hetseq-hpc plan cluster=mixed task=bert plan.probe=lab.json
Ranks are matched to partitions by the Slurm partition the probe ran in ($SLURM_JOB_PARTITION,
else "local"; cluster=local plans match probe ranks by index)."""


def _devices() -> List[Optional[int]]:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return list(range(torch.cuda.device_count()))
    return [None]


def probe_devices(run: Any) -> List[Dict[str, Any]]:
    """One entry per device of this node: ``device``, ``node``, ``partition``, ``gres``,
    ``probe`` (:class:`~hetseq_hpc.env.hardware.DeviceProbe` as a dict) and ``calibration``
    (:class:`~hetseq_hpc.balance.calibrate.Calibration` as a dict). ``cluster=local`` on a CPU gives
    one entry per planned rank (same hardware, threads split as a run would split them)."""
    import torch

    from hetseq_hpc.balance.calibrate import calibrate
    from hetseq_hpc.balance.memory import memory_budget_bytes
    from hetseq_hpc.balance.placement import (
        calibration_micro_batch,
        placement_for,
    )
    from hetseq_hpc.env.hardware import probe
    from hetseq_hpc.tasks import build_task
    from hetseq_hpc.worker import precision_context

    task = build_task(run.task, run.trainer.seed)
    task.prepare()
    task.load()
    devices = _devices()
    world = len(devices) if devices != [None] else run.cluster.planned_world_size()
    partition = os.environ.get("SLURM_JOB_PARTITION") or "local"
    out: List[Dict[str, Any]] = []
    for index in devices:
        device = torch.device("cuda", index) if index is not None else torch.device("cpu")
        placement = placement_for(run, 0, local_world_size=world)
        torch.set_num_threads(int(placement.threads))
        dev = probe(index)
        torch.manual_seed(run.trainer.seed)
        model = task.build_model().to(device)
        budget = memory_budget_bytes(placement, dev.kind, dev.memory_free_bytes, world)
        precision, autocast = precision_context(placement, device, dev)  # as a run would train
        cal = calibrate(
            model,
            lambda n: task.make_batch(list(range(min(n, task.num_train))), 0, "train"),
            device,
            calibration_micro_batch(run, world, device.type),
            run.balance.calibration_steps,
            budget,
            run.balance.max_micro_batch,
            autocast,
        )
        log.info(
            "%s: %.1f samples/s, micro-batch cap %d",
            dev.label,
            cal.samples_per_s,
            cal.max_micro_batch,
        )
        entry = {
            "device": dev.label,
            "node": socket.gethostname(),
            "partition": partition,
            "gres": dev.name if dev.kind == "cuda" else None,
            "probe": dev.to_dict(),
            "calibration": cal.to_dict(),
            "precision": precision,
            "threads": int(placement.threads),
        }
        copies = world if index is None else 1
        out.extend(dict(entry) for _ in range(copies))
        del model
    return out


def default_out() -> Path:
    """``probe-<partition or host>.json`` in the current directory."""
    where = os.environ.get("SLURM_JOB_PARTITION") or socket.gethostname()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in where)
    return Path.cwd() / f"probe-{safe}.json"


def check_out(path: Path, append: bool) -> List[Dict[str, Any]]:
    """Check, before anything is probed, that ``path`` can take the probe file; with ``append``
    and an existing file, return its ranks (checked as ``plan.probe`` checks a probe file,
    :func:`hetseq_hpc.plan.inputs.check_probe`), else ``[]``.

    Raises:
        ConfigError: ``path`` is a directory or not a regular file, cannot be created, or
            (``--append``) is not a probe file; one line naming it and the fix.
    """
    from hetseq_hpc.plan.inputs import check_probe

    problem = output_problem(path)
    if problem:
        raise ConfigError(f"--out {path} {problem}: give a writable file, e.g. --out probe.json")
    if not (append and os.path.lexists(path)):
        return []
    label = f"--append to {path}:"
    fix = "it is not a probe file; give a new --out file, or one hetseq-hpc probe wrote"
    return list(check_probe(read_json_file(path, label, fix), label, fix)["ranks"])


def probe_command(
    overrides: Sequence[str], out: Optional[str] = None, append: bool = False
) -> Path:
    """Probe, write the JSON file and return its path. ``--out`` (and the file ``--append``
    adds to) is checked before anything is probed (:func:`check_out`).

    Raises:
        ConfigError: a bad override, an ``--out`` that cannot be written, or ``--append`` to a
            file that is not a probe file.
    """
    from hetseq_hpc.cli.overrides import refuse_internal_options
    from hetseq_hpc.config.compose import compose_run_config, run_overrides

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    refuse_internal_options(overrides)
    run = compose_run_config(run_overrides(overrides))
    path = Path(out).expanduser() if out else default_out()
    earlier = check_out(path, append)
    ranks = earlier + probe_devices(run)
    for number, rank in enumerate(ranks):
        rank["rank"] = number
    data = {
        "kind": "hetseq_hpc probe",
        "task": run.task.name,
        "ranks": ranks,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        atomic_write_json(path, data)
    except OSError as exc:
        raise ConfigError(
            f"--out {path} cannot be written ({exc.strerror or exc}): give a "
            "writable file, e.g. --out probe.json"
        ) from None
    return path
