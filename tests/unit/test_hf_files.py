"""The files of a ``task=hf`` model directory, refused in one line by the pre-flight check
(:func:`hetseq_hpc.cli.preflight.check_task_code`, before any rank starts) instead of failing
in the ranks with the library's text: a config or tokenizer naming custom code (``auto_map``),
and safetensors weights that are cut off, random bytes, an absurd header, a symlink to a system
file or a FIFO, or shards named outside the directory. Tiny models made here."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from hetseq_hpc.cli.preflight import check_task_code
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.files.safetensors_file import MAX_HEADER_BYTES, safetensors_problem
from hetseq_hpc.tasks.hf.model import NO_REMOTE_CODE
from tests.helpers.hf_models import make_gpt2, write_text_files

#: transformers and datasets are imported by the module's first test, on the one worker this
#: group runs on, not while every worker collects the suite
pytestmark = pytest.mark.xdist_group("hf")


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers():
    """Skips the test where transformers is not installed."""
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("hffiles")
    return {"root": root, **write_text_files(root), "gpt2": make_gpt2(root / "gpt2")}


def copy_model(made, where: Path) -> Path:
    shutil.copytree(made["gpt2"], where)
    return where


def refusal(made, *overrides: str) -> str:
    """The one-line ConfigError of the pre-flight check of ``task=hf`` with ``overrides``."""
    with pytest.raises(ConfigError) as info:
        check_task_code(
            compose_run_config(
                [
                    "task=hf",
                    f"task.data.files=[{made['txt']}]",
                    "task.model.max_seq_len=32",
                    *overrides,
                ]
            )
        )
    message = str(info.value)
    assert "\n" not in message and len(message) < 500, message
    return message


def edit_json(path: Path, **entries) -> None:
    data = json.loads(path.read_text())
    data.update(entries)
    path.write_text(json.dumps(data))


# --- custom code ---------------------------------------------------------------------------


def test_auto_map_in_config_or_tokenizer_config_is_refused_before_transformers_reads_it(
    made, tmp_path
):
    """An ``auto_map`` (code of the directory) in config.json, in tokenizer_config.json, in
    a ``task.model.config`` file or a ``task.model.tokenizer`` directory: one line naming the
    file and the entry; the directory's module is never imported."""
    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'w').write('x')\n"
    config_dir = copy_model(made, tmp_path / "cfg")
    (config_dir / "configuration_evil.py").write_text(code)
    edit_json(
        config_dir / "config.json",
        auto_map={"AutoConfig": "configuration_evil.EvilConfig"},
        model_type="evilgpt",
    )
    msg = refusal(made, f"task.model.path={config_dir}")
    assert "config.json names custom code" in msg and "configuration_evil.EvilConfig" in msg
    assert f"task.model.path='{config_dir}'" in msg
    msg = refusal(made, f"task.model.config={config_dir / 'config.json'}")
    assert "task.model.config=" in msg and "auto_map" in msg

    tok_dir = copy_model(made, tmp_path / "tok")
    (tok_dir / "tokenization_evil.py").write_text(code)
    edit_json(
        tok_dir / "tokenizer_config.json",
        auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]},
    )
    msg = refusal(made, f"task.model.path={tok_dir}")
    assert "tokenizer_config.json names custom code" in msg
    msg = refusal(made, f"task.model.path={made['gpt2']}", f"task.model.tokenizer={tok_dir}")
    assert "task.model.tokenizer=" in msg and "tokenizer_config.json" in msg
    assert not marker.exists()


def test_every_transformers_call_passes_trust_remote_code_false():
    """The keyword every loading call of hf/model.py passes (transformers never asks)."""
    assert NO_REMOTE_CODE == {"trust_remote_code": False}
    source = Path(__file__).resolve().parents[2] / "hetseq_hpc" / "tasks" / "hf" / "model.py"
    text = source.read_text()
    calls = text.count(".from_pretrained(") + text.count(".from_config(")
    assert calls == 4 and text.count("**NO_REMOTE_CODE") == calls


# --- safetensors headers -------------------------------------------------------------------


