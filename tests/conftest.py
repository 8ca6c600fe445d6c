"""Fixtures every folder uses: the shared token cache and tiny real data for the task tests.

Layout: ``unit/`` (in-process: no subprocess, no second process, no Slurm), ``integration/``
(real worker processes over gloo, the CLI in a subprocess, the local launcher, faults in real
runs), ``slurm/`` (the real Slurm test cluster, marked ``slurm``), ``gpu/`` (CUDA only: skipped
without a GPU, run by ``scripts/gpu_check.sh`` on a lent one). Helpers that are not
fixtures live in ``tests/helpers/`` and are imported as ``tests.helpers.<module>``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tasks import write_task_data


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session (built by the first run)."""
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="session")
def task_data_files(tmp_path_factory) -> dict:
    """Tiny real data of the image and translation tasks (:func:`write_task_data`)."""
    return write_task_data(tmp_path_factory.mktemp("task-data"))
