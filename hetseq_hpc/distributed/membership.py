"""Who is still in the job: heartbeats and re-forming the world after a lost rank.

Everything goes through a store that does NOT live in a rank (:func:`serve_job_store`; only
clients holding the job's token, :mod:`hetseq_hpc.distributed.auth_store`), so losing any rank,
rank 0 included, loses nothing the survivors need. :class:`Heartbeat` marks a member alive;
:func:`reform` agrees on the next generation's members (dense new ranks, in the old order).
The protocol: docs/design/elastic-recovery.md, "Membership: heartbeats and re-forming the world".
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import AuthenticationError
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from hetseq_hpc.distributed.auth_store import AuthStoreClient
from hetseq_hpc.distributed.fence import members_key
from hetseq_hpc.distributed.jobstore import (  # noqa: F401 (re-exported: the ranks' names)
    JOB_PREFIX,
    STORE_ENV,
    STORE_IN_PARENT_ENV,
    TOKEN_ENV,
    armed_key,
    excluded_key,
    gone_key,
    job_token,
    serve_job_store,
)
from hetseq_hpc.errors import HetseqError, LaunchError, RankExcluded

log = logging.getLogger(__name__)

#: seconds between two heartbeats of a rank
HEARTBEAT_S = 0.5
#: seconds between two looks at the store while re-forming, per :data:`POLL_MEMBERS` members
#: (every member reads the whole world's state at each look, so the store's load stays flat)
POLL_S = 0.05
POLL_MEMBERS = 64


def job_store(timeout_s: float, environ: Optional[Dict[str, str]] = None) -> Optional[dist.Store]:
    """A client of the job's store (keys under :data:`JOB_PREFIX`), which proves the job's
    token at connect, or None when the launcher serves none (``HETSEQ_STORE`` unset: no in-job
    recovery).

    Raises:
        LaunchError: the variables are malformed, the store cannot be reached, or it refuses
            the token.
    """
    env = os.environ if environ is None else environ
    where, token = env.get(STORE_ENV), env.get(TOKEN_ENV, "")
    if not where:
        return None
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not token:
        raise LaunchError(
            f"{STORE_ENV}={where!r} / {TOKEN_ENV} are malformed: the launcher "
            "sets them (host:port and a token); unset them to run without one"
        )
    try:
        client = AuthStoreClient(host.strip("[]"), int(port), token, timedelta(seconds=timeout_s))
    except AuthenticationError:
        raise LaunchError(
            f"the job's store at {where} refused this rank's {TOKEN_ENV}: the rank "
            "belongs to another job, or the variable was changed; start the run "
            "again"
        ) from None
    except Exception as exc:
        raise LaunchError(
            f"the job's store at {where} cannot be reached ({type(exc).__name__}): "
            "its launcher is gone; start the run again"
        ) from None
    return dist.PrefixStore(JOB_PREFIX, client)


def _job_client(store: dist.Store) -> Optional[AuthStoreClient]:
    """The job store's own client under ``store`` (:func:`job_store`'s ``PrefixStore`` over an
    :class:`~hetseq_hpc.distributed.auth_store.AuthStoreClient`, keys under
    :data:`JOB_PREFIX`), which reads the whole world's heartbeats or join keys in one request;
    None for another store (then each member's key is read on its own)."""
    inner = (
        getattr(store, "underlying_store", None) if isinstance(store, dist.PrefixStore) else None
    )
    return inner if isinstance(inner, AuthStoreClient) else None


class PrefixedClient(dist.Store):
    """Keys under ``prefix`` on an :class:`~hetseq_hpc.distributed.auth_store.AuthStoreClient`,
    the way ``dist.PrefixStore`` names them (``prefix/key``), in Python only: for the daemon
    threads that talk to the job's store (the heartbeat, the write fence's checks). A
    ``dist.PrefixStore`` call releases the GIL in C++ and takes it back in a destructor; when
    the interpreter is exiting, taking it back ends the thread inside that destructor, and the
    process aborts (``terminate called without an active exception``: a rank that had finished
    its run reported lost by SIGABRT). Implements ``set``, ``get``, ``add``, ``check``."""

    def __init__(self, prefix: str, client: AuthStoreClient):
        super().__init__()
        self.prefix, self.client = prefix, client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value) -> None:
        self.client.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self.client.get(self._key(key))

    def add(self, key: str, value: int) -> int:
        return self.client.add(self._key(key), value)

    def check(self, keys: List[str]) -> bool:
        return self.client.check([self._key(k) for k in keys])


def fence_store(store: dist.Store, ask_s: float) -> dist.Store:
    """A store for a :class:`~hetseq_hpc.distributed.fence.GenerationFence`'s questions: over
    the job's store (:func:`job_store`), a new client of the same server whose waits and
    replies take at most ``ask_s`` seconds (a cut-off server fails the question instead of
    hanging it, and a refused connection fails after a second: the fence asks again itself,
    and sees meanwhile whether the store died for every rank), keys under :data:`JOB_PREFIX`;
    any other store as it is. Python only (:class:`PrefixedClient`): asked from daemon threads."""
    client = _job_client(store)
    if client is None:
        return store
    return PrefixedClient(
        JOB_PREFIX, client.clone(timedelta(seconds=ask_s), ask_s, connect_s=min(ask_s, 1.0))
    )


