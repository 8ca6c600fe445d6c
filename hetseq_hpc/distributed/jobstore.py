"""The job's store as the launcher sees it: where the ranks find it, its token, the keys the
launcher reads and writes, and serving it (:class:`~hetseq_hpc.distributed.auth_server.
AuthStoreServer`). No torch: the local launcher imports only this (the ranks' side, a
``torch.distributed.Store`` client: :mod:`hetseq_hpc.distributed.membership`).
"""

from __future__ import annotations

import os
import secrets
from typing import Optional, Tuple

from hetseq_hpc.distributed.auth_server import AuthStoreServer
from hetseq_hpc.errors import LaunchError

#: where the ranks find the job's store (``host:port``) and the job's token
STORE_ENV = "HETSEQ_STORE"
#: "1" when the job's store is served by the rank's parent process (the local launcher): a
#: killed parent takes the store with it for every rank
STORE_IN_PARENT_ENV = "HETSEQ_STORE_IN_PARENT"
TOKEN_ENV = "HETSEQ_JOB_TOKEN"
#: prefix of every key the ranks write (the token itself is the store's authentication key and
#: appears in no key, so no timeout message or key listing can show it)
JOB_PREFIX = "job"


def job_token() -> str:
    """A new random token naming one job's keys in the store (hex, 16 bytes)."""
    return secrets.token_hex(16)


def serve_job_store(
    host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None
) -> Tuple[AuthStoreServer, int]:
    """Serve the job's store from THIS process (the launcher, or the batch script's
    :mod:`~hetseq_hpc.distributed.store_server`): an
    :class:`~hetseq_hpc.distributed.auth_server.AuthStoreServer` listening on ``host``'s address
    only, which serves a client only after it proves it holds the job's token.

    Args:
        host: the address (or name) to listen on; port: 0 for a free one.
        token: the job's token; default ``$HETSEQ_JOB_TOKEN`` (never a command-line argument).

    Returns:
        ``(server, port)``; the server serves until ``server.close()`` or the process ends.

    Raises:
        OSError: ``host`` does not resolve or the address cannot be bound.
        LaunchError: no token given and ``HETSEQ_JOB_TOKEN`` unset.
    """
    token = token if token is not None else os.environ.get(TOKEN_ENV, "")
    if not token:
        raise LaunchError(
            f"the job's store needs the job's token in {TOKEN_ENV}: the launcher "
            "or batch script sets it (export it before starting the store)"
        )
    server = AuthStoreServer(host, port, token)
    return server, server.port


def excluded_key(member: int) -> str:
    """The server-side key that says original rank ``member`` was left out."""
    return f"{JOB_PREFIX}/excluded/{int(member)}"


def gone_key(member: int) -> str:
    """The server-side key by which the launcher says original rank ``member``'s process has
    ended (:func:`reform` leaves it out at once)."""
    return f"{JOB_PREFIX}/gone/{int(member)}"


def armed_key(member: int) -> str:
    """The server-side key by which original rank ``member`` says it is in the training loop,
    where a lost peer is recovered from (:func:`arm`)."""
    return f"{JOB_PREFIX}/armed/{int(member)}"
