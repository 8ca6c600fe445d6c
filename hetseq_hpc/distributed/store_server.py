"""``python -m hetseq_hpc.distributed.store_server``: the job's store for in-job recovery,
served by a Slurm batch script on the batch host before ``srun`` (so no rank holds it).

    python -m hetseq_hpc.distributed.store_server --host "$(hostname)" --port-file FILE

binds a socket to ``--host``'s address only (torch's own ``TCPStore`` server would listen on
every interface), serves a ``TCPStore`` on it, writes the port to ``FILE`` (atomically) and
serves until it gets SIGTERM (the batch script's exit trap) or its parent ends. The ranks find it
through ``HETSEQ_STORE=host:port`` and use only keys under ``HETSEQ_JOB_TOKEN``
(:func:`hetseq_hpc.distributed.membership.job_store`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import List, Optional

from hetseq_hpc.distributed.membership import serve_job_store
from hetseq_hpc.files.atomic import atomic_write_text


def main(argv: Optional[List[str]] = None) -> int:
    """Serve until SIGTERM or the parent's end; exit 0 (2 when the address cannot be bound)."""
    parser = argparse.ArgumentParser(prog="python -m hetseq_hpc.distributed.store_server",
                                     description="Serve a hetseq_hpc job's store.")
    parser.add_argument("--host", required=True, help="the address to listen on (only it)")
    parser.add_argument("--port-file", required=True, help="where to write the port")
    args = parser.parse_args(argv)
    parent = os.getppid()
    try:
        store, port = serve_job_store(args.host)
    except OSError as exc:
        print(f"hetseq-hpc: error: cannot serve the job's store on {args.host} ({exc}): check "
              "the host name", file=sys.stderr)
        return 2
    atomic_write_text(args.port_file, f"{port}\n")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop and os.getppid() == parent:
        time.sleep(0.5)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
