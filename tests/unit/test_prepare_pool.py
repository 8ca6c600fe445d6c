"""The prepare worker pool of ``task=hf``: spawned workers give the same cache, byte for byte,
as one process; they import no torch even when the parent is a torch-importing ``-m`` module
(a rank of a training job); small inputs and ``HETSEQ_PREPARE_WORKERS`` pick the count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

#: transformers and datasets are imported by the module's first test, on the one worker this
#: group runs on, not while every worker collects the suite
pytestmark = pytest.mark.xdist_group("hf")


@pytest.fixture(scope="module", autouse=True)
def _needs_tokenizers():
    """Skips the test where tokenizers or transformers is not installed."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")


from hetseq_hpc.errors import ConfigError, DataError  # noqa: E402
from hetseq_hpc.tokenizing import pool  # noqa: E402


def test_worker_count_default_threshold_and_override(monkeypatch):
    monkeypatch.delenv("HETSEQ_PREPARE_WORKERS", raising=False)
    monkeypatch.setattr(pool, "available_cores", lambda: 16)
    assert pool.prepare_workers(pool.PARALLEL_MIN_BYTES - 1) == 1
    assert pool.prepare_workers(pool.PARALLEL_MIN_BYTES) == pool.MAX_WORKERS == 8
    monkeypatch.setattr(pool, "available_cores", lambda: 2)
    assert pool.prepare_workers(10**9) == 2
    monkeypatch.setenv("HETSEQ_PREPARE_WORKERS", "1")
    assert pool.prepare_workers(10**9) == 1
    monkeypatch.setenv("HETSEQ_PREPARE_WORKERS", "3")
    assert pool.prepare_workers(10) == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("HETSEQ_PREPARE_WORKERS", bad)
        with pytest.raises(ConfigError, match="HETSEQ_PREPARE_WORKERS") as info:
            pool.prepare_workers(10**9)
        assert "\n" not in str(info.value)


def test_a_dead_worker_is_an_error_not_a_hang(monkeypatch):
    # a pool replaces a killed worker but never finishes the batch it held: waiting on that
    # batch must raise, not hang
    class Lost:
        waits = 0

        def ready(self):
            return False

        def wait(self, timeout):
            Lost.waits += 1

    monkeypatch.setattr(pool, "_POLL_S", 0.01)
    alive, killed = SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=-9)
    with pytest.raises(DataError, match=r"prepare worker process died \(exit code -9") as info:
        pool._result(Lost(), [alive, killed])
    assert "\n" not in str(info.value) and Lost.waits == 1
