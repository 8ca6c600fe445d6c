"""``hetseq-hpc export`` in-process, on real checkpoints and a tiny transformers model made
here: the step exported and why (a refused newer checkpoint named in one line), ``--out``
checked before any checkpoint is read, and the rules of a ``task=hf`` directory (written
beside the target and renamed; an earlier export of the same run replaced, anything else
refused untouched). The round trip through real runs: tests/integration/test_hf_export.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hetseq_hpc.cli.export import MARKER, label_names
from hetseq_hpc.cli.parser import dispatch_command
from hetseq_hpc.config import compose_run_config, save_run_config
from hetseq_hpc.config.hf_tasks import HfModelConfig
from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.history import write_run_id
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks import build_task
from hetseq_hpc.tasks.hf.export import PretrainedExport, load_trained, transformers_state
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from tests.helpers.checkpoints import plant_corrupt, small_state
from tests.helpers.hf_models import make_bert, make_gpt2, write_text_files


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A task=hf run directory (tiny GPT-2, run id ``r1``) with the checkpoint of step 1."""
    root = tmp_path_factory.mktemp("hf-export-unit")
    files = write_text_files(root)
    run = compose_run_config(
        [
            "task=hf",
            f"task.model.path={make_gpt2(root / 'gpt2')}",
            f"task.data.files=[{files['txt']}]",
            "task.model.max_seq_len=16",
        ]
    )
    run_dir = root / "run"
    save_run_config(run, RunDir(run_dir).config)
    write_run_id(RunDir(run_dir), "r1")
    model = build_task(run.task, 0).build_model()
    torch.manual_seed(1)
    with torch.no_grad():  # "trained": not the model directory's weights
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    state = {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "run_id": "r1"}
    CheckpointManager(RunDir(run_dir), keep=5).write({**state, "step": 1}, 1)
    return run_dir, model


