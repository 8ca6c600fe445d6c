"""The one task cache (tasks/cache.py): every built-in task's key is the value the code before
it gave (existing caches stay valid), and a second preparer of the same cache waits for the
first and builds nothing, for every task (before, only bert and hf locked their caches).
(BERT's key: tests/unit/test_prepare_fast.py::test_the_cache_key_is_unchanged.)"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from filelock import FileLock

from hetseq_hpc.tasks.bert.text_corpus import load_corpus
from hetseq_hpc.tasks.cache import TaskCache
from hetseq_hpc.tasks.hf.seq2seq import seq2seq_cache_key
from hetseq_hpc.tasks.hf.token_cache import hf_cache_key
from hetseq_hpc.tasks.image import data as image_data
from hetseq_hpc.tasks.image.data import ImageSource, resolve_source
from hetseq_hpc.tasks.translation import parallel_data
from hetseq_hpc.tasks.translation.parallel_corpus import ParallelSource, resolve_sources

#: a fixed mtime, so that a key over files is the same on every machine
MTIME_NS = 1_700_000_000_000_000_000


def _touch(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, ns=(MTIME_NS, MTIME_NS))
    return path


def test_every_cache_key_is_unchanged(tmp_path, monkeypatch):
    """The values of the code before the one cache (each task hashed its key itself)."""
    fixed = "0123456789abcdef"
    source = ImageSource("npz", "x.npz", fixed)
    assert image_data.cache_key(source, None, 0.1) == "7274313e06af8d5957ef"
    assert image_data.cache_key(source, 32, 0.05) == "978029dd264c235e3d5f"
    pairs = ParallelSource(parts=(), fingerprint=fixed)
    assert parallel_data.cache_key(pairs, 8000, 64, 200, 0.02) == "68dd372ba0f86252d3ad"
    monkeypatch.chdir(tmp_path)  # hf keys name the files as given: relative here
    _touch(tmp_path / "d.txt", b"hello world\n" * 10)
    cfg = SimpleNamespace(
        files=["d.txt"],
        pack=True,
        text_field="text",
        label_field="label",
        source_field="source",
        target_field="target",
    )
    tokenizer = '{"model": 1}'
    assert hf_cache_key(cfg, tokenizer, "causal_lm", 128) == "hf-3a351a3f825be48bab8f"
    padded = SimpleNamespace(**{**vars(cfg), "pack": False})
    assert hf_cache_key(padded, tokenizer, "classification", 64) == "hf-fe6f116a2cd8ac64ee3f"
    assert seq2seq_cache_key(cfg, tokenizer, 128, 32) == "hf-s2s-2574686d717481612a60"


def test_the_fingerprints_of_files_are_unchanged(tmp_path):
    """What the keys of bert, image and translation are made from: each file's name, size and
    mtime, as before."""
    for name in ("cat/a.png", "dog/b.png"):
        _touch(tmp_path / "imgs" / name, b"x" * 7)
    assert resolve_source(str(tmp_path / "imgs")).fingerprint == "a22dd4642df49238"

    def digest(name: str, path: Path) -> str:
        line = f"{name}\x00{path.stat().st_size}\x00{MTIME_NS}\n"
        return hashlib.sha256(line.encode()).hexdigest()[:16]

    text = _touch(tmp_path / "corpus.txt", b"some text\n\nmore text\n")
    assert load_corpus([str(text)]).fingerprint == digest(os.path.abspath(text), text)
    tsv = _touch(tmp_path / "pairs.tsv", b"Hallo Welt.\tHello world.\n\n")
    assert resolve_sources([str(tsv)]).fingerprint == digest(f"tsv\x00{os.path.abspath(tsv)}", tsv)


def _image_build(directory: Path):
    source = ImageSource("npz", "unused.npz", "0123456789abcdef")
    return image_data.build_image_cache(source, None, 0.1, directory)


def _translation_build(directory: Path):
    source = ParallelSource(parts=(), fingerprint="0123456789abcdef")
    return parallel_data.build_translation_cache(source, 100, 16, 200, 0.1, directory)


@pytest.mark.parametrize(
    "build, module, reader",
    [
        (_image_build, image_data, "read_source"),
        (_translation_build, parallel_data, "read_pairs"),
    ],
    ids=["image", "translation"],
)
def test_a_second_preparer_waits_for_the_first_and_builds_nothing(
    build, module, reader, tmp_path, monkeypatch, caplog
):
    """While another preparer holds the cache's lock (another run, `hetseq-hpc prepare`, or an
    older hetseq_hpc: the same ``.lock`` file), this one says it waits, waits, and then finds
    the cache complete: it reads no data."""
    directory = tmp_path / "cache" / "key"
    directory.mkdir(parents=True)
    moved = threading.Event()  # the second preparer waits, or (wrongly) reads the data
    reads = []

    def read(*args, **kwargs):
        reads.append(args)
        moved.set()
        raise AssertionError("the second preparer read the data")

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting for it" in record.getMessage():
                moved.set()

    monkeypatch.setattr(module, reader, read)
    caplog.set_level(logging.INFO, logger="hetseq_hpc.tasks.cache")
    handler = Waiting()
    logging.getLogger("hetseq_hpc.tasks.cache").addHandler(handler)
    result = {}

    def second():
        try:
            result["directory"] = build(directory)
        except BaseException as exc:  # reported by the assertions below
            result["error"] = exc
        moved.set()

    first = FileLock(directory / ".lock")
    first.acquire()
    thread = threading.Thread(target=second, daemon=True)
    try:
        thread.start()
        assert moved.wait(timeout=120), "the second preparer neither waited nor read"
        assert reads == [] and not result, "the second preparer did not wait for the lock"
        TaskCache(directory).write_meta({"done": True})  # the first preparer finishes
    finally:
        first.release()
        thread.join(timeout=120)
        logging.getLogger("hetseq_hpc.tasks.cache").removeHandler(handler)
    assert result == {"directory": directory} and reads == []
    assert any("another process is preparing" in r.getMessage() for r in caplog.records)


def test_an_unreadable_cache_names_itself_and_the_fix(tmp_path):
    cache = TaskCache(tmp_path / "k", "image cache")
    cache.directory.mkdir()
    with pytest.raises(Exception, match=r"image cache '.*k' is unreadable \(FileNotFoundError\)"):
        cache.open(["train_x"])
    cache.write_meta({"rows": 1})
    cache.save("train_x", np.zeros((2, 3), np.uint8))
    meta, arrays = cache.open(["train_x"])
    assert meta == {"rows": 1} and arrays["train_x"].shape == (2, 3)
    assert "does not match its meta.json: delete that directory" in str(cache.mismatch())