def arm(store: dist.Store, member: int, node: str = "") -> None:
    """Say that this rank (member ``member``) recovers from a lost peer from now on; the value
    is its node's name (where the Slurm supervisor starts its replacement,
    :mod:`hetseq_hpc.launch.slurm_regrow`)."""
    store.set(f"armed/{int(member)}", node or "1")


class Heartbeat:
    """A daemon thread that says "alive" for ``member`` every :data:`HEARTBEAT_S` seconds, and
    the observer side: which members stopped saying it. On the job's store (:func:`job_store`)
    the store times every counter's last change itself, so nobody follows the others' counters
    (which costs every member a read of every other member every beat: W^2 reads at W ranks);
    on another store this thread follows ``watch`` every beat. ``on_beat(sent)``, if set, is
    called after each beat that reached the store (``sent``: its ``time.monotonic()`` before
    it was sent; the write fence's lease, :meth:`GenerationFence.renew
    <hetseq_hpc.distributed.fence.GenerationFence.renew>`)."""

    def __init__(self, store: dist.Store, member: int, watch: Sequence[int] = ()):
        self.store, self.member = store, int(member)
        self.watch = list(watch)  # members whose heartbeats this thread follows all along
        self.on_beat: Optional[Callable[[float], None]] = None
        self._client = _job_client(store)
        # the beats go through Python only (PrefixedClient: a C++ store call in flight when
        # the process exits aborts it)
        self._beats = store if self._client is None else PrefixedClient(JOB_PREFIX, self._client)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seen: Dict[int, Tuple[int, float]] = {}
        self._thread = threading.Thread(target=self._run, name="hetseq-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sent = time.monotonic()
                self._beats.add(f"hb/{self.member}", 1)
                if self.on_beat is not None:
                    self.on_beat(sent)
                if self._client is None:  # so that a silence is timed from its start
                    self.stale(self.watch, float("inf"))
            except Exception:  # the store is gone: the launcher ended, nothing to report to
                return
            self._stop.wait(HEARTBEAT_S)

    def stale(self, members: Sequence[int], stale_s: float) -> List[int]:
        """The members whose heartbeat has not moved for ``stale_s`` seconds (of this process's
        clock, since it first saw the counter's current value; on the job's store since the
        store saw it change, one request for all). A member that never beat is timed from
        the first time this process asked."""
        members = [int(m) for m in members]
        if self._client is not None:
            ages = self._client.ages([f"{JOB_PREFIX}/hb/{m}" for m in members]) if members else []
            now = time.monotonic()
            # the counter's value does not matter here: -1 never beat, 0 its last change's time
            values = {
                m: (-1, now) if age is None else (0, now - age) for m, age in zip(members, ages)
            }
        else:
            counts = {m: int(self.store.add(f"hb/{m}", 0)) for m in members}
            now = time.monotonic()
            values = {m: (value, now) for m, value in counts.items()}
        out = []
        with self._lock:
            for m, (value, changed) in values.items():
                last = self._seen.get(m)
                if self._client is not None and value == 0:  # the store's time of the last beat
                    self._seen[m] = (0, changed)
                    if now - changed > stale_s:
                        out.append(m)
                elif last is None or last[0] != value:
                    self._seen[m] = (value, changed)
                elif now - last[1] > stale_s:
                    out.append(m)
        return out

    def last_beat(self, member: int) -> Optional[float]:
        """When this process last saw ``member``'s heartbeat counter move
        (``time.monotonic()`` seconds), or None if it never read it (on the job's store: read
        now, when the store last saw it move, None if it never beat)."""
        if self._client is not None:
            self.stale([member], float("inf"))
        with self._lock:
            seen = self._seen.get(int(member))
        return None if seen is None else float(seen[1])

    def close(self, wait_s: float = 5.0) -> None:
        """Stop beating (the rank is leaving), and wait up to ``wait_s`` seconds for a beat in
        flight (with the fence's question after it) to end, so that none is in flight when the
        process exits."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)


@dataclass(frozen=True)
class Membership:
    """One generation of the world: ``members`` (original ranks, in new-rank order)."""

    generation: int
    members: Tuple[int, ...]

    def rank_of(self, member: int) -> int:
        """New rank of an original rank."""
        return self.members.index(member)


def recovering_key(generation: int, member: int) -> str:
    """The key by which original rank ``member`` says it is re-forming into ``generation``
    (:func:`announce_recovery`)."""
    return f"g{int(generation)}/recovering/{int(member)}"


def announce_recovery(store: dist.Store, old: Membership, me: int) -> None:
    """Say, before tearing the broken group down, that this rank is alive and re-forming:
    :func:`reform` then waits up to half its ``timeout_s`` for it rather than leaving it out
    after ``stale_s`` without a heartbeat (a lost rank never says it)."""
    store.set(recovering_key(old.generation + 1, me), "1")


def reform(
    store: dist.Store,
    heartbeat: Heartbeat,
    me: int,
    old: Membership,
    stale_s: float,
    timeout_s: float,
) -> Membership:
    """Agree with the other survivors on the next world (see the module docstring).

    Args:
        store: the job's store (:func:`job_store`); heartbeat: this rank's :class:`Heartbeat`.
        me: this rank's original rank; old: the world that broke.
        stale_s: seconds without a heartbeat after which a member counts as lost.
        timeout_s: how long to wait for the others at most.

    Raises:
        RankExcluded: the others re-formed without this rank.
        LaunchError: no agreement within ``timeout_s``.
    """
    gen = old.generation + 1
    store.set(f"g{gen}/join/{me}", "1")
    deadline = time.monotonic() + timeout_s
    key = members_key(gen)
    client = _job_client(store)
    poll_s = POLL_S * max(1.0, len(old.members) / POLL_MEMBERS)
    while True:
        # a member whose process ended (the launcher says so) is lost, even if it joined
        gone_ = _marked(store, client, "gone/", old.members)
        gone = [m for m in old.members if m != me and m in gone_]
        gone_ = set(gone)
        joined_ = _marked(store, client, f"g{gen}/join/", old.members) - gone_
        joined = [m for m in old.members if m in joined_]
        waiting = [m for m in old.members if m not in joined_ and m not in gone_]
        # a member that said it is recovering is alive and on its way (tearing its group down
        # can hold the GIL, and with it its heartbeat thread): it gets half of timeout_s
        # (left out before the deadline if it dies on the way), not stale_s
        coming_ = _marked(store, client, f"g{gen}/recovering/", waiting)
        coming = [m for m in waiting if m in coming_]
        lost = heartbeat.stale([m for m in waiting if m not in coming_], stale_s) + heartbeat.stale(
            coming, max(stale_s, timeout_s / 2.0)
        )
        if len(joined) + len(lost) + len(gone) == len(old.members):
            proposal = json.dumps(sorted(joined))
            winner = store.compare_set(key, "", proposal)
            break
        if store.check([key]):
            winner = store.get(key)
            break
        if time.monotonic() > deadline:
            raise LaunchError(
                f"the surviving ranks could not agree on a new world within "
                f"{timeout_s:g} s (joined: {joined}): raise "
                "trainer.elastic.timeout_s, or restart from the last checkpoint"
            )
        time.sleep(poll_s)
    members = tuple(json.loads(winner.decode() if isinstance(winner, bytes) else winner))
    if me not in members:
        raise RankExcluded(
            f"rank {me} was lost to the others (no heartbeat for {stale_s:g} s) and "
            f"the job went on without it as ranks {list(members)}: nothing to do"
        )
    kept = set(members)
    for m in old.members:
        if m not in kept:
            store.set(f"excluded/{m}", str(gen))
    return Membership(gen, members)


def _marked(
    store: dist.Store, client: Optional[AuthStoreClient], folder: str, members: Sequence[int]
) -> Set[int]:
    """The members among ``members`` with a key ``folder + str(member)`` in the job's store
    (``folder`` under :data:`JOB_PREFIX`): one request on the job's store, else one per member."""
    if client is None:
        return {m for m in members if store.check([f"{folder}{m}"])}
    names = set(client.names(f"{JOB_PREFIX}/{folder}"))
    return {m for m in members if str(m) in names}


def join_generation(
    store: dist.Store, membership: Membership, me: int, backend: str, timeout_s: float
) -> None:
    """Initialise the default process group of ``membership`` through the job's store (no
    master rank: any survivor may be gone), with collective timeout ``timeout_s``."""
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"g{membership.generation}/pg", store),
        rank=membership.rank_of(me),
        world_size=len(membership.members),
        timeout=timedelta(seconds=timeout_s),
    )


