"""The job store's handshake: mutual HMAC-SHA256 challenge-response with the job's token.

Both sides prove they hold the token without sending it: the server sends a random nonce and
checks the client's ``HMAC-SHA256(token, "client" + nonce)``, then the client does the same to
the server with ``"server"`` (the role labels stop a reflected answer). The comparison is
constant-time (``hmac.compare_digest``). This replaces the stdlib's
``multiprocessing.connection`` handshake, which on Python 3.11 is HMAC-MD5 -- refused where
OpenSSL runs in FIPS mode, as on some clusters -- and only from 3.12 negotiates SHA-256
(https://docs.python.org/3/library/multiprocessing.html#multiprocessing-auth-keys).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

#: what every challenge starts with (the protocol and its version)
GREETING = b"#hetseq-store-v1#"
#: random bytes of a challenge
NONCE_BYTES = 32
#: the longest handshake message read
MAX_BYTES = 256
WELCOME, REFUSED = b"#WELCOME#", b"#REFUSED#"


def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _nonce(message: bytes) -> bytes:
    if not message.startswith(GREETING) or len(message) != len(GREETING) + NONCE_BYTES:
        raise AuthenticationError("the peer does not speak the job store's handshake")
    return message[len(GREETING) :]


def server_handshake(conn: Connection, key: bytes) -> None:
    """Check that the client holds ``key``, then prove that this server does.

    Raises:
        multiprocessing.AuthenticationError: a wrong answer or a foreign protocol.
        OSError, EOFError: the connection broke (or timed out).
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.send_bytes(GREETING + nonce)
    if not hmac.compare_digest(conn.recv_bytes(MAX_BYTES), _mac(key, b"client", nonce)):
        conn.send_bytes(REFUSED)
        raise AuthenticationError("the client's answer is wrong")
    conn.send_bytes(WELCOME)
    conn.send_bytes(_mac(key, b"server", _nonce(conn.recv_bytes(MAX_BYTES))))


def client_handshake(conn: Connection, key: bytes) -> None:
    """Prove to the server that this client holds ``key``, then check that the server does;
    ``conn`` is closed if either fails.

    Raises:
        multiprocessing.AuthenticationError: the server refused the token, answered wrongly,
            or does not speak this handshake.
        OSError, EOFError: the connection broke (or timed out).
    """
    try:
        _client_handshake(conn, key)
    except BaseException:
        conn.close()
        raise


def _client_handshake(conn: Connection, key: bytes) -> None:
    conn.send_bytes(_mac(key, b"client", _nonce(conn.recv_bytes(MAX_BYTES))))
    if conn.recv_bytes(MAX_BYTES) != WELCOME:
        raise AuthenticationError("the job store refused this client's token")
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.send_bytes(GREETING + nonce)
    if not hmac.compare_digest(conn.recv_bytes(MAX_BYTES), _mac(key, b"server", nonce)):
        raise AuthenticationError("the job store could not prove it holds the job's token")


__all__ = ["client_handshake", "server_handshake"]
