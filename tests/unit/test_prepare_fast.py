"""The BERT prepare through the word cache (issue 23): the cache it writes is the plain
``encode_batch`` path's, byte for byte (one process and two spawned workers, on real text with
odd whitespace, long blocks cut into pieces, documents across batches); the cache key is
unchanged; small corpora are encoded in this process; a dead worker is one line, not a hang.
(The two paths on a 50 MB corpus: docs/benchmarks.md.)"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import time

import numpy as np
import pytest

from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks.bert import mlm_data as data_mod
from hetseq_hpc.tasks.bert import mlm_encode
from hetseq_hpc.tasks.bert import text_corpus as corpus_mod
from hetseq_hpc.tasks.bert.mlm_data import SEP_ID, build_packed_text, cache_key
from hetseq_hpc.tasks.bert.text_corpus import Corpus, load_corpus
from hetseq_hpc.tasks.bert.tokenizer import load_tokenizer
from hetseq_hpc.tokenizing import pool
from tests.helpers.corpus import pydoc_text

#: text the word cache encodes whole (characters Python splits on but BERT deletes), special
#: tokens' text, long words ([UNK] past 100 characters), accents, CJK, blocks of blanks only
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


def test_separators_follow_the_plain_rule_across_batches():
    """[SEP] after the last piece of every document with tokens, wherever the batches cut."""
    rng = random.Random(0)
    for _ in range(300):
        pieces = [
            ([rng.randrange(5, 99) for _ in range(rng.choice([0, 0, 1, 2, 3]))], rng.random() < 0.4)
            for _ in range(rng.randrange(0, 30))
        ]
        want, open_doc = [], False  # the plain path's loop
        for ids, end in pieces:
            open_doc = open_doc or bool(ids)
            want += ids + ([SEP_ID] if end and open_doc else [])
            open_doc = open_doc and not end
        got, carry, start = [], False, 0
        while True:  # batches of 0 to 5 pieces
            size = rng.randrange(0, 6)
            batch = pieces[start : start + size]
            sizes = [len(ids) for ids, _ in batch]
            flat = np.asarray([t for ids, _ in batch for t in ids], dtype=np.int32)
            stream, carry = mlm_encode.with_separators(
                flat,
                np.cumsum(sizes, dtype=np.int64),
                np.asarray([e for _, e in batch], bool),
                carry,
                SEP_ID,
            )
            assert stream.dtype == np.int32
            got += stream.tolist()
            start += size
            if start >= len(pieces):
                break
        assert got == want and carry == open_doc, pieces
    with pytest.raises(ValueError, match="one flag per piece"):
        mlm_encode.with_separators(
            np.zeros(2, np.int32), np.asarray([1, 2]), np.asarray([True]), False, SEP_ID
        )


def test_the_cache_key_is_unchanged():
    """The rows did not change, so neither does the directory name: existing caches stay valid
    (the value of the code before the word cache)."""
    corpus = Corpus(name="x", files=(), fingerprint="0123456789abcdef")
    assert cache_key(corpus, 30000, 128) == "d012601b73008afa682f"


def test_a_small_corpus_is_encoded_in_this_process(tmp_path, monkeypatch):
    monkeypatch.delenv("HETSEQ_PREPARE_WORKERS", raising=False)
    monkeypatch.delenv("HETSEQ_PREPARE_FAST", raising=False)
    used = []
    real = mlm_encode.encode_stream
    monkeypatch.setattr(
        mlm_encode,
        "encode_stream",
        lambda b, j, mode, workers: used.append((mode, workers)) or real(b, j, mode, workers),
    )
    before = set(multiprocessing.active_children())
    build_packed_text(load_corpus([]), 2000, 32, tmp_path / "cache")
    assert used == [("words", 1)] and set(multiprocessing.active_children()) == before


def test_a_bad_worker_count_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("HETSEQ_PREPARE_WORKERS", "0")
    monkeypatch.setattr(data_mod, "train_tokenizer", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(ConfigError, match="HETSEQ_PREPARE_WORKERS='0'"):
        build_packed_text(_corpus(tmp_path), 2000, 32, tmp_path / "cache")


class _KillsItsWorker(str):
    """A piece of text whose unpickling ends the worker process that receives it (exit 9)."""

    def __reduce__(self):
        return (os._exit, (9,))


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
    deadline = time.monotonic() + 30
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
