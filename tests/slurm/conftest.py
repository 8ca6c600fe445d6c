"""The tests here need the real Slurm test cluster (scripts/test-cluster.sh, started by
scripts/run-tests.sh); each skips, with the reason, when it is not up."""

from __future__ import annotations

import pytest

from tests.helpers.slurm import slurm_unavailable


@pytest.fixture(scope="session", autouse=True)
def needs_slurm():
    """Skip every test of this folder when the test cluster is not up (asked once)."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
