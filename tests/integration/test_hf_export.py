"""``hetseq-hpc export`` of ``task=hf`` runs through the real CLI: a directory transformers
loads back. Tiny models made here with ``save_pretrained`` (nothing downloaded).

GPT-2 (tied ``lm_head``/``wte``), Llama (untied, rotary) and a BERT classifier, each trained 2
steps on 2 ranks under DDP and under FSDP, then exported: ``AutoModelFor*.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load the directory with no missing, unexpected or
mismatched keys and without remote code; its logits on a fixed batch equal those of the run's
final checkpoint loaded into the task's own model (fp32, <= 1e-6), its validation loss is the
run's last ``val_loss``, and its weights are the trained ones, not the model directory's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetseq_hpc.config import load_run_config
from hetseq_hpc.tasks import build_task
from hetseq_hpc.tasks.hf.model import SummedLossModel
from hetseq_hpc.train.checkpoint.manager import load_checkpoint
from hetseq_hpc.train.checkpoint.shards import full_state, shard_dir_of
from tests.helpers.hf_models import make_bert, make_gpt2, make_llama, write_text_files
from tests.helpers.runs import assert_ok, hetseq

pytestmark = pytest.mark.slow

TRAIN = [
    "task=hf",
    "cluster.ranks=2",
    "balance.allocation=[5,3]",
    "trainer.global_batch_size=8",
    "trainer.max_steps=2",
    "trainer.seed=7",
    "trainer.val_every=0",  # validates at the last step: summary.json's val_loss
    "task.model.dropout=0.0",
    "task.model.max_seq_len=16",
    "optim.lr=1e-2",
    "trainer.plot=false",
]
MODES = {"ddp": "sharding.mode=none", "fsdp": "sharding.mode=fsdp"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_cache):
    """``trained(model, mode) -> (run dir, model dir)``: each run made once per module."""
    root = tmp_path_factory.mktemp("hf-export")
    files = write_text_files(root)
    models = {
        "gpt2": (lambda: make_gpt2(root / "gpt2"), files["txt"]),
        "llama": (lambda: make_llama(root / "llama"), files["txt"]),
        "bert_cls": (lambda: make_bert(root / "bert_cls", "classification"), files["jsonl"]),
    }
    made: dict = {}

    def _trained(model: str, mode: str):
        if (model, mode) not in made:
            directory = root / model
            if not directory.exists():
                models[model][0]()
            run = root / f"{model}-{mode}"
            overrides = [
                *TRAIN,
                MODES[mode],
                f"task.model.path={directory}",
                f"task.data.files=[{models[model][1]}]",
                f"hydra.run.dir={run}",
            ]
            assert_ok(hetseq(*overrides, token_cache=token_cache))
            made[model, mode] = (run, directory)
        return made[model, mode]

    return _trained


def _final_state(run: Path) -> dict:
    """The model state of the run's last checkpoint (an FSDP run's shards read whole)."""
    record = sorted((run / "checkpoints").glob("step_*.pt"))[-1]
    state = load_checkpoint(record)
    if "shards" in state:
        return full_state(shard_dir_of(record, state), [], optimizer=False)["model"]
    return state["model"]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("model", ["gpt2", "llama", "bert_cls"])
def test_export_loads_back_into_transformers_with_the_trained_logits(
    model, mode, trained, tmp_path, token_cache, monkeypatch
):
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    run, model_dir = trained(model, mode)
    out = tmp_path / "exported"
    proc = hetseq("export", str(run), "--out", str(out), token_cache=token_cache)
    assert_ok(proc)
    assert proc.stdout.strip().splitlines()[-1] == (
        f"exported step 2 ({run / 'checkpoints' / 'step_00000002.pt'}) to {out}"
    )
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["dtype"] == "float32"  # no remote code
    marker = json.loads((out / "hetseq_export.json").read_text())
    assert marker["step"] == 2 and marker["run_dir"] == str(run.resolve())
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp left

    auto = AutoModelForSequenceClassification if model == "bert_cls" else AutoModelForCausalLM
    exported, info = auto.from_pretrained(out, output_loading_info=True)
    assert {k: list(v) for k, v in info.items()} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    exported.eval()

    # the model as trained: the task's own model holding the run's final checkpoint
    monkeypatch.setenv("HETSEQ_CACHE", str(token_cache))
    cfg = load_run_config(run / "hetseq_config.yaml")
    task = build_task(cfg.task, cfg.trainer.seed)
    task.load()
    reference = task.build_model()
    reference.load_state_dict(_final_state(run), strict=True)
    reference.eval()
    batch = task.make_batch(list(range(8)), 0, "val")
    with torch.no_grad():
        want = reference.logits(batch["input_ids"], batch["attention_mask"])
        got = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-6
        # the run's last validation, recomputed with the exported model on every val row
        val = task.make_batch(list(range(task.num_val)), 0, "val")
        loss = SummedLossModel(exported, task.kind)(**val) / task.count(val)
    summary = json.loads((run / "summary.json").read_text())
    assert float(loss) == pytest.approx(summary["validation"]["val_loss"], rel=1e-5)

    original = auto.from_pretrained(model_dir).state_dict()
    trained_weights = exported.state_dict()
    assert any(not torch.equal(original[k], trained_weights[k]) for k in original)
    if model == "gpt2":  # tied again on loading, to the trained value
        assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    if model == "llama":
        assert not torch.equal(
            exported.get_output_embeddings().weight, exported.get_input_embeddings().weight
        )
    if model == "bert_cls":
        assert exported.config.num_labels == 2  # the data's two classes

    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "def return value of a function"
    assert tokenizer(text)["input_ids"] == task.tokenizer(text)["input_ids"]


def test_export_to_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(
    trained, tmpfs, token_cache
):
    """Real tmpfs mounts: a read-only one is refused before any checkpoint is read (exit 2);
    on a 64 KiB one the weights do not fit: one line naming the disk's answer, and the temp
    folder beside --out is removed (the mount is empty)."""
    run, _ = trained("gpt2", "ddp")
    read_only = tmpfs("1m", readonly=True)
    proc = hetseq("export", str(run), "--out", str(read_only / "hf"), token_cache=token_cache)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert line.startswith(f"hetseq-hpc: error: --out {read_only / 'hf'} cannot be created")
    assert "is not writable" in line and "in a writable place" in line, line
    full = tmpfs("64k")
    proc = hetseq("export", str(run), "--out", str(full / "hf"), token_cache=token_cache)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"hetseq-hpc: error: cannot write '{full / 'hf'}'"), line
    assert "No space left on device" in line, line
    assert list(full.iterdir()) == []
