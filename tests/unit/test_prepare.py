"""The BERT cache build in-process: streamed, identical to packing the whole corpus at once,
atomic. (`hetseq-hpc prepare`: tests/integration/test_prepare_cli.py; a rank 0 that prepares for
longer than cluster.collective_timeout_s, or is stopped while it prepares:
tests/integration/test_prepare_safety_runs.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.bert import mlm_data as data_mod
from hetseq_hpc.tasks.bert import text_corpus as corpus_mod
from hetseq_hpc.tasks.bert.mlm_data import CLS_ID, SEP_ID, build_packed_text, load_packed_text
from hetseq_hpc.tasks.bert.text_corpus import load_corpus
from hetseq_hpc.tasks.bert.tokenizer import load_tokenizer
from tests.helpers.corpus import pydoc_text, write_corpus


def test_blocks_are_those_of_splitting_the_whole_file(tmp_path, monkeypatch):
    text = "a\r\n\r\nb\n\n\n\nc  \n \n\nd\re\r\rf" + "\n\nlong " * 50
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode("utf-8"))
    whole = path.read_text(encoding="utf-8")
    expected = [b.strip() for b in whole.split("\n\n") if b.strip()]
    for chunk in (1, 2, 3, 7, 1 << 20):
        monkeypatch.setattr(corpus_mod, "READ_CHUNK_BYTES", chunk)
        assert list(load_corpus([str(path)]).documents()) == expected, chunk


def test_non_utf8_in_the_middle_names_the_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "READ_CHUNK_BYTES", 16)
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good text\n\n" * 10 + b"\xff\xfe" + b" more\n")
    with pytest.raises(DataError, match=r"not UTF-8 text .*byte 110"):
        list(load_corpus([str(path)]).documents())


def test_streamed_rows_equal_packing_the_whole_corpus(tmp_path, monkeypatch):
    """Small write chunks and encode batches give exactly the rows of encoding every document,
    joining them with [SEP] and cutting the whole stream into rows."""
    monkeypatch.setattr(data_mod, "ROWS_PER_WRITE", 3)
    monkeypatch.setattr(data_mod, "ENCODE_BATCH_CHARS", 500)
    path = write_corpus(tmp_path, pydoc_text())
    corpus = load_corpus([str(path)])
    directory = build_packed_text(corpus, 2000, 32, tmp_path / "cache")
    packed = load_packed_text(directory, 0.1)
    tokenizer = load_tokenizer(directory / "tokenizer.json")
    stream = []
    for doc in corpus.documents():
        ids = tokenizer.encode(doc, add_special_tokens=False).ids
        if ids:
            stream += [*ids, SEP_ID]
    body = np.asarray(stream[: len(stream) // 30 * 30], dtype=np.int32).reshape(-1, 30)
    assert packed.tokens.shape == (body.shape[0], 32)
    assert (packed.tokens[:, 0] == CLS_ID).all() and (packed.tokens[:, -1] == SEP_ID).all()
    assert np.array_equal(np.asarray(packed.tokens[:, 1:-1]), body)
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["rows"] == body.shape[0]


def test_an_interrupted_prepare_leaves_nothing_a_run_trusts(tmp_path, monkeypatch):
    """A file that turns out not to be UTF-8 halfway through the packing pass stops the build:
    no meta.json (the marker every reader checks), no tokens.npy, no temp file left."""
    monkeypatch.setattr(corpus_mod, "READ_CHUNK_BYTES", 4096)
    good = write_corpus(tmp_path, pydoc_text())
    corpus = load_corpus([str(good)])
    calls = {"n": 0}
    real = type(corpus).segments

    def segments(self):  # the second pass (packing) dies halfway
        calls["n"] += 1
        for i, segment in enumerate(real(self)):
            if calls["n"] == 2 and i == 200:
                raise DataError("simulated interruption")
            yield segment

    monkeypatch.setattr(type(corpus), "segments", segments)
    directory = tmp_path / "cache"
    with pytest.raises(DataError, match="simulated"):
        build_packed_text(corpus, 2000, 32, directory)
    assert not (directory / "meta.json").exists() and not (directory / "tokens.npy").exists()
    assert not list(directory.glob(".*.tmp"))
    with pytest.raises(DataError, match="unreadable"):
        load_packed_text(directory, 0.1)
    monkeypatch.setattr(type(corpus), "segments", real)
    build_packed_text(corpus, 2000, 32, directory)
    assert load_packed_text(directory, 0.1).tokens.shape[0] > 10
