"""task=hf's prepare pool with spawned workers: the same cache as one process, and workers that
import no torch (moved from tests/unit/test_prepare_pool.py: they start processes)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from hetseq_hpc.tasks.hf.token_cache import build_hf_cache  # noqa: E402
from tests.helpers.corpus import pydoc_text  # noqa: E402
from tests.helpers.runs import hetseq  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _tokenizer(kind: str):
    lines = pydoc_text().splitlines()[:3000]
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(
            lines,
            trainers.WordPieceTrainer(
                vocab_size=600,
                special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                show_progress=False,
            ),
        )
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token="[PAD]",
            unk_token="[UNK]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


PROBE = """
import os, sys
import torch  # a rank of a training job: torch (and its threads) already loaded
import multiprocessing
from hetseq_hpc.tokenizing import pool
from tests.helpers.waits import wait_for
from tokenizers import Tokenizer, models, pre_tokenizers

def maps(pid):
    with open(f"/proc/{pid}/maps") as fh:
        return fh.read()

if __name__ == "__main__":
    torch.ones(4).sum()
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    stream = pool.encode_stream((["a b a", "b"] for _ in range(8)), tok.to_str(), "words", 2)
    results = [next(stream) for _ in range(8)]
    children = multiprocessing.active_children()
    wait_for(
        lambda: all("tokenizers.abi3" in maps(p.pid) for p in children),
        "workers never imported tokenizers",
        60,
    )
    print(len(children), sum("/torch/" in maps(p.pid) for p in children),
          [r[1].tolist() for r in results[:1]], flush=True)
    stream.close()
"""


@pytest.mark.parametrize("kind,task_kind", [("wordpiece", "masked_lm"), ("bpe", "causal_lm")])
def test_two_spawned_workers_write_the_same_cache_as_one_process(
    kind, task_kind, tmp_path, monkeypatch
):
    text = tmp_path / "corpus.txt"
    # odd characters too: texts the word cache encodes whole must stay in their place
    extra = "tabs\there\nodd\x1cwhite space\nzero\u200bwidth  two  spaces\n"
    text.write_text((pydoc_text(2) + extra) * 3, encoding="utf-8")
    data = SimpleNamespace(
        files=[str(text)], pack=True, text_field="text", label_field=None, encode_batch=97
    )  # many small batches: order across workers shows
    tokenizer = _tokenizer(kind)
    out = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("HETSEQ_PREPARE_WORKERS", workers)
        build_hf_cache(data, tokenizer, task_kind, 32, tmp_path / workers)
        out[workers] = {
            name: (tmp_path / workers / name).read_bytes() for name in ("tokens.npy", "meta.json")
        }
        assert np.load(tmp_path / workers / "tokens.npy").shape[0] > 100
    assert out["1"]["tokens.npy"] == out["2"]["tokens.npy"]
    strip = [line for line in out["1"]["meta.json"].splitlines() if b"seconds" not in line]
    assert strip == [line for line in out["2"]["meta.json"].splitlines() if b"seconds" not in line]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_workers_import_no_torch_even_under_a_torch_importing_main(tmp_path):
    (tmp_path / "probe_main.py").write_text(textwrap.dedent(PROBE))
    env = {
        "PYTHONPATH": f"{tmp_path}:{REPO}",
        "PATH": "/usr/bin:/bin",
        "HETSEQ_PREPARE_WORKERS": "2",
    }
    proc = hetseq(module="probe_main", cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # 2 workers, none of them with torch's libraries mapped; the ids as in one process
    assert proc.stdout.split("\n")[0] == "2 0 [[0, 1, 0, 1]]", proc.stdout
