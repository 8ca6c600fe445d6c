"""The job's store server: keys in a dict, served on ONE address to clients that prove the
job's token (:mod:`hetseq_hpc.distributed.handshake`), in frames of byte strings. Pure Python,
no torch: the local launcher serves it without importing torch (about a second of CPU per
run). The client, a ``torch.distributed.Store``: :mod:`hetseq_hpc.distributed.auth_store`.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import defaultdict, deque
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from hetseq_hpc.distributed.handshake import server_handshake

# the server's lines keep the name they always had (filters and docs name it)
log = logging.getLogger("hetseq_hpc.distributed.auth_store")

#: seconds a new connection has to pass the handshake
HANDSHAKE_S = 10.0
#: largest request or reply, bytes
MAX_MESSAGE = 64 << 20
_OK, _TIMEOUT, _ERROR = b"ok", b"timeout", b"error"


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
