"""The job's store (hetseq_hpc.distributed.auth_store): a client without the job's token is
refused at connect and reads nothing; the server listens on its own address only; gloo process
groups initialise over it; waits time out with a message that names neither token nor value."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch.distributed as dist

from hetseq_hpc.distributed.auth_store import AuthStoreClient, AuthStoreServer, pack, unpack
from hetseq_hpc.distributed.handshake import GREETING, REFUSED
from hetseq_hpc.distributed.membership import excluded_key, job_store, serve_job_store
from hetseq_hpc.errors import LaunchError

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def server():
    srv = AuthStoreServer("127.0.0.1", 0, TOKEN)
    yield srv
    srv.close()


def _listening(port: int):
    """Local addresses of LISTEN sockets on ``port`` (/proc/net/tcp and tcp6)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    out.append(local)
    return out


def test_frames_round_trip_and_reject_garbage():
    fields = [b"set", b"", b"x" * 1000, bytes(range(256))]
    assert unpack(pack(fields)) == fields
    for bad in (b"", b"\x00\x00\x00\x02\x00\x00\x00\x05ab", pack([b"a"]) + b"z"):
        with pytest.raises(ValueError):
            unpack(bad)


@pytest.mark.parametrize("token", ["wrong", ""])
def test_a_client_without_the_token_is_refused_and_reads_nothing(server, token):
    good = AuthStoreClient("127.0.0.1", server.port, TOKEN, timedelta(seconds=5))
    good.set("job/secret", "v")
    with pytest.raises(AuthenticationError):
        AuthStoreClient("127.0.0.1", server.port, token or "x", timedelta(seconds=5))
    # a raw client that skips the handshake and sends a request gets no answer but a closed
    # connection (its bytes are taken for a failed handshake)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        raw.sendall(pack([b"list_keys"]))
        raw.settimeout(5)
        received = b""
        while True:
            try:
                chunk = raw.recv(4096)
            except ConnectionResetError:  # closed with our request unread
                break
            if not chunk:
                break
            received += chunk
        assert b"job/secret" not in received  # only the challenge and its failure came back
    # the stdlib client with no key gets the challenge, its refusal, then the connection ends
    conn = Client(("127.0.0.1", server.port))
    conn.send_bytes(pack([b"get", b"job/secret", b"1"]))
    replies = []
    with pytest.raises((EOFError, OSError)):
        for _ in range(5):
            replies.append(conn.recv_bytes())
    assert replies and all(r.startswith((GREETING, REFUSED)) for r in replies)
    # the stdlib's own handshake with the right key is another protocol: refused too
    with pytest.raises((AuthenticationError, AssertionError, EOFError, OSError)):  # 3.11: assert
        Client(("127.0.0.1", server.port), authkey=TOKEN.encode()).send_bytes(b"x")
    assert good.get("job/secret") == b"v" and good.list_keys() == ["job/secret"]


def test_the_handshake_needs_no_md5_as_under_fips(server, monkeypatch):
    """Python 3.11's stdlib handshake is HMAC-MD5, which FIPS-mode OpenSSL refuses; the store's
    own is HMAC-SHA256 and works with MD5 refused (simulated: hmac.new refuses "md5")."""
    import hmac

    real = hmac.new

    def no_md5(key, msg=None, digestmod=None):
        if str(getattr(digestmod, "__name__", digestmod)).lower().endswith("md5"):
            raise ValueError("[digital envelope routines] unsupported (FIPS)")
        return real(key, msg, digestmod)

    monkeypatch.setattr(hmac, "new", no_md5)
    client = AuthStoreClient("127.0.0.1", server.port, TOKEN, timedelta(seconds=5))
    client.set("k", "v")
    assert client.get("k") == b"v"


def test_a_client_that_stalls_the_handshake_blocks_nobody(server):
    with socket.create_connection(("127.0.0.1", server.port)):  # connects, says nothing
        start = time.monotonic()
        client = AuthStoreClient("127.0.0.1", server.port, TOKEN, timedelta(seconds=5))
        client.set("k", "1")
        assert time.monotonic() - start < 3


