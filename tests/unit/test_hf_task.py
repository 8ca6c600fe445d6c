"""``task=hf`` and ``task=dataset`` in-process: the one-line refusals (hub name, ``.bin``-only
model, missing/empty file, missing column, ``datasets`` not installed), the summed loss,
dropout wiring, row-wise batches, random init from a config, FSDP units, and the Dataset
adapter. Tiny models made here."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from hetseq_hpc.cli.preflight import check_task_code
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError, DataError, HetseqError
from hetseq_hpc.tasks import build_task
from tests.helpers.hf_models import make_bert, make_gpt2, make_t5, write_text_files


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfu")
    files = write_text_files(root)
    return {
        "root": root,
        **files,
        "gpt2": make_gpt2(root / "gpt2"),
        "bert": make_bert(root / "bert"),
        "cls": make_bert(root / "cls", "classification"),
        "t5": make_t5(root / "t5"),
    }


def compose(*overrides: str):
    run = compose_run_config(["task=hf", *overrides])
    check_task_code(run)
    return run


def one_line_error(exc_type, *overrides: str) -> str:
    with pytest.raises(exc_type) as info:
        compose(*overrides)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def task_of(made, model: str, data: str, *extra: str):
    run = compose(
        f"task.model.path={made[model]}",
        f"task.data.files=[{made[data]}]",
        f"task.data.cache_dir={made['root'] / 'cache'}",
        "task.model.max_seq_len=32",
        "task.model.dropout=0.0",
        *extra,
    )
    task = build_task(run.task, 3)
    task.prepare()
    task.load()
    return task


def test_hub_name_is_refused_in_one_line_saying_nothing_is_downloaded(made):
    msg = one_line_error(
        ConfigError, "task.model.path=openai-community/gpt2", f"task.data.files=[{made['txt']}]"
    )
    assert "downloads nothing" in msg and "local directory" in msg
    # issue 40: the installed huggingface_hub has `hf download`, not `huggingface-cli`
    assert "hf download openai-community/gpt2 --local-dir DIR" in msg
    assert "huggingface-cli" not in msg


def test_bin_only_model_dir_is_refused(made, tmp_path):
    model = tmp_path / "binonly"
    model.mkdir()
    shutil.copy(made["gpt2"] / "config.json", model / "config.json")
    (model / "pytorch_model.bin").write_bytes(b"\0")
    msg = one_line_error(
        ConfigError, f"task.model.path={model}", f"task.data.files=[{made['txt']}]"
    )
    assert "pytorch_model.bin" in msg and "safetensors" in msg


def test_missing_and_empty_files_are_refused(made, tmp_path):
    msg = one_line_error(
        ConfigError, f"task.model.path={made['gpt2']}", f"task.data.files=[{tmp_path / 'nope.txt'}]"
    )
    assert "does not exist" in msg
    (tmp_path / "empty.jsonl").write_text("")
    msg = one_line_error(
        ConfigError,
        f"task.model.path={made['gpt2']}",
        f"task.data.files=[{tmp_path / 'empty.jsonl'}]",
    )
    assert "is empty" in msg


def test_missing_column_names_the_columns_found(made, tmp_path):
    msg = one_line_error(
        DataError,
        f"task.model.path={made['cls']}",
        "task.model.max_seq_len=32",
        f"task.data.files=[{made['jsonl']}]",
        "task.data.label_field=stars",
    )
    assert "'stars'" in msg and "'text', 'label'" in msg
    csv = tmp_path / "d.csv"
    csv.write_text("sentence,label\nhello,1\n")
    msg = one_line_error(
        DataError,
        f"task.model.path={made['cls']}",
        f"task.data.files=[{csv}]",
        "task.model.max_seq_len=32",
    )
    assert "no column 'text'" in msg and "'sentence'" in msg


def test_without_datasets_the_pre_start_check_says_how_to_install_it(made, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a)
    )
    msg = one_line_error(
        ConfigError, f"task.model.path={made['gpt2']}", f"task.data.files=[{made['txt']}]"
    )
    assert "datasets" in msg and "pip install 'hetseq-hpc[hf]'" in msg


def test_causal_lm_batch_is_row_wise_and_the_loss_a_sum(made):
    task = task_of(made, "gpt2", "txt")
    assert task.kind == "causal_lm" and task.unit_name == "predicted tokens"
    full = task.make_batch([5, 1, 9, 2], 0, "train")
    half = task.make_batch([9, 2], 0, "train")
    for key in full:
        assert torch.equal(full[key][2:], half[key])
    assert torch.equal(full["labels"][:, :-1], full["input_ids"][:, 1:])
    assert task.count(full) == 4 * 31
    torch.manual_seed(0)
    model = task.build_model().eval()
    with torch.no_grad():
        total = model(**full)
        parts = model(**task.make_batch([5, 1], 0, "train")) + model(**half)
        mean = model.model(input_ids=full["input_ids"], labels=full["input_ids"]).loss
    assert torch.allclose(total, parts, rtol=1e-5)
    assert torch.allclose(total / task.count(full), mean, rtol=1e-5)  # the model's mean x count
    assert [type(u).__name__ for u in task.sharding_units(model)] == ["GPT2Block"] * 2


def test_masked_lm_masking_is_deterministic_and_spares_special_tokens(made):
    task = task_of(made, "bert", "txt")
    a = task.make_batch([0, 7], 2, "train")
    b = task.make_batch([7], 2, "train")
    assert torch.equal(a["input_ids"][1:], b["input_ids"]) and torch.equal(
        a["labels"][1:], b["labels"]
    )
    assert not torch.equal(a["labels"], task.make_batch([0, 7], 3, "train")["labels"])
    tok = task.tokenizer
    assert (a["input_ids"][:, 0] == tok.cls_token_id).all()  # rows framed [CLS] .. [SEP]
    assert (a["labels"][:, 0] == -100).all() and (a["labels"][:, -1] == -100).all()
    torch.manual_seed(0)
    units = task.sharding_units(task.build_model())
    assert [type(u).__name__ for u in units] == ["BertLayer", "BertLayer"]  # embeddings tied


def test_classification_reads_json_lines_labels_and_pads(made):
    task = task_of(made, "cls", "jsonl")
    assert task.kind == "classification" and task.num_labels == 2
    batch = task.make_batch(list(range(6)), 0, "train")
    assert batch["labels"].shape == (6,) and task.count(batch) == 6
    assert batch["input_ids"].shape == (6, 32)
    assert ((batch["attention_mask"] == 0) <= (batch["input_ids"] == tok_pad(task))).all()
    torch.manual_seed(0)
    model = task.build_model()
    loss = model(**batch)
    assert loss.ndim == 0 and loss.item() > 0
    stats = task.evaluate_batch(model.eval(), task.make_batch([0, 1], 0, "val"), [0, 1])
    assert 0 <= task.finalize_metrics(stats)["val_accuracy"] <= 1


def tok_pad(task):
    return task.tokenizer.pad_token_id


def test_dropout_is_wired_into_the_config_and_random_init_from_config(made, tmp_path):
    run = compose(
        f"task.model.config={made['gpt2'] / 'config.json'}",
        f"task.model.tokenizer={made['gpt2']}",
        f"task.data.files=[{made['txt']}]",
        f"task.data.cache_dir={tmp_path}",
        "task.model.max_seq_len=32",
        "task.model.dropout=0.25",
        "task.model.kind=causal_lm",
    )
    task = build_task(run.task, 0)
    assert {task.config.resid_pdrop, task.config.embd_pdrop, task.config.attn_pdrop} == {0.25}
    task.prepare()
    task.load()
    torch.manual_seed(1)  # the saved model was made under seed 0
    fresh = task.build_model()
    from safetensors.torch import load_file

    saved = load_file(str(made["gpt2"] / "model.safetensors"))
    key = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(fresh.model.state_dict()[key], saved[key])  # random init
    drops = [m.p for m in fresh.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and set(drops) == {0.25}


def test_string_labels_from_csv_are_sorted_into_ids(made, tmp_path):
    csv = tmp_path / "s.csv"
    rows = "".join(
        f'"{t}",{"pos" if i % 3 else "neg"}\n'
        for i, t in enumerate(
            json.loads(line)["text"].replace('"', "'")
            for line in made["jsonl"].read_text().splitlines()[:60]
        )
    )
    csv.write_text("text,label\n" + rows)
    run = compose(
        f"task.model.path={made['cls']}",
        f"task.data.files=[{csv}]",
        f"task.data.cache_dir={tmp_path}",
        "task.model.max_seq_len=16",
    )
    task = build_task(run.task, 0)
    task.prepare()
    task.load()
    assert task.meta["label_names"] == ["neg", "pos"]
    assert set(np.unique(task._arrays["labels"])) == {0, 1}


def test_mixed_type_json_labels_are_refused_in_one_line_or_kept_apart(made, tmp_path):
    """JSON labels are read with their JSON types (the reader no longer converts a later
    ``true`` or ``"1"`` to the first chunk's integers), so the label mapping compares class
    NAMES: ``true`` beside integers, or ``1.0`` beside ``1``, was a KeyError traceback in
    prepare (``True == 1`` merged them in a set); now one line asks for one type. A digit
    string beside integers is the same class, as in CSV."""
    from hetseq_hpc.errors import DataError

    texts = [json.loads(line)["text"] for line in made["jsonl"].read_text().splitlines()[:40]]

    def prepare(labels, name):
        data = tmp_path / f"{name}.jsonl"
        data.write_text(
            "".join(
                json.dumps({"text": t, "label": labels[i % len(labels)]}) + "\n"
                for i, t in enumerate(texts)
            )
        )
        run = compose(
            f"task.model.path={made['cls']}",
            f"task.data.files=[{data}]",
            f"task.data.cache_dir={tmp_path / name}",
            "task.model.max_seq_len=16",
        )
        task = build_task(run.task, 0)
        task.prepare()
        task.load()
        return task

    for labels, words in (
        ([0, 1, True], "mixes boolean and integer labels (e.g. True and 0)"),
        ([1, 0, 1.0], "mixes integer and float labels (e.g. 1 and 1.0)"),
    ):
        with pytest.raises(DataError, match=re.escape(words)) as info:
            prepare(labels, f"bad{len(words)}")
        assert "\n" not in str(info.value)
    task = prepare([0, 1, "1", 2], "digits")
    assert task.meta["label_names"] == ["0", "1", "2"]
    assert list(task._arrays["labels"][:4]) == [0, 1, 1, 2]


def test_dataset_adapter_rows_counts_and_name(tmp_path):
    from hetseq_hpc.tasks.dataset_task import dataset_task_class
    from tests.helpers.user_dataset import build

    run = compose_run_config(["task=dataset", "task.target=tests.helpers.user_dataset:build"])
    task = build_task(run.task, 0)
    task.load()
    assert (task.num_train, task.num_val) == (400, 40)
    full = task.make_batch([3, 8, 1], 0, "train")
    assert torch.equal(full["ids"][1:], task.make_batch([8, 1], 0, "train")["ids"])
    assert task.count(full) == int((full["tags"] != -100).sum())
    torch.manual_seed(0)
    model = task.build_model()
    assert model(**full).ndim == 0
    cls = dataset_task_class(build, name="tagger")
    other = cls(run.task, 0)
    other.load()
    assert other.name == "tagger" and other.num_train == 400


def test_dataset_target_that_does_not_import_is_one_line():
    run = compose_run_config(["task=dataset", "task.target=no_such_module_xyz:build"])
    with pytest.raises(HetseqError) as info:
        check_task_code(run)
    assert "no_such_module_xyz" in str(info.value) and "\n" not in str(info.value)


def test_custom_task_name_attribute_reaches_the_summary():
    from types import SimpleNamespace

    from hetseq_hpc.train.task_summary import task_name

    class Mine:
        name = "regression"

    class Plain:
        name = "task"

    run = SimpleNamespace(task=SimpleNamespace(name="custom"))
    assert task_name(run, Mine()) == "regression" and task_name(run, Plain()) == "custom"
    assert task_name(SimpleNamespace(task=SimpleNamespace(name="bert")), Mine()) == "bert"


def test_a_bf16_checkpoint_loads_as_fp32_parameters(made, tmp_path):
    """transformers 5 loads dtype="auto" by default (a bf16 checkpoint -> bf16 weights); the
    task asks for fp32 (weights, gradients and optimizer state stay fp32; ranks autocast)."""
    from transformers import AutoModelForCausalLM

    path = make_gpt2(tmp_path / "bf16", dtype=torch.bfloat16)
    assert {p.dtype for p in AutoModelForCausalLM.from_pretrained(path).parameters()} == {
        torch.bfloat16
    }  # what the library's default would train
    run = compose(
        f"task.model.path={path}",
        f"task.data.files=[{made['txt']}]",
        f"task.data.cache_dir={tmp_path}",
        "task.model.max_seq_len=32",
    )
    task = build_task(run.task, 0)
    task.prepare()
    task.load()
    assert {p.dtype for p in task.build_model().parameters()} == {torch.float32}
    fresh = compose(
        f"task.model.config={path / 'config.json'}",
        f"task.model.tokenizer={path}",
        f"task.data.files=[{made['txt']}]",
        f"task.data.cache_dir={tmp_path}",
        "task.model.max_seq_len=32",
    )
    task = build_task(fresh.task, 0)
    task.prepare()
    task.load()
    assert {p.dtype for p in task.build_model().parameters()} == {torch.float32}


def test_classification_validates_in_one_forward_pass(made):
    task = task_of(made, "cls", "jsonl")
    assert task.evaluates_in_fixed_passes()
    torch.manual_seed(0)
    model = task.build_model().eval()
    calls = []
    model.model.register_forward_hook(lambda *a: calls.append(1))
    batch = task.make_batch([0, 1, 2], 0, "val")
    stats = task.evaluate_batch(model, batch, [0, 1, 2])
    assert len(calls) == 1
    with torch.no_grad():
        assert np.isclose(stats["loss_sum"], float(model(**batch)), rtol=1e-6)
    assert 0 <= stats["correct"] <= 3


def test_dropout_default_keeps_the_models_values_and_a_number_sets_all(made, tmp_path):
    from transformers import AutoConfig

    from hetseq_hpc.tasks.hf.model import dropout_attributes, set_dropout

    saved = tmp_path / "gpt2"
    shutil.copytree(made["gpt2"], saved)
    config = json.loads((saved / "config.json").read_text())
    config.update(attn_pdrop=0.0, resid_pdrop=0.05)
    (saved / "config.json").write_text(json.dumps(config))
    run = compose(
        f"task.model.path={saved}",
        f"task.data.files=[{made['txt']}]",
        f"task.data.cache_dir={tmp_path}",
        "task.model.max_seq_len=32",
    )
    assert run.task.model.dropout is None
    task = build_task(run.task, 0)
    assert (task.config.attn_pdrop, task.config.resid_pdrop, task.config.embd_pdrop) == (
        0.0,
        0.05,
        0.1,
    )  # the model's own values
    llama = AutoConfig.for_model("llama", attention_dropout=0.0)
    assert set_dropout(llama, None) == [] and llama.attention_dropout == 0.0
    for model_type, names in [
        ("gpt_neo", {"resid_dropout", "embed_dropout", "attention_dropout"}),
        ("deberta", {"pooler_dropout", "hidden_dropout_prob"}),
        ("t5", {"dropout_rate"}),
        ("llama", {"attention_dropout"}),
        ("bart", {"dropout", "activation_dropout", "attention_dropout"}),
    ]:
        cfg = AutoConfig.for_model(model_type)
        assert names <= set(set_dropout(cfg, 0.3)), model_type
        assert {getattr(cfg, n) for n in dropout_attributes(cfg)} == {0.3}, model_type


def test_task_hf_defaults_to_the_finetune_optimizer_unless_optim_is_given(made):
    data = [
        f"task.model.path={made['gpt2']}",
        f"task.data.files=[{made['txt']}]",
        "task.model.max_seq_len=32",
    ]
    finetune = compose_run_config(["optim=finetune"]).optim
    hf = compose(*data).optim
    assert (hf.lr, hf.warmup_steps, hf.weight_decay) == (
        finetune.lr,
        finetune.warmup_steps,
        finetune.weight_decay,
    ) and hf.lr == 5e-5
    adamw = compose_run_config(["optim=adamw"]).optim
    assert compose(*data, "optim=adamw").optim.lr == adamw.lr != 5e-5
    assert compose(*data, "optim.lr=1e-4").optim.lr == 1e-4
    assert compose_run_config(["task=bert"]).optim.lr == adamw.lr


def test_pre_start_check_refuses_tokenizer_mask_and_positions(made, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(made["gpt2"] / name, bare / name)
    data = f"task.data.files=[{made['txt']}]"
    assert "no tokenizer" in one_line_error(ConfigError, f"task.model.path={bare}", data)
    msg = one_line_error(
        ConfigError, f"task.model.path={made['gpt2']}", data, "task.model.kind=masked_lm"
    )
    assert "no mask token" in msg
    msg = one_line_error(
        ConfigError, f"task.model.path={made['gpt2']}", data, "task.model.max_seq_len=128"
    )
    assert "max_seq_len=128" in msg and "64 positions" in msg


def test_seq2seq_batch_shifts_the_labels_and_the_loss_is_a_sum(made):
    task = task_of(made, "t5", "pairs", "task.model.max_target_len=16")
    assert task.kind == "seq2seq" and task.unit_name == "target tokens"
    full = task.make_batch([4, 0, 7], 0, "train")
    part = task.make_batch([0, 7], 0, "train")
    for key in full:
        assert torch.equal(full[key][1:], part[key])
    labels, dec = full["labels"], full["decoder_input_ids"]
    assert labels.shape == dec.shape == (3, 16) and full["input_ids"].shape == (3, 32)
    assert (dec[:, 0] == task.config.decoder_start_token_id).all()
    assert torch.equal(
        dec[:, 1:], labels[:, :-1].masked_fill(labels[:, :-1] == -100, task.config.pad_token_id)
    )
    eos = task.tokenizer.eos_token_id
    assert all(int(row[row != -100][-1]) == eos for row in labels)  # short targets end in </s>
    assert task.count(full) == int((labels != -100).sum())
    torch.manual_seed(0)
    model = task.build_model().eval()
    with torch.no_grad():
        total = model(**full)
        mean = model.model(
            input_ids=full["input_ids"], attention_mask=full["attention_mask"], labels=labels
        ).loss  # the model shifts the labels itself
    assert torch.allclose(total / task.count(full), mean, rtol=1e-5)
    assert [type(u).__name__ for u in task.sharding_units(model)] == ["T5Block"] * 4


def test_seq2seq_needs_its_columns(made):
    msg = one_line_error(
        DataError, f"task.model.path={made['t5']}", f"task.data.files=[{made['jsonl']}]"
    )
    assert "no column 'source'" in msg and "task.data.source_field" in msg


def test_dataset_build_without_dropout_and_unknown_args(tmp_path):
    run = compose_run_config(["task=dataset", "task.target=tests.helpers.user_dataset:build_plain"])
    check_task_code(run)
    task = build_task(run.task, 0)
    task.load()  # build() takes no arguments: no dropout passed
    assert task.num_train == 400
    run = compose_run_config(
        ["task=dataset", "task.target=tests.helpers.user_dataset:build_plain", "+task.args.n=10"]
    )
    with pytest.raises(ConfigError) as info:
        check_task_code(run)
    assert "task.args.n" in str(info.value) and "\n" not in str(info.value)
    run = compose_run_config(
        ["task=dataset", "task.target=tests.helpers.user_dataset:build", "+task.args.n=10"]
    )
    check_task_code(run)
    task = build_task(run.task, 0)
    task.load()
    assert task.num_train == 10
