"""``python -m hetseq_hpc.distributed.store_server``: the job's store for in-job recovery,
served by a Slurm batch script on the batch host before ``srun`` (so no rank holds it).

    python -m hetseq_hpc.distributed.store_server --host auto --nodes 3 --address-file FILE

listens on ONE address (torch's own ``TCPStore`` server would listen on every interface, and
has no authentication), serves the job's store there (:mod:`hetseq_hpc.distributed.auth_store`:
a client must prove it holds the token in ``$HETSEQ_JOB_TOKEN``, read from the environment,
never from the command line), writes ``host:port`` to ``--address-file`` (and/or the port to
``--port-file``; atomically) and serves until it gets SIGTERM (the batch script's exit trap) or
its parent ends. The ranks find it through ``HETSEQ_STORE=host:port``
(:func:`hetseq_hpc.distributed.membership.job_store`).

``--host auto`` (:func:`store_host`) picks an address the other nodes can reach:
``$HETSEQ_STORE_HOST`` when set (``cluster.env``), else the first address ``hostname -I``
lists (IPv4 first), which is never a loopback address. ``$(hostname)`` is not used: on
Debian-style hosts it resolves to ``127.0.1.1`` (/etc/hosts), unreachable from other nodes.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from hetseq_hpc.distributed.jobstore import TOKEN_ENV, serve_job_store
from hetseq_hpc.env.netif import is_loopback
from hetseq_hpc.errors import LaunchError
from hetseq_hpc.files.atomic import atomic_write_text

#: an address the batch host is reached at, set by the user (``cluster.env``) to override
HOST_ENV = "HETSEQ_STORE_HOST"


def host_addresses() -> List[str]:
    """This host's addresses as ``hostname -I`` lists them (all but loopback and link-local;
    empty when the command fails)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def store_host(
    nodes: int, environ: Optional[Dict[str, str]] = None, addresses: Optional[Sequence[str]] = None
) -> str:
    """The address the job's store listens on: ``$HETSEQ_STORE_HOST``, else this host's first
    non-loopback address (IPv4 before IPv6; ``addresses`` default :func:`host_addresses`), else
    ``127.0.0.1`` for a one-node job.

    Args:
        nodes: how many nodes the job spans (all het components).

    Raises:
        LaunchError: the address found is a loopback one and the job spans more than one node.
    """
    env = os.environ if environ is None else environ
    chosen = env.get(HOST_ENV, "").strip()
    if not chosen:
        usable = [
            a
            for a in (host_addresses() if addresses is None else addresses)
            if not is_loopback(a) and not _link_local(a)
        ]
        usable.sort(key=lambda a: ":" in a)  # IPv4 first, in the order listed
        chosen = usable[0] if usable else "127.0.0.1"
    if is_loopback(chosen) and nodes > 1:
        raise LaunchError(
            f"the job's store would listen on the loopback address {chosen}, "
            f"which the other {nodes - 1} node(s) cannot reach: set {HOST_ENV} "
            "(cluster.env) to an address of the batch host they reach"
        )
    return chosen


def _link_local(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_link_local
    except ValueError:
        return False


def main(argv: Optional[List[str]] = None) -> int:
    """Serve until SIGTERM or the parent's end; exit 0 (2 when no address fits, the address
    cannot be bound or ``HETSEQ_JOB_TOKEN`` is unset: one line on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m hetseq_hpc.distributed.store_server",
        description="Serve a hetseq_hpc job's store.",
    )
    parser.add_argument(
        "--host", required=True, help="the address to listen on (only it), or 'auto' (see --nodes)"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes the job spans: with --host auto, a loopback address is "
        "refused for more than one",
    )
    parser.add_argument("--port-file", help="where to write the port")
    parser.add_argument("--address-file", help="where to write host:port")
    args = parser.parse_args(argv)
    if not args.port_file and not args.address_file:
        parser.error("give --address-file or --port-file")
    parent = os.getppid()
    try:
        host = store_host(args.nodes) if args.host == "auto" else args.host
        store, port = serve_job_store(host)
    except OSError as exc:
        print(
            f"hetseq-hpc: error: cannot serve the job's store on {args.host} ({exc}): check "
            f"the host name, or set {HOST_ENV}",
            file=sys.stderr,
        )
        return 2
    except LaunchError as exc:
        print(f"hetseq-hpc: error: {exc}", file=sys.stderr)
        return 2
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    print(
        f"hetseq-hpc: the job's store listens on {where} (clients need {TOKEN_ENV})",
        file=sys.stderr,
        flush=True,
    )
    if args.port_file:
        atomic_write_text(args.port_file, f"{port}\n")
    if args.address_file:
        atomic_write_text(args.address_file, f"{where}\n")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop and os.getppid() == parent:
        time.sleep(0.5)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
