"""The job's store with authentication: only a client holding the job's token may use it.

torch's ``TCPStore`` has no authentication (any process that reaches its port can list, read and
write every key) and its server listens on every interface. This store is served instead:

* :class:`AuthStoreServer` listens on ONE address (the socket is bound to the host it is
  given). Each connection first passes a mutual HMAC-SHA256 challenge-response with the
  token as key (:mod:`hetseq_hpc.distributed.handshake`; not the stdlib's, which is HMAC-MD5
  on Python 3.11), in its own thread and within :data:`HANDSHAKE_S` seconds, so a client
  that stalls blocks nobody. A client without the token is disconnected before it can send a
  single request. Keys live in a dict guarded by a ``threading.Condition``.
* :class:`AuthStoreClient` is a ``torch.distributed.Store`` subclass, so it serves
  ``init_process_group(store=PrefixStore(..., client))`` (gloo and NCCL bootstrap through it)
  as well as :mod:`hetseq_hpc.distributed.membership`. Every thread gets its own connection (the
  heartbeat thread never waits behind a blocking ``get``).

Requests and replies are frames of byte strings (:func:`pack` / :func:`unpack`: a count, then
each field's length and bytes), sent with ``send_bytes`` / ``recv_bytes``: nothing is ever
unpickled. No message, log line or error names the token or a value.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import defaultdict, deque
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch.distributed as dist

from hetseq_hpc.distributed.handshake import client_handshake, server_handshake

log = logging.getLogger(__name__)

#: seconds a new connection has to pass the handshake
HANDSHAKE_S = 10.0
#: largest request or reply, bytes
MAX_MESSAGE = 64 << 20
_OK, _TIMEOUT, _ERROR = b"ok", b"timeout", b"error"
#: every client made in this process, kept alive: torch's ``PrefixStore`` and process groups
#: hold only the C++ half of a Python store, and once the Python object is collected its
#: methods are gone ("Not implemented", torch 2.13); a process makes one or two clients
_LIVE: List[AuthStoreClient] = []


def pack(fields: Sequence[bytes]) -> bytes:
    """Frame ``fields`` (byte strings) as: field count, then each field's length and bytes
    (big-endian 32-bit unsigned integers)."""
    out = [struct.pack("!I", len(fields))]
    for field in fields:
        out += [struct.pack("!I", len(field)), bytes(field)]
    return b"".join(out)


def unpack(data: bytes) -> List[bytes]:
    """The fields of a frame written by :func:`pack`.

    Raises:
        ValueError: ``data`` is not one whole frame.
    """
    view = memoryview(data)
    if len(view) < 4:
        raise ValueError(f"a store frame of {len(view)} bytes is too short: not from this store")
    (count,), pos, fields = struct.unpack_from("!I", view), 4, []
    for _ in range(count):
        size = struct.unpack_from("!I", view, pos)[0] if pos + 4 <= len(view) else len(view)
        if pos + 4 + size > len(view):
            raise ValueError("a store frame ends inside a field: not from this store")
        fields.append(bytes(view[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    if pos != len(view):
        raise ValueError("a store frame has bytes after its last field: not from this store")
    return fields


def _b(value: Union[str, bytes, bytearray, Sequence[int]]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(field: bytes) -> Optional[float]:
    """A timeout field: seconds, or None (wait forever) for 0 or less (torch's ``kNoTimeout``)."""
    value = float(field.decode())
    return value if value > 0 else None


class AuthStoreServer:
    """Serve a job's keys on ``host:port`` (port 0: a free one) to clients holding ``token``.

    Args:
        host: the address (or host name) to listen on; only it.
        port: the port, 0 for any free one (:attr:`port` tells which).
        token: the job's token (text); a client must prove it holds it.

    Raises:
        OSError: ``host`` does not resolve or the address cannot be bound.
        ValueError: ``token`` is empty.
    """

    def __init__(self, host: str, port: int, token: str):
        if not token:
            raise ValueError("the job's store needs a token: pass the job's HETSEQ_JOB_TOKEN")
        self._authkey = token.encode()
        self._data: Dict[str, bytes] = {}
        self._stamps: Dict[str, float] = {}  # key -> time.monotonic() of its last write
        self._folders: Dict[str, Set[str]] = defaultdict(set)  # "a/b/" -> names of "a/b/*"
        self._queues: Dict[str, deque] = defaultdict(deque)
        self._cond = threading.Condition()
        self._conns: Set[Connection] = set()
        self._closed = threading.Event()
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.host, self.port = address[0], int(sock.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="hetseq-store", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- this process's view
    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set (read in this process, no connection)."""
        with self._cond:
            return all(k in self._data for k in keys)

    def set(self, key: str, value: Union[str, bytes]) -> None:
        """Set ``key`` to ``value`` in this process (no connection); waiting clients see it."""
        with self._cond:
            self._write(key, _b(value))
            self._cond.notify_all()

    def close(self) -> None:
        """Stop serving: close the listening socket and every connection (idempotent)."""
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._cond:
            conns, self._conns = list(self._conns), set()
            self._cond.notify_all()
        for conn in conns:  # wakes the connection's thread, which closes it
            try:
                raw = socket.socket(fileno=conn.fileno())
                try:
                    raw.shutdown(socket.SHUT_RDWR)
                finally:
                    raw.detach()
            except OSError:
                pass

    # ---------------------------------------------------------------- connections
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock, peer), name="hetseq-store-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer: Tuple) -> None:
        _recv_timeout(sock, HANDSHAKE_S)
        conn = Connection(sock.detach())
        try:
            server_handshake(conn, self._authkey)
        except AuthenticationError:
            log.warning(
                "job store: refused a client from %s (it does not hold the job's token)", peer[0]
            )
            conn.close()
            return
        except (OSError, EOFError, ValueError) as exc:  # gone before it answered (cut off)
            log.info(
                "job store: a client from %s left before proving it holds the job's token (%s)",
                peer[0],
                type(exc).__name__,
            )
            conn.close()
            return
        with self._cond:
            if self._closed.is_set():
                conn.close()
                return
            self._conns.add(conn)
        try:
            raw = socket.socket(fileno=conn.fileno())
            try:
                _recv_timeout(raw, 0)
            finally:
                raw.detach()
            while not self._closed.is_set():
                request = unpack(conn.recv_bytes(MAX_MESSAGE))
                conn.send_bytes(pack(self._handle(request)))
        except Exception as exc:  # a client gone, or a malformed request: drop the connection
            log.debug("job store: connection from %s ended (%s)", peer[0], type(exc).__name__)
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    # ---------------------------------------------------------------- operations
    def _wait(self, ready: Callable[[], bool], timeout: Optional[float]) -> bool:
        """Wait (holding the condition) until ``ready()`` or ``timeout`` seconds passed."""
        return (
            self._cond.wait_for(lambda: ready() or self._closed.is_set(), timeout)
            and not self._closed.is_set()
        )

    def _write(self, key: str, value: bytes) -> None:
        """Set ``key`` (holding the condition): its value, its time and its folder's index."""
        if key not in self._data:
            folder, _, name = key.rpartition("/")
            self._folders[folder + "/"].add(name)
        self._data[key] = value
        self._stamps[key] = time.monotonic()

    def _handle(self, request: List[bytes]) -> List[bytes]:
        op, args = request[0].decode(), request[1:]
        data, write = self._data, self._write
        with self._cond:
            if op == "set":
                write(args[0].decode(), args[1])
            elif op in ("get", "wait", "multi_get"):
                keys = [a.decode() for a in args[:-1]]
                if not self._wait(lambda: all(k in data for k in keys), _seconds(args[-1])):
                    return [_TIMEOUT]
                return [_OK] + ([] if op == "wait" else [data[k] for k in keys])
            elif op == "add":
                key = args[0].decode()
                value = int(data.get(key, b"0").decode()) + int(args[1].decode())
                write(key, str(value).encode())
                self._cond.notify_all()
                return [_OK, data[key]]
            elif op == "check":
                return [_OK, b"1" if all(a.decode() in data for a in args) else b"0"]
            elif op == "compare_set":
                key, expected, desired = args[0].decode(), args[1], args[2]
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    write(key, desired)
                    self._cond.notify_all()
                    return [_OK, desired]
                return [_OK, expected if current is None else current]
            elif op == "delete_key":
                key = args[0].decode()
                if data.pop(key, None) is None:
                    return [_OK, b"0"]
                folder, _, name = key.rpartition("/")
                self._folders[folder + "/"].discard(name)
                self._stamps.pop(key, None)
                return [_OK, b"1"]
            elif op == "num_keys":
                return [_OK, str(len(data)).encode()]
            elif op == "multi_set":
                half = len(args) // 2
                for k, v in zip(args[:half], args[half:]):
                    write(k.decode(), v)
            elif op == "append":
                key = args[0].decode()
                write(key, data.get(key, b"") + args[1])
            elif op == "ages":  # seconds since each key's last write, b"" for a missing key
                now, stamps = time.monotonic(), self._stamps
                return [
                    _OK,
                    *(
                        repr(now - stamps[k]).encode() if k in stamps else b""
                        for k in map(bytes.decode, args)
                    ),
                ]
            elif op == "names":  # the names of the keys in one folder ("a/b/" -> "a/b/*")
                return [_OK, *(n.encode() for n in self._folders.get(args[0].decode(), ()))]
            elif op == "list_keys":
                return [_OK, *(k.encode() for k in data)]
            elif op == "queue_push":
                self._queues[args[0].decode()].append(args[1])
            elif op == "queue_pop":
                queue = self._queues[args[0].decode()]
                if args[1] == b"1" and not self._wait(lambda: bool(queue), _seconds(args[2])):
                    return [_TIMEOUT]
                if not queue:
                    return [_ERROR, b"the queue is empty"]
                return [_OK, queue.popleft()]
            elif op == "queue_len":
                return [_OK, str(len(self._queues.get(args[0].decode(), ()))).encode()]
            else:
                return [_ERROR, f"unknown operation {op[:40]!r}".encode()]
            self._cond.notify_all()
            return [_OK]


def _recv_timeout(sock: socket.socket, seconds: float) -> None:
    """Make blocking reads on ``sock`` fail after ``seconds`` (0: never): ``SO_RCVTIMEO``,
    which survives ``detach`` (``settimeout`` would make the descriptor non-blocking)."""
    sock.setsockopt(
        socket.SOL_SOCKET,
        socket.SO_RCVTIMEO,
        struct.pack("ll", int(seconds), int((seconds % 1) * 1e6)),
    )


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
                conn = Client(self._address)
                break
            except (TimeoutError, ConnectionRefusedError) as exc:
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
