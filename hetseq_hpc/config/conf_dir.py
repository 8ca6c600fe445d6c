"""Where the YAML config groups are, and how Hydra reads them: package data of hetseq_hpc
(``hetseq_hpc/conf/``; ``conf/`` at the top of a checkout is a link to it, for the paths the
docs name), so an installed wheel has them."""

from __future__ import annotations

from pathlib import Path

#: the YAML config groups (``config.yaml``, ``task/``, ``cluster/``, ...)
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
#: the primary config of :data:`CONF_DIR`
CONFIG_NAME = "config"
#: Hydra's behaviour version (``version_base``) of every Hydra entry
VERSION_BASE = "1.3"
