"""``task=hf`` as a real heterogeneous SLURM job on the test cluster (cluster=testcluster: a100 +
v100 partitions, 3 ranks; scripts/test-cluster.sh): a tiny GPT-2 saved with save_pretrained
(nothing downloaded) fine-tuned on a local text file; the compute nodes load the model from the
shared directory and read the token cache rank 0 prepared."""

from __future__ import annotations

import json

import pytest

from tests.helpers.hf_models import make_gpt2, write_text_files
from tests.helpers.runs import hetseq, read_rows

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_hf_causal_lm_runs_as_a_het_job(tmp_path, token_cache):
    files = write_text_files(tmp_path)
    model = make_gpt2(tmp_path / "gpt2")
    run_dir = tmp_path / "run"
    proc = hetseq(
        "cluster=testcluster",
        "cluster.wait=true",
        "task=hf",
        f"task.model.path={model}",
        f"task.data.files=[{files['txt']}]",
        "task.model.max_seq_len=32",
        "optim=finetune",
        "trainer.max_steps=6",
        "trainer.val_every=0",
        "trainer.global_batch_size=24",
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
    )
    assert proc.returncode == 0, f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["partition"] for r in rows[-1]["ranks"]] == ["a100", "v100", "v100"]
    assert "val_ppl" in rows[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["task"]["name"] == "hf" and summary["world_size"] == 3
    assert summary["task"]["data"]["kind"] == "causal_lm" and summary["exact"] is True
