"""A new process joins a running job: its request, the survivors' answer, in the job's store.

The local launcher restarts a lost rank (``trainer.elastic.restarts``) as a NEW member id
(:data:`MEMBER_ENV`, above every original rank; the lost process stays fenced out) in the lost
rank's place (its ``RANK``, the *slot*). The newcomer asks once (:func:`request_join`: a
numbered request holding its member id, slot, host and the job fingerprint it runs) and waits
(:func:`wait_for_answer`); rank 0 of the running world reads the request count at the start of
each step (:func:`join_requests`, one store round trip, no collective) and the step's statistics
carry it to every rank, so all survivors see it after the same step. They answer every request
(:func:`answer`): admitted into generation ``n`` with its members, or refused in one line.
The protocol: docs/design/elastic-recovery.md, "Growing back".
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from hetseq_hpc.distributed.jobstore import JOB_PREFIX

if TYPE_CHECKING:  # the launcher reads the keys without torch
    import torch.distributed as dist

#: the environment variables of a restarted rank: its member id, and that it joins a running job
MEMBER_ENV = "HETSEQ_MEMBER"
JOIN_ENV = "HETSEQ_JOIN"
#: seconds between two looks of a waiting newcomer at its answer
POLL_S = 0.2


def requests_key() -> str:
    """The counter of join requests (under the job's prefix)."""
    return "grow/requests"


def request_key(index: int) -> str:
    """Join request number ``index`` (1-based), a JSON object."""
    return f"grow/request/{int(index)}"


def answer_key(member: int) -> str:
    """The survivors' answer to member ``member``'s request, a JSON object."""
    return f"grow/answer/{int(member)}"


def refused_key(member: int) -> str:
    """Set when member ``member``'s request was refused (the launcher restarts it no more)."""
    return f"grow/refused/{int(member)}"


def closed_key() -> str:
    """Set by the launcher when nobody is left to admit a waiting newcomer."""
    return "grow/closed"


def request_join(
    store: dist.Store, member: int, slot: int, host: str, fingerprint: Dict[str, str]
) -> int:
    """Ask to join as member ``member`` in place of rank ``slot``; returns the request's number.

    The request holds ``requested_at`` (``time.time()``): the join's row counts from it."""
    index = int(store.add(requests_key(), 1))
    body = {
        "member": int(member),
        "slot": int(slot),
        "host": host,
        "fingerprint": fingerprint,
        "requested_at": time.time(),
    }
    store.set(request_key(index), json.dumps(body))
    return index


def join_requests(store: dist.Store) -> int:
    """How many join requests were ever made (one round trip)."""
    return int(store.add(requests_key(), 0))


def read_requests(store: dist.Store, first: int, last: int) -> List[Dict[str, Any]]:
    """Requests ``first..last`` (each is written right after its number is drawn: waits for it)."""
    return [json.loads(store.get(request_key(i))) for i in range(first, last + 1)]


def answer(store: dist.Store, member: int, body: Dict[str, Any]) -> None:
    """Answer member ``member``: ``{"generation": n, "members": [...]}`` or ``{"refused": line}``."""
    if "refused" in body:
        store.set(refused_key(member), "1")
    store.set(answer_key(member), json.dumps(body))


def wait_for_answer(
    store: dist.Store, member: int, stop: Callable[[], bool], poll_s: float = POLL_S
) -> Optional[Dict[str, Any]]:
    """Wait for the survivors' answer to member ``member``; None when the launcher closed the
    job's admissions (:func:`closed_key`: the others ended) or ``stop()`` turned true."""
    while True:
        if store.check([answer_key(member)]):
            return json.loads(store.get(answer_key(member)))
        if store.check([closed_key()]) or stop():
            return None
        time.sleep(poll_s)


def server_key(key: str) -> str:
    """``key`` as the job's store server names it (for the launcher, which serves the store)."""
    return f"{JOB_PREFIX}/{key}"


def refusal(request: Dict[str, Any], expected: Dict[str, str], taken: bool) -> Optional[str]:
    """Why ``request`` cannot be admitted, in one line, or None.

    Args:
        request: a join request (:func:`request_join`).
        expected: the running job's fingerprint (``config``, ``code``).
        taken: its slot is held by a member of the running world.
    """
    member, slot = request.get("member"), request.get("slot")
    got = request.get("fingerprint") or {}
    for what, words in (("code", "code version"), ("config", "config digest")):
        if got.get(what) != expected.get(what):
            return (
                f"a replacement for rank {slot} (member {member}) was refused: its {words} "
                f"{got.get(what)!r} differs from the running job's {expected.get(what)!r}; "
                "the run goes on without it (start it from the same checkout and run directory)"
            )
    if taken:
        return (
            f"a replacement for rank {slot} (member {member}) was refused: rank {slot} is "
            "still in the running world; the run goes on as it is"
        )
    return None


__all__ = [
    "JOIN_ENV",
    "MEMBER_ENV",
    "answer",
    "answer_key",
    "closed_key",
    "join_requests",
    "read_requests",
    "refusal",
    "refused_key",
    "request_join",
    "server_key",
    "wait_for_answer",
]
