"""``python -m hetseq_hpc.launch.slurm_regrow``: grow back on Slurm (``trainer.elastic.restarts``).

The batch script of an elastic job with restarts runs its step through this supervisor
(:func:`hetseq_hpc.launch.sbatch.regrow_command`). It starts the step, watches the job's store
for ranks the others left out, and starts each one's replacement as a new one-task step
(``srun --het-group=K --overlap --nodelist=NODE``) on the lost rank's node or, when that node is
down or drained, on a spare node of its component (``trainer.elastic.spare_nodes``). The
replacement joins the running job at a step boundary as on the local launcher
(:mod:`hetseq_hpc.distributed.admission`). The supervisor ends when every step it started has
ended. Design: docs/design/elastic-recovery.md, "Growing back on Slurm".
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence

from hetseq_hpc.config import RunConfig, SlurmClusterConfig, load_run_config
from hetseq_hpc.distributed.admission import (
    JOIN_ENV,
    MEMBER_ENV,
    answer_key,
    closed_key,
    refused_key,
)
from hetseq_hpc.env.hostlist import expand_hostlist
from hetseq_hpc.env.world import slurm_job_port
from hetseq_hpc.launch.sbatch import TASK_MODULE
from hetseq_hpc.rundir.paths import RunDir

if TYPE_CHECKING:  # the store's client is imported (with torch) in main() only
    import torch.distributed as dist

log = logging.getLogger("hetseq_hpc.slurm_regrow")

#: seconds between two looks at the steps and the job's store
POLL_S = 1.0
#: words of ``scontrol show node``'s ``State=`` that make a node unfit for a replacement
UNUSABLE_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER", "REBOOT")
#: exit status of a rank the others left out (hetseq_hpc.errors.RankExcluded)
LEFT_OUT_EXIT = 4


@dataclass(frozen=True)
class Slot:
    """Where rank ``rank`` of the job runs: its het component, partition and node.

    Attributes:
        rank: the global rank (the *slot* a replacement takes).
        component: its het component (0-based, the order of ``cluster.partitions``).
        partition: the Slurm partition of that component.
        local_rank: its index on its node (picks the same GPU as the lost rank).
        node: the node the step placed it on (block distribution over the component's first
            ``nodes`` nodes); the rank's own report in the store overrides it.
        nodes: every node of the component's allocation, the spare ones last.
        spare: the component's spare nodes (``trainer.elastic.spare_nodes``).
    """

    rank: int
    component: int
    partition: str
    local_rank: int
    node: str
    nodes: Sequence[str]
    spare: Sequence[str]


def slot_layout(
    cluster: SlurmClusterConfig, environ: Mapping[str, str], spare_nodes: int = 0
) -> List[Slot]:
    """The job's slots from its config and the batch script's environment
    (``SLURM_JOB_NODELIST_HET_GROUP_<k>``, or ``SLURM_JOB_NODELIST`` for one component).

    Returns:
        One :class:`Slot` per rank, in rank order.

    Raises:
        WorldError: a node list is malformed (:func:`~hetseq_hpc.env.hostlist.expand_hostlist`).
        ValueError: a component's allocation has fewer nodes than ``nodes + spare_nodes``.
    """
    parts = list(cluster.partitions.values())
    slots: List[Slot] = []
    for k, part in enumerate(parts):
        var = f"SLURM_JOB_NODELIST_HET_GROUP_{k}" if len(parts) > 1 else "SLURM_JOB_NODELIST"
        nodes = expand_hostlist(environ.get(var, ""), var)
        if len(nodes) < part.nodes + spare_nodes:
            raise ValueError(
                f"{var}={environ.get(var, '')!r} holds {len(nodes)} node(s), but component {k} "
                f"({part.partition}) needs {part.nodes} + {spare_nodes} spare"
            )
        per_node = part.ranks_per_node_effective
        for i in range(part.num_ranks):
            slots.append(
                Slot(
                    rank=len(slots),
                    component=k,
                    partition=part.partition,
                    local_rank=i % per_node,
                    node=nodes[i // per_node],
                    nodes=tuple(nodes),
                    spare=tuple(nodes[part.nodes :]),
                )
            )
    return slots


def node_usable(state: str) -> bool:
    """Whether a node in ``scontrol``'s ``State=`` (e.g. ``MIXED+DRAIN``, ``IDLE*``) can take a
    replacement: not down, drained or draining, failing, not responding or powered down."""
    words = state.upper().replace("*", "+NOT_RESPONDING").split("+")
    return bool(state) and not any(w.startswith(UNUSABLE_STATES) for w in words)


def node_state(node: str, timeout_s: float = 20.0) -> str:
    """``State=`` of ``node`` as ``scontrol show node -o`` prints it; ``""`` when unknown."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", "-o", node],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    for word in out.stdout.split():
        if word.startswith("State="):
            return word[len("State=") :]
    return ""