def rewrite_header(path: Path, change) -> None:
    """Rewrite ``path``'s JSON header through ``change(header)`` (padded to 8 bytes)."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def double_shape(header: dict) -> None:
    entry = first_tensor(header)
    entry["shape"] = [entry["shape"][0] * 2, *entry["shape"][1:]]


def past_the_end(header: dict) -> None:
    first_tensor(header)["data_offsets"][1] += 10**9


def bad_dtype(header: dict) -> None:
    first_tensor(header)["dtype"] = "Q99"


DAMAGED = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "cut off"),
    "header-cut": (lambda p: p.write_bytes(p.read_bytes()[:100]), "cut off"),
    "random": (lambda p: p.write_bytes(os.urandom(4096)), "not a safetensors file"),
    "absurd-length": (
        lambda p: p.write_bytes(struct.pack("<Q", 2**60) + p.read_bytes()[8:]),
        "not a safetensors file",
    ),
    "length-past-end": (
        lambda p: p.write_bytes(struct.pack("<Q", 10**7) + p.read_bytes()[8:]),
        "cut off",
    ),
    "empty": (lambda p: p.write_bytes(b""), "too short"),
    "shape-mismatch": (lambda p: rewrite_header(p, double_shape), "not a valid safetensors"),
    "offset-past-end": (lambda p: rewrite_header(p, past_the_end), "not a valid safetensors"),
    "unknown-dtype": (lambda p: rewrite_header(p, bad_dtype), "not a valid safetensors"),
    "appended": (lambda p: p.write_bytes(p.read_bytes() + b"tail"), "bytes past its tensors"),
    "not-json": (
        lambda p: p.write_bytes(struct.pack("<Q", 16) + b"{not json at all" + b"\0" * 64),
        "not a valid safetensors file (invalid JSON",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_safetensors_file_is_refused_in_one_line_before_start(made, tmp_path, damage):
    model = copy_model(made, tmp_path / "m")
    change, expect = DAMAGED[damage]
    change(model / "model.safetensors")
    msg = refusal(made, f"task.model.path={model}")
    assert "model.safetensors" in msg and expect in msg, msg
    assert "save_pretrained" in msg and "hf download" in msg  # the fix


def test_symlinked_weights_outside_the_model_dir_or_not_a_file_are_refused(made, tmp_path):
    """A weights symlink to a system file, to a device, to a file in another folder, or a
    FIFO in the directory: refused without opening it (a FIFO would block, a device never end);
    a symlink inside the directory, a symlinked directory and a Hugging Face cache snapshot
    (links into the repo's ``blobs/``) are read as usual."""
    for target, expect in (
        ("/etc/passwd", "outside the model directory"),
        ("/dev/zero", "outside the model directory"),
        (str(made["gpt2"] / "model.safetensors"), "outside the model directory"),
    ):
        model = copy_model(made, tmp_path / f"link{len(os.listdir(tmp_path))}")
        (model / "model.safetensors").unlink()
        (model / "model.safetensors").symlink_to(target)
        msg = refusal(made, f"task.model.path={model}")
        assert f"is a symlink to {os.path.realpath(target)}" in msg and expect in msg, msg

    fifo = copy_model(made, tmp_path / "fifo")
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    assert "a FIFO" in refusal(made, f"task.model.path={fifo}")

    inside = copy_model(made, tmp_path / "inside")
    (inside / "model.safetensors").rename(inside / "weights.bin.safetensors")
    (inside / "model.safetensors").symlink_to("weights.bin.safetensors")
    (tmp_path / "dirlink").symlink_to(inside, target_is_directory=True)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(made["gpt2"], snapshot)
    (repo / "blobs").mkdir()
    (snapshot / "model.safetensors").rename(repo / "blobs" / "0f1e2d")
    (snapshot / "model.safetensors").symlink_to("../../blobs/0f1e2d")
    for model in (inside, tmp_path / "dirlink", snapshot):
        check_task_code(
            compose_run_config(
                [
                    "task=hf",
                    f"task.model.path={model}",
                    f"task.data.files=[{made['txt']}]",
                    "task.model.max_seq_len=32",
                ]
            )
        )


def test_sharded_weights_are_checked_and_a_shard_outside_the_directory_is_refused(made, tmp_path):
    """``model.safetensors.index.json``: every shard it names is checked; a name leaving the
    directory, a missing shard or an index without ``weight_map`` is one line."""
    model = copy_model(made, tmp_path / "sharded")
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    check_task_code(
        compose_run_config(
            [
                "task=hf",
                f"task.model.path={model}",
                f"task.data.files=[{made['txt']}]",
                "task.model.max_seq_len=32",
            ]
        )
    )
    index.write_text(json.dumps({"weight_map": {"a": "../../../etc/passwd"}}))
    assert "not a file of the directory" in refusal(made, f"task.model.path={model}")
    index.write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    assert "does not exist" in refusal(made, f"task.model.path={model}")
    index.write_text(json.dumps({"metadata": {}}))
    assert "has no weight_map" in refusal(made, f"task.model.path={model}")
    index.unlink()
    msg = refusal(made, f"task.model.path={model}")
    assert "has no model.safetensors" in msg


def test_safetensors_problem_checks_the_size_before_the_library_maps_the_file(tmp_path):
    """The length the first 8 bytes give is checked against the file's size and the
    library's cap before ``safe_open`` maps the file."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    assert "at most 100,000,000" in safetensors_problem(path)
    path.write_bytes(struct.pack("<Q", 64) + b"{}")
    assert safetensors_problem(path).startswith("is cut off: its header alone needs 72 bytes")
    path.write_bytes(struct.pack("<Q", 8) + b"{}      ")
    assert safetensors_problem(path) is None  # an empty but sound file