def test_a_store_whose_host_drops_the_connect_is_given_up_within_the_timeout():
    """A cut-off host drops the SYN (no reset): ``multiprocessing``'s ``Client`` would wait the
    kernel's SYN retries (about two minutes) past every timeout, and a rank cut off from the
    master's node would never say so. Stood in for by a listener whose accept queue is full
    (its next SYN is dropped, as a downed link drops it): the client gives up after its
    ``timeout`` with the store's address named."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        host, port = listener.getsockname()
        with socket.create_connection((host, port), timeout=5):  # fills the accept queue
            outcome: list = []

            def connect() -> None:
                try:
                    AuthStoreClient(host, port, TOKEN, timedelta(seconds=0.5))
                except dist.DistNetworkError as exc:
                    outcome.append(str(exc))

            worker = threading.Thread(target=connect, daemon=True)
            worker.start()
            worker.join(timeout=20)  # a guard: the connect must end on its own, long before
            assert not worker.is_alive(), "the connect was not bounded by the timeout"
    assert outcome == [
        f"the job's store at {host}:{port} does not answer (TimeoutError): its launcher is "
        "gone or the address is wrong"
    ]


def test_the_server_listens_on_its_address_only(server):
    assert _listening(server.port) == [f"0100007F:{server.port:04X}"]  # 127.0.0.1 only
    with pytest.raises(OSError):  # the port is taken on that address
        socket.create_server(("127.0.0.1", server.port))


def test_store_operations(server):
    c = AuthStoreClient("127.0.0.1", server.port, TOKEN, timedelta(seconds=5))
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5 and c.get("n") == b"5"
    assert c.compare_set("cs", "", "a") == b"a"  # unset + expected "" -> set
    assert c.compare_set("cs", "x", "b") == b"a"  # mismatch -> the current value
    assert c.compare_set("cs", "a", "b") == b"b"
    assert c.compare_set("none", "x", "y") == b"x" and not c.check(["none"])
    c.multi_set(["m1", "m2"], ["1", b"2"])
    assert c.multi_get(["m1", "m2"]) == [b"1", b"2"] and c.check(["m1", "m2"])
    c.append("ap", "ab")
    c.append("ap", "cd")
    assert c.get("ap") == b"abcd"
    assert c.delete_key("ap") and not c.delete_key("ap")
    c.queue_push("q", "1")
    assert c.queue_len("q") == 1 and c.queue_pop("q") == b"1" and c.queue_len("q") == 0
    assert c.num_keys() == len(c.list_keys())
    assert server.check(["n", "cs"]) and not server.check(["ap"])
    # a blocking get is answered once another thread (its own connection) sets the key
    threading.Timer(0.3, lambda: c.set("late", "ok")).start()
    assert c.get("late") == b"ok"


def test_waits_time_out_with_a_message_without_token_or_value(server):
    c = AuthStoreClient("127.0.0.1", server.port, TOKEN, timedelta(seconds=0.5))
    c.set("present", "secret-value")
    for call in (
        lambda: c.get("missing"),
        lambda: c.wait(["present", "missing"]),
        lambda: c.wait(["missing"], timedelta(seconds=0.2)),
        lambda: c.multi_get(["missing"]),
        lambda: c.queue_pop("q"),
    ):
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="timed out waiting") as info:
            call()
        assert time.monotonic() - start < 3
        assert TOKEN not in str(info.value) and "secret-value" not in str(info.value)


def test_job_store_refuses_a_wrong_token_with_one_line_without_it():
    srv, port = serve_job_store("127.0.0.1", token=TOKEN)
    try:
        env = {"HETSEQ_STORE": f"127.0.0.1:{port}", "HETSEQ_JOB_TOKEN": "f" * 32}
        with pytest.raises(LaunchError, match="refused this rank's HETSEQ_JOB_TOKEN") as info:
            job_store(5, env)
        assert "f" * 32 not in str(info.value) and TOKEN not in str(info.value)
        store = job_store(5, {**env, "HETSEQ_JOB_TOKEN": TOKEN})
        store.set("excluded/3", "1")  # what membership.reform writes
        assert srv.check([excluded_key(3)])
    finally:
        srv.close()
    with pytest.raises(LaunchError, match="HETSEQ_JOB_TOKEN"):
        serve_job_store("127.0.0.1", token="")