def choose_node(slot: Slot, last_node: str, state: Callable[[str], str]) -> Optional[str]:
    """The node for ``slot``'s replacement: the node its lost rank ran on (``last_node``)
    while usable (:func:`node_usable`), else the first usable spare node of its component,
    else None (nowhere to start it)."""
    if node_usable(state(last_node)):
        return last_node
    for node in slot.spare:
        if node != last_node and node_usable(state(node)):
            return node
    return None


def replacement_env(
    slot: Slot,
    world_size: int,
    het_size: int,
    member: int,
    environ: Mapping[str, str],
) -> Dict[str, str]:
    """The environment of ``slot``'s replacement (member ``member``): the batch script's (the
    job store's address and token among it) with the rank's place in the torch variables,
    which :meth:`~hetseq_hpc.env.world.WorldInfo.from_env` reads before the new step's own
    ``SLURM_PROCID`` (0 of 1)."""
    first = expand_hostlist(
        environ.get("SLURM_JOB_NODELIST_HET_GROUP_0") or environ.get("SLURM_JOB_NODELIST", "")
    )
    job = environ.get("SLURM_JOB_ID", "0")
    port = environ.get("MASTER_PORT") or str(slurm_job_port(int(job) if job.isdigit() else 0))
    env = dict(environ)
    env.update(
        {
            "RANK": str(slot.rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(slot.local_rank),
            "MASTER_ADDR": environ.get("MASTER_ADDR") or (first[0] if first else slot.node),
            "MASTER_PORT": port,
            "HETSEQ_HET_SIZE": str(het_size),
            "HETSEQ_PARTITION": slot.partition,
            MEMBER_ENV: str(member),
            JOIN_ENV: "1",
        }
    )
    if het_size > 1:
        env["HETSEQ_HET_GROUP"] = str(slot.component)
    return env


def replacement_command(
    slot: Slot, node: str, het_size: int, python: str, folder: str, job_id: str
) -> List[str]:
    """``srun`` for one replacement: one task on ``node`` of the slot's component, overlapping
    the running step (``--overlap``: it shares the CPUs, memory and GPUs the lost task held,
    https://slurm.schedmd.com/srun.html), surviving like it. The task runs the job's own
    function through submitit as the lost rank did, under its rank and the job's id
    (``SLURM_PROCID``, ``SLURM_JOB_ID``; the new step's own say 0 and, in a het job, the
    component's id): its result, error file and log (appended) are the rank's."""
    inner = (
        'export SLURM_PROCID="$2" SLURM_JOB_ID="$3"; '
        f'exec "$0" -u -m {TASK_MODULE} "$1" '
        '>>"$1/${SLURM_JOB_ID}_${SLURM_PROCID}_log.out" '
        '2>>"$1/${SLURM_JOB_ID}_${SLURM_PROCID}_log.err"'
    )
    het = [f"--het-group={slot.component}"] if het_size > 1 else []
    return [
        "srun",
        "--unbuffered",
        *het,
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=0",
        "--no-kill",
        "bash",
        "-c",
        inner,
        python,
        folder,
        str(slot.rank),
        job_id,
    ]


class Supervisor:
    """The grow-back supervisor of one job: the main step, the replacements, their members.

    Args:
        run: the run's config (``trainer.elastic.restarts`` per rank, the cluster layout).
        run_dir: the run directory (``summary.json`` ends the restarts).
        store: the job's store under its prefix (:func:`hetseq_hpc.distributed.membership.job_store`).
        slots: :func:`slot_layout`.
        start: starts one replacement: ``start(slot, node, member) -> Popen``.
        state: a node's Slurm state (:func:`node_state`).
    """

    def __init__(
        self,
        run: RunConfig,
        run_dir: RunDir,
        store: dist.Store,
        slots: Sequence[Slot],
        start: Callable[[Slot, str, int], subprocess.Popen],
        state: Callable[[str], str] = node_state,
    ):
        self.run, self.run_dir, self.store, self.slots = run, run_dir, store, list(slots)
        self.start, self.state = start, state
        self.started_at = time.time()
        world = len(self.slots)
        self.member_of: List[int] = list(range(world))  # slot -> member id of its process
        self.restarts_left: List[int] = [run.trainer.elastic.restarts] * world
        self.used = set(range(world))  # every member id given out
        self.handled: set = set()  # members whose loss was acted on
        self.replacements: Dict[int, subprocess.Popen] = {}  # member -> its srun
        self.codes: Dict[int, int] = {}  # member -> exit status of its srun

    def finished(self) -> bool:
        """Whether the run's ``summary.json`` was written after this supervisor started."""
        path = self.run_dir.summary
        return path.is_file() and path.stat().st_mtime >= self.started_at - 1

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def lost_members(self) -> List[int]:
        """Current members lost and not yet acted on: left out by the others (``excluded/<m>``),
        or a replacement whose step ended before it was admitted (killed while it waited, or
        left out as it joined: exit 4), not refused."""
        lost = []
        for member in self.member_of:
            if member in self.handled:
                continue
            if self._has(f"excluded/{member}"):
                lost.append(member)
            elif self.codes.get(member, 0) != 0:
                # admitted, it is a member: the others leave it out (above) when it is lost
                admitted = self._has(answer_key(member)) and not self._has(refused_key(member))
                if not admitted:
                    lost.append(member)
        return lost

    def replace(self, member: int) -> Optional[int]:
        """Start the replacement of member ``member`` (lost); its new member id, or None when
        it is not replaced (no restarts left, refused before, the run is over, no node)."""
        self.handled.add(member)
        slot = self.slots[self.member_of.index(member)]
        why = None
        if self.finished() or self._has(closed_key()):
            why = "the run is over"
        elif self._has(refused_key(member)):
            why = "the running job refused it"
        elif self.restarts_left[slot.rank] <= 0:
            why = f"rank {slot.rank} has no restarts left (trainer.elastic.restarts)"
        last = self._node_of(member, slot)
        node = None if why else choose_node(slot, last, self.state)
        if why is None and node is None:
            why = (
                f"its node {last} is down or drained and no spare node of partition "
                f"{slot.partition} is usable (trainer.elastic.spare_nodes)"
            )
        if why is not None:
            log.warning("rank %d (member %d) was lost; not replaced: %s", slot.rank, member, why)
            return None
        self.restarts_left[slot.rank] -= 1
        new = max(self.used) + 1
        self.used.add(new)
        self.member_of[slot.rank] = new
        log.warning(
            "rank %d (member %d) was lost: starting its replacement as member %d on node %s%s "
            "(%d restart(s) left for rank %d)",
            slot.rank,
            member,
            new,
            node,
            "" if node == last else f" (a spare: {last} is not usable)",
            self.restarts_left[slot.rank],
            slot.rank,
        )
        self.replacements[new] = self.start(slot, node, new)
        return new

    def _node_of(self, member: int, slot: Slot) -> str:
        """The node member ``member`` ran on: its own word in the store (``armed/<m>``, said
        when it entered the training loop), else the slot's place in the layout."""
        if self._has(f"armed/{member}"):
            node = self.store.get(f"armed/{member}").decode()
            if node and node != "1":
                return node
        return slot.node

    def poll(self, main: subprocess.Popen) -> bool:
        """One look: note ended replacements, replace lost members, close the admissions when
        only waiting replacements are left. Returns whether every step has ended."""
        for member, proc in self.replacements.items():
            code = proc.poll()
            if code is not None and member not in self.codes:
                self.codes[member] = code
        for member in self.lost_members():
            self.replace(member)
        running = [m for m, p in self.replacements.items() if m not in self.codes]
        main_done = main.poll() is not None
        waiting = [m for m in running if not self._has(answer_key(m))]
        if main_done and waiting and len(waiting) == len(running):
            self.store.set(closed_key(), "1")  # nobody is left to admit them: they end
        return main_done and not running

    def signal_all(self, main: subprocess.Popen, signum: int) -> None:
        """Pass ``signum`` on to every step still running (the batch script ends them so)."""
        for proc in [main, *self.replacements.values()]:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except OSError:
                    pass

    def exit_status(self, main: subprocess.Popen) -> int:
        """The main step's exit status, else the first failed replacement's (0: all ended 0;
        a replacement left out, exit 4, is not a failure); a signal ``s`` as ``128 + s``."""
        failed = [c for c in self.codes.values() if c not in (0, LEFT_OUT_EXIT)]
        code = int(main.returncode or (failed[0] if failed else 0))
        return code if code >= 0 else 128 - code  # a signal, as a shell reports it


def main(argv: Optional[List[str]] = None) -> int:
    """Run the step given after ``--`` under the supervisor; exit with the step's status."""
    parser = argparse.ArgumentParser(
        prog="python -m hetseq_hpc.launch.slurm_regrow",
        description="Run a hetseq_hpc job's step and replace its lost ranks (grow back).",
    )
    parser.add_argument("--config", required=True, help="the run's config.yaml")
    parser.add_argument("--run-dir", required=True, help="the run directory")
    parser.add_argument("--folder", required=True, help="submitit's folder (the ranks' logs)")
    parser.add_argument("step", nargs=argparse.REMAINDER, help="-- srun ... (the main step)")
    args = parser.parse_args(argv)
    step = args.step[1:] if args.step[:1] == ["--"] else args.step
    if not step:
        parser.error("give the main step after --")
    logging.basicConfig(
        level=logging.INFO, format="hetseq-hpc: %(asctime)s %(message)s", stream=sys.stderr
    )
    from hetseq_hpc.distributed.membership import job_store

    run = load_run_config(args.config)
    cluster = run.cluster
    if not isinstance(cluster, SlurmClusterConfig):
        print(
            f"hetseq-hpc: error: {args.config} is not a Slurm run (cluster={cluster.name}): "
            "the grow-back supervisor runs in a Slurm job's batch script only",
            file=sys.stderr,
        )
        return 2
    spare = run.trainer.elastic.spare_nodes
    slots = slot_layout(cluster, os.environ, spare)
    het_size = len(cluster.partitions)
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    store = job_store(run.trainer.elastic.timeout_s)
    if store is None:
        print("hetseq-hpc: error: the job's store is not set (HETSEQ_STORE)", file=sys.stderr)
        return 2

    def start(slot: Slot, node: str, member: int) -> subprocess.Popen:
        env = replacement_env(slot, len(slots), het_size, member, os.environ)
        cmd = replacement_command(slot, node, het_size, sys.executable, args.folder, job_id)
        log.info("replacement step: %s", " ".join(shlex.quote(c) for c in cmd))
        return subprocess.Popen(cmd, env=env)

    supervisor = Supervisor(run, RunDir(Path(args.run_dir)), store, slots, start)
    main_step = subprocess.Popen(step)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _f: supervisor.signal_all(main_step, s))
    while not supervisor.poll(main_step):
        time.sleep(POLL_S)
    return supervisor.exit_status(main_step)


if __name__ == "__main__":
    sys.exit(main())
