"""The job's store at scale, simulated (issue 45): ``scripts/bench_scale.py`` serves a real
store server process and re-forms a world of 128 members (threads, each with its own store
client and heartbeat) after the last one is lost; every survivor gets the same new world. The
split of 64 synthetic ranks runs too (the reports' shape changed once without the script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_128_members_re_form_over_a_real_store_server():
    proc = subprocess.run(
        [
            *(sys.executable, str(REPO / "scripts" / "bench_scale.py")),
            *("--ranks", "64", "--members", "128", "--reform-timeout", "120"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ")
    result = json.loads(lines[-1])
    assert isinstance(result["allocate_s"]["64"], float)  # the split's synthetic reports
    assert isinstance(result["reform_s"]["128"], float), proc.stdout[-2000:]
