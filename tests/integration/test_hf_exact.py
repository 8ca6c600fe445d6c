"""``task=hf`` and ``task=dataset`` through the real CLI: exact across [24, 8], fine-tuning starts
from the saved weights. Tiny models made here with ``save_pretrained`` (nothing downloaded).

For each kind (causal LM on a text file, masked LM on a text file, classification on JSON lines
with a label column, seq2seq (T5) on JSON lines of source/target pairs), dropout off
(``task.model.dropout=0.0``: the default keeps the model's own), one seed, task=hf's default
optimizer (optim=finetune) with a larger learning rate: ``cluster.ranks=1`` (32 rows per step) and
``cluster.ranks=2 balance.allocation=[24,8] balance.max_micro_batch=5`` (accumulation on both)
log the same loss at every one of 20 steps, to 1e-5 relative (``assert_same_losses``).
Classification on a Parquet file (several row groups) logs the same losses as on the same
records as JSON lines (1 rank).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers.hf_models import (
    jsonl_to_parquet,
    make_bert,
    make_gpt2,
    make_t5,
    write_text_files,
)
from tests.helpers.runs import REPO, assert_same_losses, hetseq, losses, read_rows, run_ok

pytestmark = pytest.mark.slow

STEPS = [
    "trainer.global_batch_size=32",
    "trainer.max_steps=20",
    "optim.schedule_steps=20",
    "trainer.seed=7",
    "task.model.dropout=0.0",
    "trainer.val_every=0",
    "trainer.checkpoint_every=0",
    "task.model.max_seq_len=32",
    "optim.lr=1e-3",
    "trainer.plot=false",
]
UNEVEN = ["cluster.ranks=2", "balance.allocation=[24,8]", "balance.max_micro_batch=5"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    files = write_text_files(root)
    return {
        "causal_lm": (make_gpt2(root / "gpt2"), files["txt"]),
        "masked_lm": (make_bert(root / "bert"), files["txt"]),
        "classification": (make_bert(root / "cls", "classification"), files["jsonl"]),
        "seq2seq": (make_t5(root / "t5"), files["pairs"]),
    }


@pytest.mark.parametrize("kind", ["causal_lm", "masked_lm", "classification", "seq2seq"])
def test_hf_uneven_ranks_repeat_one_rank(kind, hf_models, tmp_path, token_cache):
    """1 rank x 32 == 2 ranks x [24, 8] at every one of 20 steps; the kind, unit and metric
    reach summary.json. Classification's uneven run reads the same records from a Parquet
    file (row groups of 50 of its 400 records) instead of JSON lines: the same losses."""
    path, data = hf_models[kind]
    task = ["task=hf", f"task.model.path={path}", f"task.data.files=[{data}]"]
    ref, uneven = tmp_path / "ref", tmp_path / "uneven"
    if kind == "seq2seq":
        task.append("task.model.max_target_len=16")
    run_ok(ref, token_cache, *task, *STEPS, "cluster.ranks=1")
    if kind == "classification":
        parquet = jsonl_to_parquet(data, tmp_path / "labelled.parquet", row_group_size=50)
        task[-1] = f"task.data.files=[{parquet}]"
    run_ok(uneven, token_cache, *task, *STEPS, *UNEVEN)
    assert_same_losses(losses(ref), losses(uneven), range(1, 21))
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["task"]["name"] == "hf" and summary["task"]["data"]["kind"] == kind
    assert summary["exact"] is True
    metric = "val_accuracy" if kind == "classification" else "val_ppl"
    assert metric in read_rows(ref)[-1]
    if kind == "classification":
        on_parquet = json.loads((uneven / "summary.json").read_text())
        assert on_parquet["task"]["data"]["kind"] == kind and on_parquet["exact"] is True


def test_finetuning_starts_from_the_saved_weights(hf_models, tmp_path, token_cache):
    """Step 1's loss is the saved GPT-2's loss on the first global batch (computed here from
    the saved model directly), not a fresh init's."""
    from transformers import GPT2LMHeadModel

    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.tasks import build_task
    from hetseq_hpc.train.sampler import _permutation

    path, data = hf_models["causal_lm"]
    task_args = ["task=hf", f"task.model.path={path}", f"task.data.files=[{data}]"]
    run_ok(
        tmp_path / "run", token_cache, *task_args, *STEPS, "cluster.ranks=1", "trainer.max_steps=1"
    )
    step1 = losses(tmp_path / "run")[1]

    cfg = compose_run_config([*task_args, *STEPS, f"task.data.cache_dir={token_cache}"])
    task = build_task(cfg.task, 7)
    task.prepare()
    task.load()
    positions = _permutation(task.num_train, 7, 0)[:32]  # the first global batch
    batch = task.make_batch(positions, 0, "train")
    saved = GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        logits = saved(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        direct = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"
        ) / task.count(batch)
        torch.manual_seed(123)
        fresh = GPT2LMHeadModel(saved.config).eval()
        fresh_loss = torch.nn.functional.cross_entropy(
            fresh(input_ids=batch["input_ids"]).logits.flatten(0, 1),
            batch["labels"].flatten(),
            reduction="sum",
        ) / task.count(batch)
    assert np.isclose(step1, float(direct), rtol=1e-5), (step1, float(direct))
    assert abs(float(fresh_loss) - step1) > 1e-3


