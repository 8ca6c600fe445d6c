"""The BERT prepare through the word cache (issue 23): the cache it writes is the plain
``encode_batch`` path's, byte for byte (one process and two spawned workers, on real text with
odd whitespace, long blocks cut into pieces, documents across batches); the cache key is
unchanged; small corpora are encoded in this process; a dead worker is one line, not a hang.
(The two paths on a 50 MB corpus: docs/benchmarks.md.)"""

from __future__ import annotations

import multiprocessing
import random

import numpy as np
import pytest

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.tasks.bert import mlm_data as data_mod
from hetseq_hpc.tasks.bert import mlm_encode
from hetseq_hpc.tasks.bert.mlm_data import SEP_ID, build_packed_text, cache_key
from hetseq_hpc.tasks.bert.text_corpus import Corpus, load_corpus
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
