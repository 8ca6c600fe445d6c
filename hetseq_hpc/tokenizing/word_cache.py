"""Encoding packed text word by word with a cache: the same ids as the tokenizer, 4-6x faster.

:func:`fast_mode` decides from the tokenizer's own JSON whether a text's ids are the
concatenation of its pieces' ids (``"words"``, ``"bytelevel"``, or ``None``: the plain path);
each distinct piece is then encoded once and kept in a bounded dict.
``tests/unit/test_word_cache.py`` checks the ids against the plain encode on adversarial text.
Which tokenizers qualify and which texts are encoded whole: docs/design/data-preparation.md,
"Encoding packed text word by word".
"""

from __future__ import annotations

import itertools
import json
import os
import re
from array import array
from operator import attrgetter
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

#: GPT-2's pieces at spaces: a word with the one space before it, or a run of spaces that
#: is not followed by a word (the last space of a run goes with the word after it)
_SPACE_RUNS = re.compile(r" ?[^ ]+| +(?![^ ])")

#: pieces kept at most; the dict is cleared when full (bounds memory: ~150 B a piece)
CACHE_PIECES = 400_000

#: characters Python's ``str.split()`` splits on that a BERT pipeline deletes, plus
#: zero-width and byte-order characters some regex engines count as whitespace
_WORDS_UNSAFE = "\x00\x0b\x0c\x1c\x1d\x1e\x1f\x85\u180e\u200b\u2060\ufeff"
#: every whitespace character but the plain space, plus the zero-width ones
_BYTELEVEL_UNSAFE = "".join(
    sorted(
        {chr(c) for c in range(0x3001) if chr(c).isspace()} - {" "}
        | set("\x00\x01\u180e\u200b\u200c\u200d\u2060\ufeff")
    )
)

_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFD", "NFC", "StripAccents"}
_WORD_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}


