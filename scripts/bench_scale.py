#!/usr/bin/env python3
"""The control plane at scale, by simulation on one machine (issue 45).

* ``allocate_s``: seconds one rank takes to agree on the split of the global batch
  (:func:`hetseq_hpc.balance.agree.agree_on_allocation`: every rank's report read, the
  cost-curve split computed, its digest) for synthetic rank reports of 1,024 / 4,096 / 8,192
  ranks, the slower of two worlds (four device kinds with a 5 % spread; identical ranks), best of
  ``--repeats``. Every rank runs it at start-up, on every re-balance and on every re-form.
* ``reform_s``: seconds from the moment a lost rank's survivors start re-forming
  (:func:`hetseq_hpc.distributed.membership.reform`) until the last of them has the new
  world, keyed by member count. The job's store is a real store server process
  (``python -m hetseq_hpc.distributed.store_server``); every member is a thread with its own
  store client and its own :class:`~hetseq_hpc.distributed.membership.Heartbeat` (as a rank
  has), all beating for a while before the last member is lost (its heartbeat stops and the
  launcher's "gone" key is set). A member count that does not re-form within
  ``--reform-timeout`` seconds is ``null``.

Prints the machine first (``lscpu`` model, cores); the last line is one JSON object.

    python scripts/bench_scale.py [--ranks 1024 4096 8192] [--members 64 256 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetseq_hpc.balance.agree import RankReport, agree_on_allocation
from hetseq_hpc.distributed.membership import (
    HEARTBEAT_S,
    TOKEN_ENV,
    Heartbeat,
    Membership,
    announce_recovery,
    job_store,
    job_token,
    reform,
)
from tests.helpers.reports import rank_report

#: samples per rank in the synthetic global batch, plus half a sample per rank left over
PER_RANK = 32


def machine() -> str:
    """``lscpu``'s model name and this machine's core count, in one line."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line),
            platform.processor() or "unknown",
        )
    except (OSError, subprocess.SubprocessError):
        model = platform.processor() or "unknown"
    return f"{model}, {os.cpu_count()} cores ({platform.python_implementation()} {platform.python_version()})"


def synthetic_reports(n: int, kind: str, seed: int = 45) -> List[RankReport]:
    """``n`` start-up reports: four device kinds with a 5 % spread (``mixed``), or identical."""
    rng = random.Random(seed)
    kinds = [(0.004, 0.0008, 0.02, 64), (0.006, 0.0015, 0.02, 48), (0.01, 0.003, 0.03, 32)]
    kinds.append((0.02, 0.006, 0.05, 16))
    reports = []
    for i in range(n):
        a, c, f, cap = kinds[0] if kind == "identical" else kinds[i % len(kinds)]
        if kind != "identical":
            a, c = a * rng.uniform(0.95, 1.05), c * rng.uniform(0.95, 1.05)
        report = rank_report(
            i,
            n,
            samples_per_s=cap / (a + c * cap),
            overhead_s=a,
            per_sample_s=c,
            max_micro_batch=cap,
            static_bytes=float(1 << 30),
            activation_bytes_per_sample=float(1 << 20),
            memory_budget_bytes=float(16 << 30),
            kind="cuda",
        )
        calibration = dataclasses.replace(report.calibration, step_fixed_s=f)
        reports.append(dataclasses.replace(report, calibration=calibration))
    return reports


class _Agreement:
    """A rendezvous stand-in for one rank: the digest check of its own result (what the
    all-gather of digests compares; the all-gather itself is the network's)."""

    def check_agreement(self, digest: str, what: str) -> None:
        self.digest = digest