def new_gloo_group(bootstrap_s: float, timeout_s: float) -> dist.ProcessGroup:
    """The gloo group (objects, statistics) of the world just joined with
    :func:`join_generation`: its members must find each other in the store within
    ``bootstrap_s`` (the elastic step timeout: a member lost between the default group and
    this one is noticed then, as for the default group, not after ``timeout_s``; CI saw a
    re-form wait 300 s here), after which its collectives wait ``timeout_s``
    (``cluster.collective_timeout_s``; the phases set their own).

    Raises:
        DistStoreError: a member did not come within ``bootstrap_s`` (a peer failure: the
            caller re-forms again without it).
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=bootstrap_s))
    _set_pg_timeout(timedelta(seconds=timeout_s), group)
    return group


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` from a training step is a collective's failure (a peer gone or silent:
    torch's ``DistError``, or gloo's / NCCL's ``RuntimeError``), not a bug or bad input
    (hetseq_hpc's own errors, out of memory)."""
    if isinstance(exc, (HetseqError, torch.OutOfMemoryError)):
        return False
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text
        for word in (
            "gloo",
            "nccl",
            "connection closed",
            "connection reset",
            "timed out",
            "broken pipe",
            "timeout caused pair closure",  # gloo: a collective's timeout closed the pair
        )
    )
