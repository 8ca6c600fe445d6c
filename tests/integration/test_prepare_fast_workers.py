"""The BERT prepare through the word cache with spawned worker processes: the same cache byte for
byte, and a dead worker is one line, not a hang (moved from tests/unit/test_prepare_fast.py)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time

import numpy as np
import pytest

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.bert import mlm_data as data_mod
from hetseq_hpc.tasks.bert import mlm_encode
from hetseq_hpc.tasks.bert import text_corpus as corpus_mod
from hetseq_hpc.tasks.bert.mlm_data import build_packed_text
from hetseq_hpc.tasks.bert.text_corpus import load_corpus
from hetseq_hpc.tasks.bert.tokenizer import load_tokenizer
from hetseq_hpc.tokenizing import pool
from tests.helpers.corpus import pydoc_text
from tests.helpers.waits import wait_for

ODD = (
    "\n\n".join(
        [
            "tabs\there and\tthere",
            "odd\x1cwhite",
            "odd\x1dspace",
            "odd\x1eand\x1fmore",
            "next\x85line",
            "vertical\x0btab",
            "form\x0cfeed",
            "zero\u200bwidth",
            "word\u2060joiner",
            "byte\ufefforder",
            "mongolian\u180evowel",
            "nbsp\xa0ideographic\u3000space em\u2003dash",
            "line\u2028sep para\u2029sep",
            "[MASK] is a [CLS] token [SEP]and[PAD]this",
            "nul\x00char replacement\ufffdchar",
            " ",
            "\t",
            "a" * 150 + " " + "b" * 99,
            "Ça m'étonne: naïve café İstanbul ß ẞ e\u0301 中文字符和English混合 한국어",
            "punct!!!??? ... --- *** ### ``` ~~~ http://x.org/p?q=1&b=2#f u@m.org",
        ]
    )
    + "\n\n"
)


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(ODD + pydoc_text() + "\n\n" + ODD * 3, encoding="utf-8")
    return load_corpus([str(path)])


def _fixed_tokenizer(monkeypatch, source):
    """Every build uses the tokenizer of ``source`` (the trainer breaks ties in hash order, so
    two trainings of one corpus may differ)."""

    def train(documents, vocab_size, path, show_progress=False):
        shutil.copyfile(source, path)
        return load_tokenizer(path)

    monkeypatch.setattr(data_mod, "train_tokenizer", train)


class _KillsItsWorker(str):
    """A piece of text whose unpickling ends the worker process that receives it (exit 9)."""

    def __reduce__(self):
        return (os._exit, (9,))


def test_word_cache_writes_the_plain_path_s_cache_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "MAX_PIECE_CHARS", 300)  # documents in several pieces
    monkeypatch.setattr(data_mod, "ENCODE_BATCH_CHARS", 2000)  # documents across batches
    monkeypatch.setattr(data_mod, "ROWS_PER_WRITE", 7)
    corpus = _corpus(tmp_path)
    assert sum(not end for _, end in corpus.segments()) > 50
    monkeypatch.setenv("HETSEQ_PREPARE_FAST", "0")
    plain = build_packed_text(corpus, 2000, 32, tmp_path / "plain")
    monkeypatch.delenv("HETSEQ_PREPARE_FAST")
    _fixed_tokenizer(monkeypatch, plain / "tokenizer.json")
    used = []
    real = mlm_encode.encode_stream

    def spy(batches, tokenizer_json, mode, workers):
        used.append((mode, workers))
        return real(batches, tokenizer_json, mode, workers)

    monkeypatch.setattr(mlm_encode, "encode_stream", spy)
    for workers in ("1", "2"):
        monkeypatch.setenv("HETSEQ_PREPARE_WORKERS", workers)
        fast = build_packed_text(corpus, 2000, 32, tmp_path / workers)
        for name in ("tokens.npy", "meta.json", "tokenizer.json"):
            assert (fast / name).read_bytes() == (plain / name).read_bytes(), (workers, name)
    assert used == [("words", 1), ("words", 2)]
    assert np.load(plain / "tokens.npy").shape[0] > 1000


def test_a_dead_worker_is_one_line_not_a_hang(tmp_path, monkeypatch):
    """A worker that dies holding a batch: the spawned pool would start another and wait
    forever for that batch; the build raises one line instead and keeps nothing."""
    monkeypatch.setattr(pool, "_POLL_S", 0.2)
    monkeypatch.setattr(data_mod, "ENCODE_BATCH_CHARS", 5000)
    monkeypatch.setenv("HETSEQ_PREPARE_WORKERS", "2")
    corpus = _corpus(tmp_path)
    calls = {"n": 0}
    real = type(corpus).segments

    def segments(self):  # the packing pass (the second) sends a piece that kills a worker
        calls["n"] += 1
        for i, (text, end) in enumerate(real(self)):
            yield (_KillsItsWorker(text) if calls["n"] == 2 and i == 300 else text), end

    monkeypatch.setattr(type(corpus), "segments", segments)
    directory = tmp_path / "cache"
    started = time.monotonic()
    with pytest.raises(DataError, match=r"prepare worker process died \(exit code 9") as info:
        build_packed_text(corpus, 2000, 32, directory)
    assert time.monotonic() - started < 120
    assert "\n" not in str(info.value) and "HETSEQ_PREPARE_WORKERS=1" in str(info.value)
    assert not (directory / "meta.json").exists() and not (directory / "tokens.npy").exists()
    assert not list(directory.glob(".*.tmp"))
    wait_for(lambda: not multiprocessing.active_children(), "the pool's workers ended", 30)
