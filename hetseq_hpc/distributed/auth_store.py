"""The job's store with authentication: only a client holding the job's token may use it.

torch's ``TCPStore`` has no authentication (any process that reaches its port can list, read and
write every key) and its server listens on every interface. This store is served instead:

* :class:`AuthStoreServer` (:mod:`hetseq_hpc.distributed.auth_server`, no torch: the local
  launcher serves it without importing torch) listens on ONE address. Each connection first
  passes a mutual HMAC-SHA256 challenge-response with the token as key
  (:mod:`hetseq_hpc.distributed.handshake`), in its own thread and within
  :data:`HANDSHAKE_S` seconds, so a client that stalls blocks nobody. A client without the
  token is disconnected before it can send a single request.
* :class:`AuthStoreClient` is a ``torch.distributed.Store`` subclass, so it serves
  ``init_process_group(store=PrefixStore(..., client))`` (gloo and NCCL bootstrap through it)
  as well as :mod:`hetseq_hpc.distributed.membership`. Every thread gets its own connection (the
  heartbeat thread never waits behind a blocking ``get``).

Requests and replies are frames of byte strings (:func:`pack` / :func:`unpack`), sent with
``send_bytes`` / ``recv_bytes``: nothing is ever unpickled. No message, log line or error
names the token or a value.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

from hetseq_hpc.distributed.auth_server import (  # noqa: F401 (re-exported)
    _ERROR,
    _OK,
    _TIMEOUT,
    HANDSHAKE_S,
    MAX_MESSAGE,
    AuthStoreServer,
    _b,
    _recv_timeout,
    _seconds,
    pack,
    unpack,
)
from hetseq_hpc.distributed.handshake import client_handshake

log = logging.getLogger(__name__)

#: every client made in this process, kept alive: torch's ``PrefixStore`` and process groups
#: hold only the C++ half of a Python store, and once the Python object is collected its
#: methods are gone ("Not implemented", torch 2.13); a process makes one or two clients
_LIVE: List[AuthStoreClient] = []


def _dial(address: Tuple[str, int], timeout_s: float) -> Connection:
    """A blocking :class:`~multiprocessing.connection.Connection` to ``address``, as
    ``multiprocessing.connection.Client`` makes, with its TCP connect bounded by ``timeout_s``
    seconds (at least 0.05): a host cut off without a reset (its link down, packets dropped)
    would hold ``Client``'s unbounded connect for the kernel's SYN retries, about two minutes,
    past every timeout of the caller.

    Raises:
        OSError: ``TimeoutError`` (nothing answered in time), ``ConnectionRefusedError``,
            ``OSError`` (no route to the host, a name that does not resolve).
    """
    sock = socket.create_connection(address, timeout=max(timeout_s, 0.05))
    sock.settimeout(None)  # requests block; a reply timeout is set on the connection
    return Connection(sock.detach())


class AuthStoreClient(dist.Store):
    """A ``torch.distributed.Store`` on an :class:`AuthStoreServer`, proving the token at
    connect. Thread-safe: one connection per thread, opened on the thread's first request.

    Args:
        host, port: the server's address.
        token: the job's token (never sent: only its HMAC answer to the server's challenge).
        timeout: how long ``get``/``wait``/``multi_get``/a blocking ``queue_pop`` and the
            first connection wait (``set_timeout`` changes it).
        reply_timeout_s: a reply that takes longer fails the request (None: waits on).
        connect_s: how long a connection refused is tried again (seconds; None: ``timeout``):
            short for a client whose caller asks again itself (the write fence).

    Raises (at construction, from the first connection):
        multiprocessing.AuthenticationError: the server does not accept the token.
        torch.distributed.DistNetworkError: nothing answers at ``host:port`` within ``timeout``.
    Store operations raise ``torch.distributed.DistStoreError`` when a wait times out ("timed
    out waiting ...", what :mod:`hetseq_hpc.distributed.membership` counts as a peer's failure)
    and ``DistNetworkError`` when the server is gone.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        timeout: timedelta = timedelta(seconds=300),
        reply_timeout_s: Optional[float] = None,
        connect_s: Optional[float] = None,
    ):
        super().__init__()
        self._address, self._authkey = (host, int(port)), token.encode()
        self._where = f"{host}:{int(port)}"
        self._timeout_s = timeout.total_seconds()
        self._reply_timeout_s = reply_timeout_s
        self._connect_s = connect_s
        self._local = threading.local()
        self._connection()
        _LIVE.append(self)

    def _connection(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        connect_s = self._timeout_s if self._connect_s is None else self._connect_s
        deadline = time.monotonic() + max(connect_s, 0.1)
        while True:
            try:
                conn = _dial(self._address, deadline - time.monotonic())
                break
            except OSError as exc:  # refused, timed out, no route: again until the deadline
                if time.monotonic() > deadline:
                    raise dist.DistNetworkError(
                        f"the job's store at {self._where} does not answer ({type(exc).__name__})"
                        ": its launcher is gone or the address is wrong"
                    ) from None
                time.sleep(0.1)
        if self._reply_timeout_s:  # a cut-off server fails a request instead of hanging it
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                _recv_timeout(sock, self._reply_timeout_s)
        client_handshake(conn, self._authkey)  # closes the connection if it fails
        self._local.conn = conn
        return conn

    def _call(self, op: str, *fields: bytes, waiting: Sequence[str] = ()) -> List[bytes]:
        conn = self._connection()
        try:
            conn.send_bytes(pack([op.encode(), *fields]))
            reply = unpack(conn.recv_bytes(MAX_MESSAGE))
        except (OSError, EOFError, ValueError) as exc:
            self._local.conn = None
            conn.close()
            raise dist.DistNetworkError(
                f"the job's store at {self._where} failed during {op} "
                f"({type(exc).__name__}): its launcher is gone"
            ) from None
        if reply[0] == _TIMEOUT:
            raise dist.DistStoreError(
                "timed out waiting for key(s) "
                f"{list(waiting)[:4]} in the job's store ({op}): a peer did "
                "not write them; raise the timeout if it is only slow"
            )
        if reply[0] != _OK:
            raise dist.DistStoreError(
                f"the job's store refused {op}: "
                f"{reply[1].decode(errors='replace') if len(reply) > 1 else ''}"
            )
        return reply[1:]

    def _t(self, timeout: Optional[timedelta] = None) -> bytes:  # a timeout field
        return str(self._timeout_s if timeout is None else timeout.total_seconds()).encode()

    # ---------------------------------------------------------------- torch's Store API
    def set(self, key: str, value) -> None:
        self._call("set", _b(key), _b(value))

    def get(self, key: str) -> bytes:
        return self._call("get", _b(key), self._t(), waiting=[key])[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", _b(key), str(int(value)).encode())[0])

    def check(self, keys: List[str]) -> bool:
        return self._call("check", *map(_b, keys))[0] == b"1"

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        return self._call("compare_set", _b(key), _b(expected_value), _b(desired_value))[0]

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        self._call("wait", *map(_b, keys), self._t(timeout), waiting=keys)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", _b(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call("num_keys")[0])

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return list(self._call("multi_get", *map(_b, keys), self._t(), waiting=keys))

    def multi_set(self, keys: List[str], values: List) -> None:
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys and {len(values)} values: give one value per key"
            )
        self._call("multi_set", *map(_b, keys), *map(_b, values))

    def append(self, key: str, value) -> None:
        self._call("append", _b(key), _b(value))

    def list_keys(self) -> List[str]:
        return [k.decode() for k in self._call("list_keys")]

    def queue_push(self, key: str, value) -> None:
        self._call("queue_push", _b(key), _b(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._call("queue_pop", _b(key), b"1" if block else b"0", self._t(), waiting=[key])[
            0
        ]

    def queue_len(self, key: str) -> int:
        return int(self._call("queue_len", _b(key))[0])

    def has_extended_api(self) -> bool:
        return True

    # ---------------------------------------------------------------- this store's own reads
    def ages(self, keys: Sequence[str]) -> List[Optional[float]]:
        """Seconds since each key was last written (by the server's clock), None for a key
        never set: one request for any number of keys (a member's heartbeat counter, read
        without following it)."""
        return [float(a) if a else None for a in self._call("ages", *map(_b, keys))]

    def names(self, folder: str) -> List[str]:
        """The names of the keys directly in ``folder`` (``"job/gone/"`` -> ``["3", "5"]`` for
        ``job/gone/3`` and ``job/gone/5``), in no order: one request, from the server's index
        (not a scan of every key)."""
        return [n.decode() for n in self._call("names", _b(folder))]

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout_s)

    def clone(
        self,
        timeout: Optional[timedelta] = None,
        reply_timeout_s: Optional[float] = None,
        connect_s: Optional[float] = None,
    ) -> AuthStoreClient:
        """A client of the same store with its own connections (``timeout``: default this
        one's; ``reply_timeout_s``: a reply that takes longer fails the request with
        ``DistNetworkError``, as a server that is gone does; ``connect_s``: how long a
        refused connection is tried again, default ``timeout``)."""
        return AuthStoreClient(
            self._address[0],
            self._address[1],
            self._authkey.decode(),
            self.timeout if timeout is None else timeout,
            reply_timeout_s,
            connect_s,
        )


__all__ = ["HANDSHAKE_S", "MAX_MESSAGE", "AuthStoreClient", "AuthStoreServer", "pack", "unpack"]
