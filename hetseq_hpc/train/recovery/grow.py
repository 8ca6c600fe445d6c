"""Grow back (``trainer.elastic.restarts``): a replacement rank joins the running job at a step
boundary and the run goes on on the same trajectory, with the lost rank's place filled again.

Survivors (:func:`admit`, after a step whose statistics carried a new join request): answer
every request (refused in one line: another code version or config digest, its place still
held), re-form into a new generation with the newcomers in their predecessors' places,
send them the whole training state from one survivor over the collective (one broadcast: the
model, optimizer, scheduler, step, RNG, history; no checkpoint is read; FSDP: gathered first,
then every member shards it over the grown world) and re-agree the split
of the SAME global batch, the newcomer with its predecessor's start-up calibration. The
newcomer (:func:`join_running_job`) asks in the job's store
(:mod:`hetseq_hpc.distributed.admission`), waits for its answer and does the same collectives.
Why the trajectory is the uninterrupted run's: docs/design/elastic-recovery.md, "Growing back".
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import hetseq_hpc
from hetseq_hpc.balance.agree import RankReport
from hetseq_hpc.balance.allocation import Allocation
from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.distributed.admission import (
    answer,
    read_requests,
    refusal,
    request_join,
    wait_for_answer,
)
from hetseq_hpc.distributed.fence import members_key
from hetseq_hpc.distributed.membership import Membership, join_generation, new_gloo_group
from hetseq_hpc.distributed.rendezvous import Rendezvous, backend_for_job, leave
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import RankExcluded
from hetseq_hpc.train.recovery.elastic import ElasticWorld
from hetseq_hpc.train.recovery.timeouts import predicted_step_s

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``<version>+<sha256 of hetseq_hpc's .py files, first 12 hex digits>``: two processes
    run the same code when these agree."""
    root = Path(hetseq_hpc.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return f"{hetseq_hpc.__version__}+{digest.hexdigest()[:12]}"


def job_fingerprint(run: RunConfig) -> Dict[str, str]:
    """``{"config": digest of the whole run configuration, "code": code_version()}``: what a
    newcomer must share with the running job to be admitted."""
    text = json.dumps(dataclasses.asdict(run), sort_keys=True, default=str)
    return {"config": hashlib.sha256(text.encode()).hexdigest()[:16], "code": code_version()}


def _put(items: List[Any], index: int, value: Any) -> None:
    """``items[index] = value``, growing ``items`` with ``value`` as needed (member ids of
    refused newcomers are never read)."""
    while len(items) <= index:
        items.append(value)
    items[index] = value


def _join_world(
    elastic: ElasticWorld, new: Membership, origin: WorldInfo, timeout_s: float
) -> Rendezvous:
    """Initialise generation ``new``'s process groups through the job's store (the default one
    and a gloo group for objects): every member of ``new`` calls this."""
    join_generation(
        elastic.store,
        new,
        elastic.member,
        backend_for_job(elastic.device, elastic.run.cluster.device_kinds()),
        elastic.cfg.timeout_s,
    )
    world = dataclasses.replace(
        origin, rank=new.rank_of(elastic.member), world_size=len(new.members)
    )
    return Rendezvous(world=world, cpu_group=new_gloo_group(elastic.cfg.timeout_s, timeout_s))


def join_event(
    step: int,
    new: Membership,
    admitted: Sequence[Dict[str, Any]],
    allocation: Allocation,
) -> Dict[str, Any]:
    """The ``event: membership`` row of a join (``join_s`` is filled in when the first step
    with the newcomers completes, from ``lost_monotonic``: the earliest request's time)."""
    waited = max(0.0, time.time() - min(float(r["requested_at"]) for r in admitted))
    return {
        "event": "membership",
        "step": step,
        "generation": new.generation,
        "lost": [],
        "joined": [
            {"rank": int(r["slot"]), "member": int(r["member"]), "host": r.get("host", "")}
            for r in admitted
        ],
        "world_size": len(new.members),
        "members": list(new.members),
        "split": list(allocation.samples),
        "resumed_at_step": step + 1,
        "lost_monotonic": time.monotonic() - waited,
    }


def admit(elastic: ElasticWorld, trainer: Any, seen: int) -> Optional[Dict[str, Any]]:
    """After a completed step (phase DONE) whose statistics carried ``seen`` join requests in
    all (more than :attr:`ElasticWorld.joins_answered`): answer the new ones and, when some are
    admitted, grow the world with them (every survivor calls this; collectives over the old
    world's members and the newcomers). Returns the join's membership event, or None when
    every request was refused (nothing changed).

    Raises:
        RuntimeError: a collective of the new world failed (a peer lost on the way: the
            caller's recovery handles it as any failed collective).
    """
    store, old = elastic.store, elastic.membership
    requests = read_requests(store, elastic.joins_answered + 1, seen)
    elastic.joins_answered = seen
    expected = job_fingerprint(elastic.run)
    held = {elastic.slots[m] for m in old.members}
    admitted: List[Dict[str, Any]] = []
    for req in requests:
        if store.check([f"gone/{int(req['member'])}"]):  # ended before it was admitted
            log.warning("member %s ended before it could be admitted", req["member"])
            continue
        taken = int(req["slot"]) in held | {int(r["slot"]) for r in admitted}
        why = refusal(req, expected, taken)
        if why is not None:
            if trainer.rank == 0:
                log.warning("%s", why)
                answer(store, int(req["member"]), {"refused": why})
            continue
        admitted.append(req)
    if not admitted:
        return None
    trainer.settle_pending()  # the last step's values read and its row written first
    sharded = trainer.sharded
    # FSDP: the whole state gathered over the old world while its groups stand (a collective
    # of every survivor; the sender, the old world's rank 0, gets the tensors)
    gathered = trainer.state_dict() if sharded else None
    trainer.metas_by_member = list(trainer.metas_by_member)  # never the current world's list
    for req in admitted:
        member, slot = int(req["member"]), int(req["slot"])
        elastic.slots[member] = slot
        _put(elastic.reports, member, elastic.reports[slot])  # its predecessor's calibration
        _put(trainer.metas_by_member, member, trainer.metas_by_member[slot])
    members = tuple(
        sorted(
            [*old.members, *(int(r["member"]) for r in admitted)],
            key=lambda m: elastic.slots[m],
        )
    )
    new = Membership(old.generation + 1, members)
    source = next(i for i, m in enumerate(members) if m in old.members)
    # where reform writes a generation's members: the write fence of every rank reads it
    store.compare_set(members_key(new.generation), "", json.dumps(list(members)))
    for req in admitted:
        answer(
            store,
            int(req["member"]),
            {"generation": new.generation, "members": list(members), "source": source},
        )
    if sharded:  # a background sharded write runs over the old world's groups: it ends first
        trainer.checkpoints.finish(trainer.rdv)
    trainer.drop_groups()  # the old world is whole: its groups are destroyed cleanly
    leave()
    gc.collect()
    elastic.membership = new  # a failure from here on re-forms from the grown generation
    elastic.fence.enter(new.generation)
    rdv = _join_world(elastic, new, elastic.origin, elastic.run.cluster.collective_timeout_s)
    sent = _state(trainer, elastic, admitted, gathered) if rdv.world.rank == source else {}
    got = rdv.broadcast_object(sent, src=source)
    allocation = _resplit(elastic, rdv, new)
    metas = [trainer.metas_by_member[m] for m in members]
    if sharded:  # every member shards the same whole state over the grown world
        trainer.reload(
            rdv, metas, allocation, elastic._rebuild, elastic.split_reports, got["state"]
        )
    else:
        trainer.rejoin(rdv, metas, allocation)
    elastic.timeout.predict(predicted_step_s(allocation))
    elastic.timeout.apply()
    event = join_event(trainer.step, new, admitted, allocation)
    log.warning(
        "step %d: rank(s) %s joined (member(s) %s); going on with %d rank(s), split %s",
        trainer.step,
        [int(r["slot"]) for r in admitted],
        [int(r["member"]) for r in admitted],
        len(members),
        allocation.samples,
    )
    return event


def _resplit(elastic: ElasticWorld, rdv: Rendezvous, new: Membership) -> Allocation:
    """The same global batch over ``new``'s members (every member calls this)."""
    allocation = elastic._split(rdv, new.members)
    elastic.timeout.rescale(elastic.timed_size / len(new.members))
    elastic.timed_size = len(new.members)
    return allocation


def _state(
    trainer: Any,
    elastic: ElasticWorld,
    admitted: Sequence[Dict[str, Any]],
    gathered: Optional[Dict[str, Any]] = None,
) -> Dict:
    """What a newcomer needs to go on as its predecessor would have: the training state
    (:meth:`Trainer.state_dict <hetseq_hpc.train.trainer.Trainer.state_dict>`: model,
    optimizer, scheduler, step, RNG, loss scale; ``gathered`` under FSDP, where it is a
    collective of the old world), how the model is held (``sharding``: ddp or fsdp), the
    history and last row, every member's facts, start-up report and place, and the requests
    admitted.

    Raises:
        RuntimeError: ``gathered`` holds no model tensors (it was gathered to another rank).
    """
    state = gathered if gathered is not None else trainer.state_dict()
    if not state.get("model"):
        raise RuntimeError("the training state to send a newcomer was gathered to another rank")
    return {
        "state": state,
        "sharding": "fsdp" if trainer.sharded else "ddp",
        "units_grouped": trainer.parallel.grouped,
        "history": trainer.history,  # a StepHistory: its folded steps too
        "last_row": dict(trainer.last_row),
        "last_val": trainer.last_val,
        "run_id": trainer.run_id,
        "saved_step": trainer.saved_step,
        "resumed_from": trainer.resumed_from,
        "metas": list(trainer.metas_by_member),
        "reports": [r.to_dict() for r in elastic.reports],
        "slots": dict(elastic.slots),
        "joins_answered": elastic.joins_answered,
        "admitted": list(admitted),
    }


@dataclasses.dataclass
class Joined:
    """A newcomer admitted into the running job (:func:`join_running_job`).

    Attributes:
        rdv: the new world's rendezvous; elastic: this rank's recovery object in it.
        allocation: the split of the global batch the world agreed on.
        state: what a survivor sent (:func:`_state`), for
            :class:`~hetseq_hpc.train.trainer.Trainer` (``joined=``).
        event: the join's membership row (written by the new rank 0 with the next step).
    """

    rdv: Rendezvous
    elastic: ElasticWorld
    allocation: Allocation
    state: Dict[str, Any]
    event: Dict[str, Any]


def join_running_job(
    run: RunConfig,
    store: dist.Store,
    world: WorldInfo,
    device: torch.device,
    member: int,
    stop: Callable[[], bool],
    rebuild: Optional[Callable[[], torch.nn.Module]] = None,
    static_for: Optional[Callable[[bool], Callable[[int], float]]] = None,
) -> Optional[Joined]:
    """Ask to join the running job as member ``member`` in rank ``world.rank``'s place, wait
    for the survivors' answer at their next step boundary, then join their new world and
    receive the training state. Returns None when the job ended first (or ``stop()``).

    Args:
        rebuild: a fresh seeded model on the CPU (an FSDP world that later loses a rank
            reloads into it, :meth:`ElasticWorld.recover`).
        static_for: ``units grouped -> (world size -> bytes of model state a rank holds)``
            under FSDP, used when the job holds its model so, with the job's own grouping of
            the units (``units_grouped`` in the state it sends): the split's micro-batch caps
            follow the shard size exactly as the survivors' do.

    Raises:
        RankExcluded: the survivors refused it (their one line: another code version or
            config digest, the place still held); the run goes on without it (exit 4).
    """
    request_join(store, member, world.rank, world.node_name, job_fingerprint(run))
    log.info("member %d: asked to join the running job in rank %d's place", member, world.rank)
    got = wait_for_answer(store, member, stop)
    if got is None:
        log.warning("member %d: the job ended before it could be admitted", member)
        return None
    if "refused" in got:
        raise RankExcluded(str(got["refused"]))
    new = Membership(int(got["generation"]), tuple(int(m) for m in got["members"]))
    placeholder = Rendezvous(world=world, cpu_group=None)
    elastic = ElasticWorld(run, store, placeholder, [], device, member=member, membership=new)
    rdv = _join_world(elastic, new, world, run.cluster.collective_timeout_s)
    state: Dict[str, Any] = rdv.broadcast_object({}, src=int(got["source"]))  # the sender's
    elastic.origin = world
    elastic.reports = [RankReport.of(r) for r in state["reports"]]
    elastic.slots = {int(m): int(s) for m, s in state["slots"].items()}
    elastic.joins_answered = int(state["joins_answered"])
    elastic.timed_size = len(new.members)
    elastic.rebuild = rebuild
    if state.get("sharding") == "fsdp" and static_for is not None:
        elastic.static_for = static_for(bool(state.get("units_grouped", False)))
    allocation = _resplit(elastic, rdv, new)
    event = join_event(int(state["state"]["step"]), new, state["admitted"], allocation)
    return Joined(rdv, elastic, allocation, state, event)


__all__ = ["Joined", "admit", "code_version", "job_fingerprint", "join_event", "join_running_job"]
