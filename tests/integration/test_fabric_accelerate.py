"""Fabric and accelerate loops with uneven exact batches, in real runs on the CPU (gloo).

``examples/fabric_mlp.py`` (Fabric's own launcher starts the ranks) and
``examples/accelerate_mlp.py`` (under torchrun) train the same LayerNorm MLP with a MEAN loss
and AdamW as the Lightning tests, 12 steps over two epoch boundaries; 2 ranks [24, 8] with
accumulation counts 3 and 1 must give the 1-rank losses to 1e-6 (relative, fp32).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.optional import import_or_skip
from tests.helpers.runs import REPO
from tests.helpers.shared import built_once

import_or_skip("lightning", "lightning")

pytestmark = pytest.mark.slow

SPLIT = ["--allocation", "24,8", "--max-micro-batch", "8"]


def _run(cmd, out):
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The 1-device Fabric run both loops must repeat (made once, shared by the xdist
    workers)."""
    cmd = [sys.executable, "examples/fabric_mlp.py", "--devices", "1", "--max-micro-batch", "8"]
    done = built_once(tmp_path_factory, "fabric-one", lambda root: _run(cmd, root / "one.json"))
    return json.loads((done / "one.json").read_text())


def _worst(run: dict, ref: dict) -> float:
    assert sorted(run["losses"]) == sorted(ref["losses"]) and len(ref["losses"]) == 12
    return max(abs(run["losses"][k] - v) / abs(v) for k, v in ref["losses"].items())


def test_a_fabric_loop_on_an_uneven_split_matches_one_rank(one_rank, tmp_path):
    two = _run(
        [sys.executable, "examples/fabric_mlp.py", "--devices", "2", *SPLIT], tmp_path / "two.json"
    )
    assert two["world"] == 2
    assert _worst(two, one_rank) < 1e-6


def test_an_accelerate_loop_under_torchrun_matches_one_rank(one_rank, tmp_path):
    import_or_skip("accelerate", "accelerate")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = _run([*cmd, "examples/accelerate_mlp.py", *SPLIT], tmp_path / "two.json")
    assert two["world"] == 2
    assert _worst(two, one_rank) < 1e-6  # the same model, data and seed as the Fabric run
