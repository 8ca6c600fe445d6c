"""A checkpoint trained on other prepared data is refused: ``tokenizers``' WordPiece trainer
breaks ties in hash order, so two prepares of the same corpus into two cache directories give
other token ids (seen: 1123 of 4320 ids moved). The BERT task's ``data_fingerprint`` (the
tokenizer's SHA-256) joins the run's fingerprint; a resume compares it where both sides have
one (the pre-flight check, which prepares nothing, does not)."""

from __future__ import annotations

import pytest

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.train.state import check_fingerprint


def test_other_prepared_data_is_refused_with_the_cache_as_the_fix():
    saved = {"task.name": "bert", "data.fingerprint": "aaaa"}
    assert check_fingerprint(saved, dict(saved), "ck", False) == []
    with pytest.raises(CheckpointError) as err:
        check_fingerprint(saved, {"task.name": "bert", "data.fingerprint": "bbbb"}, "ck", False)
    line = str(err.value)
    assert "data.fingerprint=aaaa" in line and "data.fingerprint=bbbb" in line
    assert "HETSEQ_CACHE" in line and "\n" not in line
    # the pre-flight check (no data prepared) and checkpoints from before the fingerprint
    assert check_fingerprint(saved, {"task.name": "bert"}, "ck", False) == []
    assert check_fingerprint({"task.name": "bert"}, saved, "ck", False) == []
    assert check_fingerprint(saved, {"task.name": "bert", "data.fingerprint": "b"}, "ck", True) == [
        "data.fingerprint"
    ]


def test_bert_data_fingerprint_is_the_tokenizer_digest(tmp_path):
    import hashlib
    from types import SimpleNamespace

    from hetseq_hpc.tasks.bert.mlm_task import BertTask

    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    task = SimpleNamespace(directory=tmp_path)
    digest = BertTask.data_fingerprint(task)
    assert digest == hashlib.sha256(b'{"model": {}}').hexdigest()[:16]