def test_dataset_adapter_is_exact_across_24_8(tmp_path, token_cache):
    """A user's Dataset of variable-length items with a custom collate_fn (fixed-width
    padding) and a loss_fn: 1 rank == 2 ranks x [24, 8] at every step."""
    steps = [s for s in STEPS if "max_seq_len" not in s and "optim" not in s]
    task = ["task=dataset", "task.target=tests.helpers.user_dataset:build", f"task.path={REPO}"]
    ref, uneven = tmp_path / "ref", tmp_path / "uneven"
    run_ok(ref, token_cache, *task, *steps, "cluster.ranks=1")
    run_ok(uneven, token_cache, *task, *steps, *UNEVEN)
    assert_same_losses(losses(ref), losses(uneven), range(1, 21))
    assert json.loads((ref / "summary.json").read_text())["task"]["name"] == "dataset"


#: case -> (model kind of hf_models, extra overrides, exit code, text of the one error line)
REFUSALS = {
    "hub": (None, [], 2, "downloads nothing"),
    "column": ("classification", ["task.data.text_field=sentence"], 1, "'sentence'"),
    "tokenizer": ("bare", [], 2, "no tokenizer"),
    "mask_token": ("causal_lm", ["task.model.kind=masked_lm"], 2, "no mask token"),
    "positions": ("causal_lm", ["task.model.max_seq_len=128"], 2, "64 positions"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_start_nothing(case, hf_models, tmp_path, token_cache):
    """A hub name, a model dir without a tokenizer, a masked LM whose tokenizer has no mask
    token, max_seq_len above the model's positions (ConfigErrors: exit 2) and a missing
    column (a DataError: exit 1): one ``error:`` line, no run directory."""
    import shutil

    model, extra, code, text = REFUSALS[case]
    data = hf_models["classification"][1]
    if model is None:
        path = "bert-base-uncased"
    elif model == "bare":
        path = tmp_path / "bare"
        path.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(hf_models["causal_lm"][0] / name, path / name)
    else:
        path = hf_models[model][0]
    task = [
        "task=hf",
        f"task.model.path={path}",
        f"task.data.files=[{data}]",
        "task.model.max_seq_len=32",
        *extra,
    ]
    proc = hetseq(*task, f"hydra.run.dir={tmp_path / 'run'}", token_cache=token_cache, timeout=120)
    assert proc.returncode == code, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], proc.stderr
    assert text in lines[0], lines[0]
    assert not (tmp_path / "run").exists()
