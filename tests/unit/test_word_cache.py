"""The word-cache fast path of ``prepare task=hf`` gives the tokenizer's own ids, exactly.

Tokenizers are built here with ``tokenizers`` (nothing downloaded): a BERT WordPiece
(``BertNormalizer`` + ``BertPreTokenizer``) and a GPT-2-style byte-level BPE.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from tokenizers import (  # noqa: E402
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from hetseq_hpc.tokenizing.word_cache import WordCache, fast_mode  # noqa: E402

BASE = [
    "The quick brown fox, jumped over the lazy dog's back! (twice)",
    "Ça m'étonne: naïve café résumé Ünïcödé ÅNGSTRÖM façade coöperate",
    "中文字符和English混合文本，还有标点。日本語のテキストも。한국어 텍스트",
    "numbers 12345 3.14159 1,000,000 -42 +7 0x1F 1e-9 ½ ² ٣",
    "emoji 😀🎉 and symbols ©®™ € £ ¥ → ← ∑ ∫ math: a+b=c; x<y>z",
    "don't can't I'm you're we've they'll she'd it's 's 't",
    "ΣΊΣΥΦΟΣ ΟΔΥΣΣΕΥΣ σοφία Ελληνικά",
    "[MASK] is a [CLS] token [SEP]and<|endoftext|>this",
    "tabs\tand\ttabs\t\tdouble",
    "windows\r\nline\rendings\n",
    "odd\x1cwhite\x1dspace\x1echaracters\x1fhere",
    "next\x85line and\x0bvertical\x0cformfeed",
    "zero\u200bwidth\u2060joiner\ufeffbom\u180emongolian",
    "nbsp\xa0ideographic\u3000space\u2003em\u2028sep\u2029para",
    "multiple   spaces    here  and   there",
    "  leading spaces",
    "trailing spaces   ",
    " single leading",
    "single trailing ",
    "   ",
    "",
    "x",
    "a" * 150 + " " + "b" * 99 + " " + "supercalifragilisticexpialidocious" * 5,
    "nul\x00char and replacement\ufffdchar",
    "combining e\u0301 and \u0301leading accent, Ǆ ǅ ǆ İstanbul ß ẞ",
    "http://example.com/path?query=1&b=2#frag user@mail.org",
    "punct!!!??? ... --- *** ### ''' \"\"\" ``` ~~~",
]


def adversarial(n: int = 400) -> list:
    """The base lines plus random mixtures of their words and separators."""
    rng = random.Random(0)
    words = [w for line in BASE for w in line.replace("\n", " ").split(" ")]
    seps = [
        " ",
        " ",
        " ",
        "  ",
        "   ",
        "      ",
        "\t",
        "\n",
        "\r\n",
        "\xa0",
        "\x1c",
        "\x85",
        "\u200b",
        "\u3000",
    ]
    out = list(BASE)
    for _ in range(n):
        parts = []
        if rng.random() < 0.3:
            parts.append(" " * rng.randint(1, 5))
        for _ in range(rng.randint(0, 12)):
            parts.append(rng.choice(words))
            parts.append(rng.choice(seps) if rng.random() < 0.2 else " ")
        out.append("".join(parts))
    return out


def wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        BASE * 3,
        trainers.WordPieceTrainer(
            vocab_size=400,
            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return tok


def bytelevel_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        BASE * 3,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def wordpiece_whitespace() -> Tokenizer:
    """WordPiece behind the ``Whitespace`` pre-tokenizer (``\\w+|[^\\w\\s]+``)."""
    tok = wordpiece()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def plain(tok: Tokenizer, texts: list) -> list:
    return [enc.ids for enc in tok.encode_batch(texts, add_special_tokens=False)]


@pytest.mark.parametrize(
    "build,mode",
    [(wordpiece, "words"), (wordpiece_whitespace, "words"), (bytelevel_bpe, "bytelevel")],
)
def test_fast_path_gives_the_tokenizer_s_ids(build, mode):
    tok = build()
    assert fast_mode(tok.to_str()) == mode
    texts = adversarial()
    cache = WordCache(tok, mode, capacity=50)  # small: the clear-when-full path runs too
    for start in range(0, len(texts), 37):
        batch = texts[start : start + 37]
        flat, ends = cache.encode(batch)
        want = plain(tok, batch)
        got = np.split(flat, ends[:-1]) if len(batch) else []
        assert len(got) == len(want)
        for text, g, w in zip(batch, got, want):
            assert g.tolist() == w, repr(text)
        assert ends[-1] == flat.size
        assert len(cache.cache) <= 50 + 37 * 60
    assert cache.fallbacks > 0


@pytest.mark.parametrize(
    "build,mode,text,falls",
    [
        (wordpiece, "words", "odd\x1cwhite", True),
        (wordpiece, "words", "next\x85line", True),
        (wordpiece, "words", "zero\u200bwidth", True),
        (wordpiece, "words", "tabs\tare fine", False),
        (wordpiece, "words", "plain words here", False),
        (bytelevel_bpe, "bytelevel", "tabs\there", True),
        (bytelevel_bpe, "bytelevel", "two  spaces   and three   ", False),
        (bytelevel_bpe, "bytelevel", "ctrl\x01char", True),
        (bytelevel_bpe, "bytelevel", "nbsp\xa0here", True),
        (bytelevel_bpe, "bytelevel", "a<|endoftext|>b", True),
        (bytelevel_bpe, "bytelevel", " plain words here ", False),
    ],
)
def test_fallback_triggers_on_unsafe_text(build, mode, text, falls):
    tok = build()
    cache = WordCache(tok, mode)
    flat, _ = cache.encode([text, "ok text"])
    assert cache.fallbacks == (1 if falls else 0)
    assert flat.tolist() == [i for ids in plain(tok, [text, "ok text"]) for i in ids]


def test_unprovable_tokenizers_use_the_plain_path(monkeypatch):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    assert fast_mode(tok.to_str()) is None
    tok = bytelevel_bpe()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert fast_mode(tok.to_str()) is None
    tok = bytelevel_bpe()
    tok.normalizer = normalizers.NFKC()
    assert fast_mode(tok.to_str()) is None
    tok = wordpiece()
    tok.normalizer = normalizers.Replace(" ", "_")
    assert fast_mode(tok.to_str()) is None
    tok = wordpiece()
    tok.add_tokens(["new york"])
    assert fast_mode(tok.to_str()) is None
    monkeypatch.setenv("HETSEQ_PREPARE_FAST", "0")
    assert fast_mode(wordpiece().to_str()) is None
