"""A rendezvous store that listens on the loopback interface only (``cluster=local``).

torch's ``TCPStore`` server binds every interface (``*:<port>``, checked with ``ss -ltn`` on
torch 2.13) whatever ``host_name`` says, both through ``init_method="tcp://127.0.0.1:P"`` and
when built by hand: ``host_name`` is only where clients connect. Its ``master_listen_fd``
argument (the libuv backend, torch's default) instead listens on a socket the caller has
already bound, so binding that socket to ``127.0.0.1`` keeps the store off the network. Only
the store is concerned: gloo's own pair sockets bind the address that the host name resolves
to, or the interface in ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from hetseq_hpc.env.netif import is_loopback
from hetseq_hpc.env.world import WorldInfo


def loopback_store(world: WorldInfo, timeout_s: float) -> Optional[dist.TCPStore]:
    """The rendezvous store for a world whose master address is a loopback address, with the
    server (rank 0) listening on that address only; None for any other master address (the
    caller then uses ``init_method="tcp://..."``).

    Raises:
        OSError: rank 0 cannot bind ``master_addr:master_port`` (in use).
        RuntimeError / torch.distributed.DistError: the store cannot be created or reached in
            ``timeout_s`` seconds.
    """
    if not is_loopback(world.master_addr):
        return None
    timeout = timedelta(seconds=timeout_s)
    if not world.is_master:
        return dist.TCPStore(
            world.master_addr, world.master_port, world.world_size, False, timeout=timeout
        )
    family = socket.AF_INET6 if ":" in world.master_addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((world.master_addr, world.master_port))
        sock.listen(max(128, world.world_size))
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(
            world.master_addr,
            world.master_port,
            world.world_size,
            True,
            timeout=timeout,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


__all__ = ["is_loopback", "loopback_store"]
