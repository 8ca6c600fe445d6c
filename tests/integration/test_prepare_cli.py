"""`hetseq-hpc prepare` builds the BERT cache that a run then uses."""

from __future__ import annotations

import json

from tests.helpers.corpus import pydoc_text, write_corpus
from tests.helpers.runs import SMALL_MODEL, cli_env, hetseq


def test_prepare_subcommand_builds_the_cache_a_run_then_uses(tmp_path):
    path = write_corpus(tmp_path, pydoc_text())
    env = cli_env(tmp_path / "cache")
    proc = hetseq("prepare", "task=bert", f"task.data.files=[{path}]", *SMALL_MODEL, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metas = list((tmp_path / "cache").glob("*/meta.json"))
    assert len(metas) == 1 and str(metas[0].parent) in proc.stdout
    assert json.loads(metas[0].read_text())["rows"] > 10
