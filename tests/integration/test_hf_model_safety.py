"""``task=hf`` model directories a user did not write themselves, through the real CLI: custom
code (``auto_map`` naming a ``.py`` of the directory) is never asked about and never run, even
under a terminal (a real pseudo-terminal: transformers prompts "Do you wish to run the custom
code? [y/N]" only where stdin is one), and weights symlinked to a system file are refused;
each in one line before any rank starts. Tiny models made here (nothing downloaded)."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import termios
from pathlib import Path
from typing import Tuple

import pytest

from tests.helpers.hf_models import make_gpt2, write_text_files
from tests.helpers.runs import REPO, cli_env, hetseq, hetseq_cmd

#: what the custom module writes when it is imported (it must never be)
MARKER = "custom-code-ran"
#: how long the pty run may take (it ends in the pre-flight check: seconds)
PTY_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfsafe")
    return {"root": root, **write_text_files(root), "gpt2": make_gpt2(root / "gpt2")}


def custom_code_dir(made, where: Path, in_tokenizer: bool) -> Tuple[Path, Path]:
    """A copy of the tiny GPT-2 whose config.json (or tokenizer_config.json) names custom code
    (``auto_map``) in a ``.py`` of the directory that writes a marker file when imported.
    Returns ``(directory, marker)``."""
    shutil.copytree(made["gpt2"], where)
    marker = where.parent / f"{where.name}-{MARKER}"
    module = "tokenization_evil" if in_tokenizer else "configuration_evil"
    (where / f"{module}.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from transformers import GPT2Config, PreTrainedTokenizerFast\n"
        "class EvilConfig(GPT2Config):\n    model_type = 'evilgpt'\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    name = "tokenizer_config.json" if in_tokenizer else "config.json"
    data = json.loads((where / name).read_text())
    if in_tokenizer:
        data["auto_map"] = {"AutoTokenizer": [None, f"{module}.EvilTokenizer"]}
        data["tokenizer_class"] = "EvilTokenizer"
    else:
        data["auto_map"] = {"AutoConfig": f"{module}.EvilConfig"}
        data["model_type"] = "evilgpt"
    (where / name).write_text(json.dumps(data))
    return where, marker


def run_in_pty(args, answer: bytes, cwd: Path, env) -> Tuple[int, str]:
    """Run ``args`` with stdin, stdout and stderr on a new pseudo-terminal, ``answer`` typed
    into it at once; returns ``(exit code, everything it wrote)``."""
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~termios.ECHO  # what is typed is not written back: the output is the program's
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    proc = subprocess.Popen(
        args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, close_fds=True
    )
    os.close(slave)
    if answer:
        os.write(master, answer)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], PTY_TIMEOUT_S)
            if not ready:  # hung (it waits for an answer nobody gives)
                proc.kill()
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every end of the terminal closed (the process is gone)
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    return proc.wait(timeout=60), out.decode("utf-8", "replace")


@pytest.mark.parametrize(
    "in_tokenizer, symlinked, answer",
    [
        pytest.param(False, False, b"y\n", id="config-auto_map-answer-y"),
        pytest.param(True, True, b"", id="tokenizer-auto_map-symlinked-dir-no-answer"),
    ],
)
def test_custom_code_in_a_model_dir_is_never_asked_about_nor_run_under_a_terminal(
    made, tmp_path, token_cache, in_tokenizer, symlinked, answer
):
    """Under a real terminal, answering 'y' (or nothing): no prompt, the directory's module is
    never imported (no marker), one ``hetseq-hpc: error:`` line naming ``auto_map``, exit 2,
    no rank started and no run directory made; also through a symlink to the directory."""
    model, marker = custom_code_dir(made, tmp_path / "custom", in_tokenizer)
    if symlinked:
        (tmp_path / "link").symlink_to(model, target_is_directory=True)
        model = tmp_path / "link"
    run_dir = tmp_path / "run"
    code, out = run_in_pty(
        hetseq_cmd(
            "task=hf",
            f"task.model.path={model}",
            f"task.data.files=[{made['txt']}]",
            "task.model.max_seq_len=32",
            "cluster.ranks=1",
            "trainer.max_steps=2",
            f"hydra.run.dir={run_dir}",
        ),
        answer,
        REPO,
        cli_env(token_cache),
    )
    assert not marker.exists(), f"the model directory's code ran:\n{out[-3000:]}"
    assert "Do you wish to run the custom code" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("hetseq-hpc: error:")]
    assert code == 2 and len(errors) == 1, f"exit {code}\n{out[-3000:]}"
    assert "auto_map" in errors[0] and str(model) in errors[0], errors[0]
    assert len(lines) == 1, out[-3000:]  # nothing else: no traceback, no rank
    assert not run_dir.exists()


def test_weights_symlinked_to_a_system_file_are_refused_before_any_rank_starts(
    made, tmp_path, token_cache
):
    """model.safetensors a symlink to /etc/passwd: one line naming the file, exit 2, before
    any rank starts (the ranks failed on it with the library's text)."""
    model = tmp_path / "linked"
    shutil.copytree(made["gpt2"], model)
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to("/etc/passwd")
    run_dir = tmp_path / "run"
    proc = hetseq(
        "task=hf",
        f"task.model.path={model}",
        f"task.data.files=[{made['txt']}]",
        "task.model.max_seq_len=32",
        "cluster.ranks=1",
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
        timeout=PTY_TIMEOUT_S,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetseq-hpc: error:"), proc.stderr[-3000:]
    assert "model.safetensors is a symlink to /etc/passwd" in lines[0]
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_pretrained_run_shows_no_progress_bar_and_names_its_learning_rate(
    made, tmp_path, token_cache
):
    """One small task=hf run from saved weights: transformers' "Loading weights" bar (and any
    other tqdm bar) never reaches the console, and rank 0's console names the learning rate,
    where it comes from and its schedule, once."""
    proc = hetseq(
        "task=hf",
        f"task.model.path={made['gpt2']}",
        f"task.data.files=[{made['txt']}]",
        f"task.data.cache_dir={tmp_path / 'cache'}",
        "task.model.max_seq_len=32",
        "cluster.ranks=1",
        "trainer.max_steps=2",
        "trainer.global_batch_size=8",
        "trainer.plot=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        token_cache=token_cache,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    for bar in ("Loading weights", "it/s]", "%|"):
        assert bar not in console, console[-3000:]
    lines = [line for line in console.splitlines() if "optimizer: AdamW" in line]
    assert len(lines) == 1 and "[rank 0]" in lines[0], console[-3000:]
    assert (
        "learning rate 5e-05 (optim=finetune's default for pretrained weights; optim.lr sets "
        "it), linear warm-up over 10 steps, then linear decay to 0 at step 2 "
        "(trainer.max_steps)" in lines[0]
    )