def _types(node: Optional[dict], key: str) -> Optional[List[dict]]:
    """The components of a normalizer/pre-tokenizer node (a ``Sequence`` flattened)."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        out: List[dict] = []
        for child in node.get(key, []):
            sub = _types(child, key)
            if sub is None:
                return None
            out += sub
        return out
    return [node]


def fast_mode(tokenizer_json: str) -> Optional[str]:
    """``"words"``, ``"bytelevel"`` or ``None`` (no provably equal fast path) for a tokenizer
    given as its ``Tokenizer.to_str()`` JSON. ``HETSEQ_PREPARE_FAST=0`` forces ``None``."""
    if os.environ.get("HETSEQ_PREPARE_FAST", "1") == "0":
        return None
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") not in ("WordPiece", "WordLevel", "BPE") or model.get("dropout"):
        return None
    normalizers = _types(spec.get("normalizer"), "normalizers")
    pre = _types(spec.get("pre_tokenizer"), "pretokenizers")
    if normalizers is None or pre is None or len(pre) != 1:
        return None
    added = [t.get("content", "") for t in spec.get("added_tokens") or []]
    if pre[0].get("type") in _WORD_PRE_TOKENIZERS:
        if all(n.get("type") in _NORMALIZERS for n in normalizers) and not any(
            ch.isspace() for text in added for ch in text
        ):
            return "words"
        return None
    if (
        pre[0].get("type") == "ByteLevel"
        and pre[0].get("use_regex", True)
        and not pre[0].get("add_prefix_space")
        and not normalizers
        and model.get("type") == "BPE"
    ):
        return "bytelevel"
    return None


class WordCache:
    """Encodes batches of texts (no special tokens) piece by piece through a bounded cache.

    Args:
        encoder: a ``tokenizers.Tokenizer`` without padding or truncation.
        mode: ``"words"`` or ``"bytelevel"`` (from :func:`fast_mode`).
        capacity: pieces kept before the cache is cleared.
    """

    def __init__(self, encoder: Any, mode: str, capacity: int = CACHE_PIECES):
        if mode not in ("words", "bytelevel"):
            raise ValueError(f"unknown fast-path mode {mode!r}")
        self.encoder, self.mode, self.capacity = encoder, mode, capacity
        self._encode = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
        self.cache: Dict[str, bytes] = {}
        self.unsafe = _WORDS_UNSAFE if mode == "words" else _BYTELEVEL_UNSAFE
        spec = json.loads(encoder.to_str())
        # bytelevel: an added token splits the text before the regex (spaces around it differ)
        self.markers = []
        if mode == "bytelevel":
            self.markers += [
                t["content"] for t in spec.get("added_tokens") or [] if t.get("content")
            ]
        self.fallbacks = 0

    def _plain_indices(self, texts: Sequence[str], joined: str) -> List[int]:
        """Indices of the texts that must be encoded whole."""
        unsafe = [c for c in self.unsafe if c in joined]
        markers = [m for m in self.markers if m in joined]
        if not unsafe and not markers:
            return []
        return [
            i
            for i, text in enumerate(texts)
            if any(c in text for c in unsafe) or any(m in text for m in markers)
        ]

    def encode(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """``(ids, ends)``: the texts' ids concatenated (int32) and where each text's ids end
        (int64, cumulative), exactly as ``encode_batch(texts, add_special_tokens=False)``."""
        texts = list(texts)
        joined = "\n".join(texts)
        plain = self._plain_indices(texts, joined)
        special: Dict[str, bytes] = {}
        if plain:
            encodings = self._encode([texts[i] for i in plain], add_special_tokens=False)
            for i, enc in zip(plain, encodings):
                key = f"\x00{i}"  # never a piece: texts holding \x00 are encoded whole
                special[key] = _int32_bytes(enc.ids)
                texts[i] = key
            self.fallbacks += len(plain)
            joined = "\n".join(texts)
        if self.mode == "words":
            per_text = list(map(str.split, texts))
            counts = np.fromiter(map(len, per_text), dtype=np.int64, count=len(texts))
            pieces = list(itertools.chain.from_iterable(per_text))
            del per_text
        else:
            pieces, counts = self._bytelevel_pieces(texts, joined)
        ids = self._lookup(pieces, special)  # each piece's ids as int32 bytes
        sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) // 4
        flat = np.frombuffer(b"".join(ids), dtype=np.int32)
        piece_ends = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(sizes)])
        return flat, piece_ends[np.cumsum(counts)]

    def _bytelevel_pieces(self, texts: List[str], joined: str) -> Tuple[List[str], np.ndarray]:
        """GPT-2's regex pieces re-grouped at spaces: ``"a b"`` -> ``"a", " b"``; a run of
        k >= 2 spaces before a word -> ``k-1 spaces, " word"``; k spaces at the end -> one
        piece. Within a piece the regex runs as in the whole text (it never crosses these
        boundaries), so the piece's ids are the text's ids there."""
        runs = [i for i, text in enumerate(texts) if "  " in text] if "  " in joined else []
        sizes = {}
        for i in runs:  # spaces protected as \x01 (texts holding \x01 are encoded whole)
            units = _SPACE_RUNS.findall(texts[i])
            sizes[i] = len(units)
            texts[i] = "\n".join(units).replace(" ", "\x01")
        if runs:
            joined = "\n".join(texts)
        # each single space starts a piece: "a b c" -> "a", " b", " c"
        split = joined.replace(" ", "\n ")
        if runs:
            split = split.replace("\x01", " ")
        pieces = list(filter(None, split.split("\n")))
        spaces = np.fromiter(
            map(str.count, texts, itertools.repeat(" ")), dtype=np.int64, count=len(texts)
        )
        lead = np.fromiter(
            map(str.startswith, texts, itertools.repeat(" ")), dtype=bool, count=len(texts)
        )
        nonempty = np.fromiter(map(bool, texts), dtype=bool, count=len(texts))
        counts = spaces + (nonempty & ~lead)
        for i, size in sizes.items():
            counts[i] = size
        return pieces, counts

    def _lookup(self, pieces: List[str], special: Dict[str, bytes]) -> List[bytes]:
        """The ids of every piece as int32 bytes: new pieces encoded in one batch, then
        cached (bytes: joined by one memcpy-speed ``b"".join``, ~60 B less than a tuple)."""
        cache = self.cache
        distinct = set(pieces).difference(special)
        new = list(itertools.filterfalse(cache.__contains__, distinct))
        if len(cache) + len(new) > self.capacity:
            cache.clear()
            new = list(distinct)
        if new:
            encodings = self._encode(new, add_special_tokens=False)
            cache.update(zip(new, map(_int32_bytes, map(_ids, encodings))))
        if not special:
            return list(map(cache.__getitem__, pieces))
        cache.update(special)
        try:
            return list(map(cache.__getitem__, pieces))
        finally:
            for key in special:
                cache.pop(key, None)


#: ``enc.ids`` as a C-level callable
_ids = attrgetter("ids")


def _int32_bytes(ids: List[int]) -> bytes:
    """``ids`` as native int32 bytes."""
    return array("i", ids).tobytes()
