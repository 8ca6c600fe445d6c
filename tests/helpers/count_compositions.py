"""``python -m tests.helpers.count_compositions ARGS``: ``hetseq-hpc ARGS`` with every
composition Hydra's config loader makes recorded (``ConfigLoaderImpl.load_configuration``:
the one place where Hydra composes, whoever asks) as JSON lines in ``$HETSEQ_TEST_COMPOSITIONS``:
``{"mode": "RUN" | "MULTIRUN", "overrides": [...]}``. Nothing else changes."""

from __future__ import annotations

import json
import os
import sys

from hydra._internal.config_loader_impl import ConfigLoaderImpl

from hetseq_hpc.cli import main

_load = ConfigLoaderImpl.load_configuration


def _recorded(self, config_name, overrides, run_mode, *args, **kwargs):
    with open(os.environ["HETSEQ_TEST_COMPOSITIONS"], "a") as out:
        out.write(json.dumps({"mode": run_mode.name, "overrides": list(overrides)}) + "\n")
    return _load(self, config_name, overrides, run_mode, *args, **kwargs)


if __name__ == "__main__":
    ConfigLoaderImpl.load_configuration = _recorded
    sys.argv[0] = "hetseq-hpc"
    main()
