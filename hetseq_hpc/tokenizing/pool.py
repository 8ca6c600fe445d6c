"""Encoding a stream of text batches with the word cache on several cores, in order.

The workers are ``spawn``ed interpreters, never forked: a prepare runs inside a training job
(rank 0, torch's and the tokenizer's threads already started), and a fork of such a process
hung once (2026-11-26). A spawned worker imports only this module, :mod:`.word_cache`, numpy
and ``tokenizers`` (no torch: ``tests/unit/test_prepare_pool.py`` checks it), and the
parent's ``__main__`` is hidden while the workers start, so ``python -m hetseq_hpc.worker``
is not run again in them.

How many: :func:`prepare_workers`. Input below :data:`PARALLEL_MIN_BYTES` is encoded in this
process: starting the workers (0.3 s for two on the 2-core VM, mostly numpy's import) costs
what they save there (8 MB of text: 0.6 s in one process and with two workers). The rows are
the same, byte for byte, whatever the number of workers: each batch is encoded whole by one
worker and the results are taken back in the order sent.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import sys
import types
from typing import Any, Deque, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tokenizing.word_cache import CACHE_PIECES, WordCache

#: input files smaller than this (bytes, all files together) are encoded in this process
PARALLEL_MIN_BYTES = 8_000_000

#: at most this many workers by default (the parent reads, packs and writes for all of them)
MAX_WORKERS = 8

#: seconds between checks that no worker died while the parent waits for a batch
_POLL_S = 5.0

_WORKER: Optional[WordCache] = None


def worker_init(tokenizer_json: str, mode: str, capacity: int) -> None:
    """Pool initializer (runs in each worker): one single-threaded tokenizer and cache."""
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER = WordCache(Tokenizer.from_str(tokenizer_json), mode, capacity)


def worker_encode(texts: List[str]) -> Tuple[np.ndarray, np.ndarray, int]:
    """``(ids, ends, utf-8 bytes)`` of one batch, in a worker (see :meth:`WordCache.encode`).

    Raises:
        RuntimeError: called before :func:`worker_init`.
    """
    if _WORKER is None:
        raise RuntimeError("worker_encode called before worker_init")
    flat, ends = _WORKER.encode(texts)
    return flat, ends, len("".join(texts).encode("utf-8"))


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def prepare_workers(input_bytes: int) -> int:
    """Worker processes for :func:`encode_stream` (1: encode in this process).

    ``HETSEQ_PREPARE_WORKERS=N`` decides when set (``1``: in this process, whatever the size).
    Otherwise ``min(available cores, 8)``, or 1 when ``input_bytes`` (the input files' size
    in bytes) is below :data:`PARALLEL_MIN_BYTES` (8 MB) or there is one core.

    Raises:
        ConfigError: ``HETSEQ_PREPARE_WORKERS`` is not a whole number >= 1.
    """
    asked = os.environ.get("HETSEQ_PREPARE_WORKERS", "").strip()
    if asked:
        if not asked.isdigit() or int(asked) < 1:
            raise ConfigError(
                f"HETSEQ_PREPARE_WORKERS={asked!r} is not a whole number >= 1: "
                "set 1 (encode in the prepare process) or the worker count"
            )
        return int(asked)
    if input_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(available_cores(), MAX_WORKERS))


def encode_stream(
    batches: Iterable[List[str]],
    tokenizer_json: str,
    mode: str,
    workers: int,
    capacity: int = CACHE_PIECES,
) -> Iterator[Tuple[int, np.ndarray, np.ndarray, int]]:
    """``(texts, ids, ends, utf-8 bytes)`` of every batch, in order (ids int32, ends int64
    cumulative, as :meth:`WordCache.encode`).

    With ``workers > 1`` the batches are encoded by that many spawned processes, each with its
    own cache of ``capacity`` pieces; at most ``2 * workers`` batches are in flight, so memory
    stays bounded whatever the corpus size. One worker encodes here, in this process.

    Raises:
        RuntimeError: a worker process died (killed, out of memory) before its batch was done.
    """
    if workers <= 1:
        from tokenizers import Tokenizer

        cache = WordCache(Tokenizer.from_str(tokenizer_json), mode, capacity)
        for texts in batches:
            flat, ends = cache.encode(texts)
            yield len(texts), flat, ends, len("".join(texts).encode("utf-8"))
        return
    ctx = multiprocessing.get_context("spawn")
    before = set(multiprocessing.active_children())
    with _main_hidden():
        pool = ctx.Pool(workers, worker_init, (tokenizer_json, mode, capacity))
    procs = [p for p in multiprocessing.active_children() if p not in before]
    pending: Deque[Tuple[int, Any]] = collections.deque()
    with pool:
        for texts in batches:
            pending.append((len(texts), pool.apply_async(worker_encode, (texts,))))
            if len(pending) >= 2 * workers:
                count, job = pending.popleft()
                yield (count, *_result(job, procs))
        while pending:
            count, job = pending.popleft()
            yield (count, *_result(job, procs))


def _result(job: Any, procs: List[Any]) -> Tuple[np.ndarray, np.ndarray, int]:
    """The job's result; raises instead of waiting forever when a worker died (a pool would
    start a new one and never finish the lost batch).

    Raises:
        DataError: a worker process died (one line with the fix; a ``RuntimeError`` too).
    """
    while not job.ready():
        job.wait(_POLL_S)
        dead = [p for p in procs if p.exitcode is not None]
        if dead and not job.ready():
            raise DataError(
                f"a prepare worker process died (exit code {dead[0].exitcode}; "
                "-9 is usually out of memory): rerun, or set "
                "HETSEQ_PREPARE_WORKERS=1 to encode in one process"
            )
    return job.get()


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """A bare ``__main__`` while processes start: ``spawn`` re-imports the parent's main module
    in every child (``python -m hetseq_hpc.worker``: torch and the whole training stack);
    the workers need only this module, which they import by name."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = main
