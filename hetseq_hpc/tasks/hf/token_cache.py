"""Tokenising the user's files with the model's own tokenizer into a memory-mapped cache.

Rank 0 runs :func:`build_hf_cache` in ``prepare``; every rank opens the result with
:func:`open_hf_cache`. The folder holds ``tokens.npy`` (``(N, T)`` int32), ``lengths.npy`` for
padded rows, ``labels.npy`` for classification and ``meta.json`` last (the completion marker),
every file atomic. Packed or padded layout, the word cache and its worker processes:
docs/design/data-preparation.md, "The token cache".
"""

from __future__ import annotations

import logging
import operator
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.cache import TaskCache, cache_key
from hetseq_hpc.tasks.hf.records import records
from hetseq_hpc.tasks.packing import Packer, RowFile, pad_rows, write_token_rows
from hetseq_hpc.tokenizing.pool import encode_stream, prepare_workers
from hetseq_hpc.tokenizing.word_cache import fast_mode

log = logging.getLogger(__name__)

#: ``enc.ids`` as a C-level callable
_IDS = operator.attrgetter("ids")

#: bump when the layout changes, so old caches are not reused
HF_CACHE_FORMAT = 1


def hf_cache_key(data_cfg: Any, tokenizer_json: str, kind: str, seq_len: int) -> str:
    """Folder name for (files with their sizes and mtimes, tokenizer, kind, T, options)."""
    return cache_key(
        HF_CACHE_FORMAT,
        kind,
        seq_len,
        data_cfg.pack,
        data_cfg.text_field,
        data_cfg.label_field,
        files=data_cfg.files,
        texts=[tokenizer_json],
        prefix="hf-",
    )


def token_cache(directory: Path) -> TaskCache:
    """The ``task=hf`` token cache in ``directory``."""
    return TaskCache(directory, "hf token cache")


def is_packed(kind: str, data_cfg: Any) -> bool:
    """Whether the rows are packed (language models with ``task.data.pack=true``)."""
    return kind != "classification" and bool(data_cfg.pack)


def _special(tokenizer: Any, name: str) -> Optional[int]:
    value = getattr(tokenizer, f"{name}_token_id", None)
    return None if value is None else int(value)


def pad_id_of(tokenizer: Any) -> int:
    """The id padded rows are filled with (the cache's ``meta.json`` ``pad_id``): the
    tokenizer's pad token, else its EOS token, else 0."""
    pad_id, eos_id = _special(tokenizer, "pad"), _special(tokenizer, "eos")
    return pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)


