"""The authenticated job store under real processes: three gloo ranks form a process group over it
(moved from tests/unit/test_auth_store.py: it starts processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from hetseq_hpc.distributed.membership import serve_job_store

TOKEN = "0123456789abcdef0123456789abcdef"


_RANK = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from hetseq_hpc.distributed.membership import job_store
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    store = job_store(60)
    dist.init_process_group("gloo", store=dist.PrefixStore("g0/pg", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.all_reduce(t, group=dist.new_group(backend="gloo"))
    print("SUM", t.item(), flush=True)
    dist.destroy_process_group()
""")


def test_a_gloo_process_group_forms_and_all_reduces_over_the_store():
    srv, port = serve_job_store("127.0.0.1", token=TOKEN)
    env = {
        **os.environ,
        "HETSEQ_STORE": f"127.0.0.1:{port}",
        "HETSEQ_JOB_TOKEN": TOKEN,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(r), "3"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(3)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        srv.close()
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all("SUM 18.0" in out for out in outs), outs  # (1+2+3) * 3 ranks
    assert all(TOKEN not in out for out in outs)