def export(capsys, *args: str):
    """``hetseq-hpc export ARGS`` in-process -> (exit code, stdout, stderr)."""
    code = dispatch_command(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_refused_newest_checkpoint_is_named_with_the_step_exported_instead(tmp_path, capsys):
    """Steps 1 and 2 verify, step 3 fails its checksum: step 2 is exported, and one stderr line
    names step 3, why it was refused, and the step exported; stdout says the step."""
    run = tmp_path / "run"
    for step in (1, 2):
        CheckpointManager(RunDir(run), keep=5).write(small_state(step), step)
    plant_corrupt(run, 2, 3)
    out = tmp_path / "m.safetensors"
    code, stdout, stderr = export(capsys, run, "--out", out)
    assert code == 0, stderr
    note = one_line(stderr)
    assert note.startswith("hetseq-hpc: note: ") and "step_00000003.pt" in note, note
    assert "is corrupt: its SHA-256" in note, note
    assert note.endswith(f"exported step 2 ({CheckpointManager(RunDir(run)).path(2)}) instead"), (
        note
    )
    assert stdout.strip() == f"exported step 2 ({CheckpointManager(RunDir(run)).path(2)}) to {out}"
    assert torch.equal(load_file(out)["w"], torch.full((16,), 2.0))


def test_a_newer_checkpoint_of_another_run_is_named_with_the_step_exported(tmp_path, capsys):
    """run.json names run r1; step 2 was written by run r2: step 1 is exported and the one
    note line says whose step 2 is (nothing else on stderr)."""
    run = tmp_path / "run"
    for step, owner in ((1, "r1"), (2, "r2")):
        CheckpointManager(RunDir(run), keep=5).write({**small_state(step), "run_id": owner}, step)
    write_run_id(RunDir(run), "r1")
    code, stdout, stderr = export(capsys, run, "--out", tmp_path / "m.safetensors")
    note = one_line(stderr)
    assert code == 0 and "step_00000002.pt was written by run r2" in note, note
    assert note.endswith(f"exported step 1 ({CheckpointManager(RunDir(run)).path(1)}) instead"), (
        note
    )
    assert stdout.startswith("exported step 1 ")


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_unwritable_out_is_refused_in_one_line_before_any_checkpoint_is_read(
    where, tmp_path, capsys
):
    """``--out`` under a regular file, or in /proc (refuses new files even to root): exit 2,
    one line naming --out, checked first (the run's only checkpoint is corrupt, and the
    line is about --out); nothing written."""
    run = tmp_path / "run"
    CheckpointManager(RunDir(run), keep=5).write(small_state(1), 1)
    plant_corrupt(run, 1, 2)
    CheckpointManager(RunDir(run)).path(1).unlink()  # only a corrupt checkpoint is left
    (tmp_path / "file").write_text("x")
    out = {"under_a_file": tmp_path / "file" / "m.safetensors", "proc": "/proc/m.safetensors"}
    code, _, stderr = export(capsys, run, "--out", out[where])
    line = one_line(stderr)
    assert code == 2 and line.startswith(f"hetseq-hpc: error: --out {out[where]} "), line
    assert "checkpoint" not in line and "Traceback" not in stderr, line


def test_hf_run_exports_a_directory_that_transformers_loads(hf_run, tmp_path, capsys):
    """The default for a task=hf run: RUN_DIR/hf_model, loading with no missing, unexpected
    or mismatched key into GPT-2 with its lm_head tied to the trained wte; no temp folder
    left beside it; files get the usual mode (not safetensors' 0600)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, trained = hf_run
    out = tmp_path / "hf"
    code, stdout, stderr = export(capsys, run_dir, "--out", out)
    assert code == 0 and stderr == "", stderr
    assert stdout.strip().endswith(f"to {out}")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(model.transformer.wte.weight, trained.model.transformer.wte.weight)
    assert model.lm_head.weight is model.transformer.wte.weight
    AutoTokenizer.from_pretrained(out)
    assert json.loads((out / MARKER).read_text())["run_id"] == "r1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044


def test_an_earlier_export_of_the_same_run_is_replaced_whole(hf_run, tmp_path, capsys):
    """Exporting again into the same --out replaces the earlier export (a file only the old
    one had is gone) and leaves no temp or old folder."""
    run_dir, _ = hf_run
    out = tmp_path / "hf"
    assert export(capsys, run_dir, "--out", out)[0] == 0
    (out / "stale.txt").write_text("from before")
    code, _, stderr = export(capsys, run_dir, "--out", out)
    assert code == 0, stderr
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("kind", ["user_files", "other_run", "a_file"])
def test_an_out_that_is_not_an_earlier_export_of_this_run_is_refused_untouched(
    kind, hf_run, tmp_path, capsys
):
    """A non-empty folder of the user's, an export of another run (its marker names run id
    ``r0``), or a file: exit 2, one line saying what to give, nothing changed."""
    run_dir, _ = hf_run
    out = tmp_path / "hf"
    if kind == "a_file":
        out.write_text("keep me")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    if kind == "other_run":
        marker = {"run_dir": str(run_dir.resolve()), "run_id": "r0", "step": 9}
        (out / MARKER).write_text(json.dumps(marker))
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir()) if out.is_dir() else None
    code, _, stderr = export(capsys, run_dir, "--out", out)
    line = one_line(stderr)
    assert code == 2 and line.startswith(f"hetseq-hpc: error: --out {out} "), line
    assert "give a new or empty directory" in line, line
    if kind == "a_file":
        assert out.read_text() == "keep me"
    else:
        assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_hf_run_out_ending_in_safetensors_is_one_file_with_the_wrapper_keys(
    hf_run, tmp_path, capsys
):
    """``--out x.safetensors`` on a task=hf run: the single file, keys ``model.`` + the
    transformers name (the task's state_dict), tied weights under both names."""
    run_dir, trained = hf_run
    out = tmp_path / "m.safetensors"
    assert export(capsys, run_dir, "--out", out)[0] == 0
    tensors = load_file(out)
    assert sorted(tensors) == sorted(trained.state_dict())
    assert torch.equal(tensors["model.lm_head.weight"], tensors["model.transformer.wte.weight"])


def test_weights_that_do_not_fit_are_refused_in_one_line(hf_run):
    """Not a task=hf state, a missing tensor, an unexpected one, a wrong shape, tied names
    holding different values: one CheckpointError line each, naming the key."""
    from transformers import AutoModelForCausalLM

    _, trained = hf_run
    state = transformers_state(trained.state_dict())
    model = AutoModelForCausalLM.from_config(trained.model.config)
    cases = {
        "'w'": ({"w": torch.zeros(1)}, None),
        "no 'transformer.h.0.ln_1.bias'": (
            {k: v for k, v in state.items() if k != "transformer.h.0.ln_1.bias"},
            model,
        ),
        "unexpected 'extra.weight'": ({**state, "extra.weight": torch.zeros(1)}, model),
        "size mismatch": ({**state, "transformer.ln_f.bias": torch.zeros(3)}, model),
        "tied weights": ({**state, "lm_head.weight": state["lm_head.weight"] + 1}, model),
    }
    for needle, (bad, target) in cases.items():
        with pytest.raises(CheckpointError) as info:
            if target is None:
                transformers_state(bad)
            else:
                load_trained(target, bad)
        message = str(info.value)
        assert needle in message and "\n" not in message, (needle, message)


def test_the_default_out_of_other_tasks_is_run_dir_model_safetensors(tmp_path, capsys):
    """Without --out and without a task=hf config: RUN_DIR/model.safetensors, as before."""
    run = tmp_path / "run"
    CheckpointManager(RunDir(run), keep=5).write(small_state(4), 4)
    code, stdout, _ = export(capsys, run)
    assert code == 0 and stdout.strip().endswith(f"to {run / 'model.safetensors'}")
    assert Path(run / "model.safetensors").is_file()


def test_a_task_hf_run_whose_model_directory_is_gone_is_one_line(hf_run, tmp_path, capsys):
    """The saved task.model.path no longer exists: exit 2, one line naming it, the run's
    config file and the one-file alternative; nothing written."""
    run_dir, _ = hf_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = RunDir(copy).config
    saved = config.read_text()
    model_dir = str(run_dir.parent / "gpt2")
    assert model_dir in saved
    config.write_text(saved.replace(model_dir, str(tmp_path / "gone")))
    code, _, stderr = export(capsys, copy, "--out", tmp_path / "hf")
    line = one_line(stderr)
    assert code == 2 and f"task.model.path='{tmp_path / 'gone'}'" in line, line
    assert str(config) in line and "--out FILE.safetensors" in line, line
    assert not (tmp_path / "hf").exists()


def test_a_classifier_gets_the_classes_the_run_trained(tmp_path):
    """The data's three classes (read from summary.json, as the run wrote them) replace the
    model directory's two: num_labels, id2label and label2id, as the run built its head."""
    (tmp_path / "summary.json").write_text(
        json.dumps({"task": {"data": {"labels": ["bad", "good", "ok"]}}})
    )
    model_cfg = HfModelConfig(path=str(make_bert(tmp_path / "cls", "classification")))
    export = PretrainedExport.for_run(model_cfg, lambda: label_names(RunDir(tmp_path)))
    assert export.kind == "classification" and export.config.num_labels == 3
    assert export.config.id2label == {0: "bad", 1: "good", 2: "ok"}
    assert export.config.label2id == {"bad": 0, "good": 1, "ok": 2}
