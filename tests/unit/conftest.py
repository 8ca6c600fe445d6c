"""Fixtures of the in-process tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run on one intra-op thread (two threads spin in OpenMP on a shared, busy CPU
    and make each step ~100x slower); a module uses it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