def backend_encoder(tokenizer: Any, truncate: Optional[int]):
    """A copy of the Rust tokenizer of ``tokenizer`` (a transformers fast tokenizer) that does
    not pad and truncates to ``truncate`` tokens (None: does not truncate)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    if truncate is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(truncate)
    return backend


def build_hf_cache(data_cfg: Any, tokenizer: Any, kind: str, seq_len: int, directory: Path) -> Path:
    """Tokenise ``data_cfg.files`` into ``directory`` once (:meth:`TaskCache.build_once`:
    skipped when its ``meta.json`` exists; a concurrent builder waits for the first).

    Raises:
        DataError: a file cannot be read or lacks a column; fewer than 2 rows result; a
            classification label set with fewer than 2 classes.
    """
    cache = token_cache(directory)
    return cache.build_once(lambda: _build(data_cfg, tokenizer, kind, seq_len, cache))


#: characters of text per encode_batch call at most (bounds the encodings alive at once)
BATCH_CHARS = 4 << 20


def _texts(data_cfg: Any, kind: str, size: int):
    """Batches ``(texts, labels)`` of up to ``size`` records (and about :data:`BATCH_CHARS`
    characters) over all files."""
    label_field = data_cfg.label_field if kind == "classification" else None
    texts: List[str] = []
    labels: List[object] = []
    chars = 0
    for path in data_cfg.files:
        for text, label in records(path, data_cfg.text_field, label_field):
            texts.append(text)
            labels.append(label)
            chars += len(text)
            if len(texts) >= size or chars >= BATCH_CHARS:
                yield texts, labels
                texts, labels, chars = [], [], 0
    if texts:
        yield texts, labels


def _build(data_cfg: Any, tokenizer: Any, kind: str, seq_len: int, cache: TaskCache) -> None:
    directory = cache.directory
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    started = time.monotonic()
    packed = is_packed(kind, data_cfg)
    encoder = backend_encoder(tokenizer, None if packed else seq_len)
    cls_id, sep_id = _special(tokenizer, "cls"), _special(tokenizer, "sep")
    eos_id = _special(tokenizer, "eos")
    pad_id = pad_id_of(tokenizer)
    workers = prepare_workers(sum(os.path.getsize(path) for path in data_cfg.files))
    lengths: List[np.ndarray] = []
    raw_labels: List[object] = []
    stats = {"texts": 0, "tokens": 0, "bytes": 0}

    def fill(out: RowFile) -> None:
        framed = kind == "masked_lm" and cls_id is not None and sep_id is not None
        separator = [sep_id] if sep_id is not None else ([eos_id] if eos_id is not None else [])
        packer = Packer(out, [cls_id] if framed else [], [sep_id] if framed else [], separator)
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets nobody reads here
        encode = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
        batches = _texts(data_cfg, kind, data_cfg.encode_batch)
        mode = fast_mode(encoder.to_str()) if packed else None
        if mode is not None:  # the word cache: the same ids, several times faster
            log.info("tokenising with the %s word cache on %d process(es)", mode, workers)
            for count, flat, ends, size in encode_stream(
                (texts for texts, _ in batches), encoder.to_str(), mode, workers
            ):
                stats["texts"] += count
                stats["bytes"] += size
                stats["tokens"] += packer.add_texts(flat, ends)
                packer.flush()
            batches = iter(())
        for texts, labels in batches:
            encodings = encode(texts, add_special_tokens=not packed)
            stats["texts"] += len(texts)
            stats["bytes"] += len("".join(texts).encode("utf-8"))
            if packed:
                stats["tokens"] += packer.add_lists(list(map(_IDS, encodings)))
                packer.flush()
                continue
            block, size = pad_rows(list(map(_IDS, encodings)), seq_len, pad_id)
            stats["tokens"] += int(size.sum())
            out.write(block)
            lengths.append(size)
            raw_labels.extend(labels)
        packer.flush()

    stats["rows"] = write_token_rows(
        directory / "tokens.npy",
        seq_len,
        fill,
        2,
        lambda rows: (
            f"task.data.files give {rows} sample(s) of {seq_len} tokens "
            f"({stats['tokens']} tokens from {stats['texts']} texts): need at "
            "least 2; add text or lower task.model.max_seq_len"
        ),
    )
    label_names = _label_names(raw_labels) if kind == "classification" else None
    if not packed:
        cache.save("lengths", np.concatenate(lengths))
    if label_names is not None:
        index = {name: i for i, name in enumerate(label_names)}
        cache.save("labels", np.asarray([index[_name(v)] for v in raw_labels], dtype=np.int64))
    seconds = time.monotonic() - started
    meta = {
        "format": HF_CACHE_FORMAT,
        "kind": kind,
        "packed": packed,
        "seq_len": seq_len,
        "rows": stats["rows"],
        "texts": stats["texts"],
        "tokens": stats["tokens"],
        "bytes": stats["bytes"],
        "pad_id": int(pad_id),
        "label_names": label_names,
        "files": list(data_cfg.files),
        "seconds": round(seconds, 3),
    }
    cache.write_meta(meta)
    log.info(
        "tokenised %d texts (%.1f MB, %d tokens) into %d rows x %d in %.1f s -> %s",
        stats["texts"],
        stats["bytes"] / 1e6,
        stats["tokens"],
        stats["rows"],
        seq_len,
        seconds,
        directory,
    )


#: JSON label types by Python type (for the mixed-type check of :func:`_label_names`)
_KINDS = {bool: "boolean", int: "integer", float: "float", str: "string"}


def _name(value: object) -> str:
    """A label's class name: a string stripped, a decimal-digit string as its integer
    (``" 01"`` -> ``"1"``: CSV integers), anything else (JSON int, float, bool) as ``str``."""
    text = str(value).strip() if isinstance(value, str) else str(value)
    return str(int(text)) if text.isdecimal() else text


def _label_names(raw: List[object]) -> List[str]:
    """Class names in id order: integers 0..K-1 keep their value (JSON integers, or CSV cells
    that are all decimal digits), anything else is named by :func:`_name` and sorted. Names,
    not values, are compared: a JSON ``true`` is the class ``"True"``, not ``1``, and ``1.0`` is
    ``"1.0"`` (Python's ``True == 1 == 1.0`` would merge them in a set), so every label maps to
    a class.

    Raises:
        DataError: fewer than 2 distinct labels, integer labels that are not 0..K-1, or
            booleans mixed with other labels, or integers with floats (``1`` and
            ``1.0``: one class or two? the line asks for one type).
    """
    first: Dict[str, object] = {}
    for value in raw:
        first.setdefault(_KINDS.get(type(value), type(value).__name__), value)
    for a, b in (("boolean", None), ("integer", "float")):
        if a in first and len(first) > 1 and (b is None or b in first):
            other = next(k for k in first if k != a) if b is None else b
            raise DataError(
                f"the label column mixes {a} and {other} labels (e.g. "
                f"{first[a]!r} and {first[other]!r}): store every label as one "
                "type"
            )
    integers = all(type(v) is int for v in raw) or all(
        isinstance(v, str) and v.strip().isdecimal() for v in raw
    )
    names = {_name(v) for v in raw}
    if len(names) < 2:
        raise DataError(
            f"the label column holds {len(names)} distinct value(s) "
            f"({sorted(names)[:3]}): classification needs at least 2"
        )
    if integers:
        values = {int(name) for name in names}
        if min(values) < 0:
            raise DataError(f"integer labels must be >= 0 (found {min(values)}): use 0..K-1")
        return [str(i) for i in range(max(values) + 1)]
    return sorted(names)


def open_hf_cache(directory: Path) -> Tuple[dict, Dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a finished cache, memory-mapped.

    Raises:
        DataError: missing or damaged (the message says to delete the folder).
    """
    cache = token_cache(directory)
    meta = cache.read_meta()
    names = ["tokens"] + ([] if meta["packed"] else ["lengths"])
    names += ["labels"] if meta["kind"] == "classification" else []
    return cache.open(names)