def allocate_seconds(n: int, repeats: int) -> Dict[str, float]:
    """Best-of-``repeats`` seconds of :func:`agree_on_allocation` per world kind at ``n`` ranks."""
    out = {}
    for kind in ("mixed", "identical"):
        reports = synthetic_reports(n, kind)
        run = SimpleNamespace(
            sharding=SimpleNamespace(mode="none"),
            trainer=SimpleNamespace(global_batch_size=PER_RANK * n + n // 2),
            balance=SimpleNamespace(allocation=None),
            cluster=SimpleNamespace(memory_budgets_gb=None, device_kinds=lambda: None),
        )
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            agree_on_allocation(run, reports, _Agreement())
            best = min(best, time.perf_counter() - started)
        out[kind] = best
    return out


def _serve_store(token: str, folder: Path) -> tuple:
    """A store server process on 127.0.0.1; returns ``(process, environ of its clients)``."""
    address = folder / "store.address"
    env = {**os.environ, TOKEN_ENV: token}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "hetseq_hpc.distributed.store_server"),
            *("--host", "127.0.0.1", "--address-file", str(address)),
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not address.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("bench_scale: the store server did not start")
        time.sleep(0.05)
    return proc, {"HETSEQ_STORE": address.read_text().strip(), TOKEN_ENV: token}


def reform_seconds(members: int, timeout_s: float, settle_s: float) -> Optional[float]:
    """Seconds for ``members - 1`` survivors to re-form after the last member is lost (None:
    not within ``timeout_s``)."""
    with tempfile.TemporaryDirectory(prefix="hetseq-bench-scale-") as tmp:
        proc, environ = _serve_store(job_token(), Path(tmp))
        beats: List[Heartbeat] = []
        try:
            stores = [job_store(timeout_s, environ) for _ in range(members)]
            beats = [Heartbeat(stores[m], m, watch=range(members)) for m in range(members)]
            time.sleep(settle_s)  # every member beating, every watcher following the others
            old, lost = Membership(0, tuple(range(members))), members - 1
            beats[lost].close()
            stores[lost].set(f"gone/{lost}", "-9")  # the launcher saw its process end
            done: Dict[int, float] = {}
            failed: List[str] = []
            start = threading.Barrier(members - 1)
            began = [0.0]

            def survivor(m: int) -> None:
                try:
                    announce_recovery(stores[m], old, m)
                    if start.wait() == 0:
                        began[0] = time.monotonic()
                    new = reform(stores[m], beats[m], m, old, stale_s=30.0, timeout_s=timeout_s)
                    if new.members != old.members[:-1]:
                        failed.append(f"member {m} got {new.members[:4]}...")
                    done[m] = time.monotonic()
                except Exception as exc:  # reported below: the figure is then null
                    failed.append(f"member {m}: {type(exc).__name__}: {exc}"[:200])

            threads = [
                threading.Thread(target=survivor, args=(m,), daemon=True)
                for m in range(members - 1)
            ]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + timeout_s + 30
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if failed or len(done) != members - 1:
                print(
                    f"  {members} members: {len(done)} of {members - 1} re-formed"
                    + (f" ({failed[0]})" if failed else ""),
                    flush=True,
                )
                return None
            return max(done.values()) - began[0]
        finally:
            for beat in beats:
                beat.close()
            proc.terminate()
            proc.wait(30)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark; print the machine, a line per figure, and the JSON last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[1024, 4096, 8192])
    parser.add_argument("--members", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reform-timeout", type=float, default=120.0)
    parser.add_argument(
        "--settle", type=float, default=4 * HEARTBEAT_S, help="seconds of beating before the fault"
    )
    args = parser.parse_args(argv)
    print(f"machine: {machine()}", flush=True)
    print(f"date: {time.strftime('%Y-%m-%d')}", flush=True)
    allocate, detail = {}, {}
    for n in args.ranks:
        kinds = allocate_seconds(n, args.repeats)
        allocate[str(n)], detail[str(n)] = max(kinds.values()), kinds
        print(f"allocate {n} ranks: {kinds}", flush=True)
    reformed = {}
    for m in args.members:
        started = time.monotonic()
        reformed[str(m)] = reform_seconds(m, args.reform_timeout, args.settle)
        print(
            f"re-form {m} members: {reformed[str(m)]} s (set-up and tear-down included: "
            f"{time.monotonic() - started:.1f} s)",
            flush=True,
        )
    result = {
        "machine": machine(),
        "allocate_s": allocate,
        "allocate_by_world_s": detail,
        "reform_s": reformed,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
