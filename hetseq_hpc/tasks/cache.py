"""The one task cache: a folder ``<root>/<key>`` of ``.npy`` arrays and ``meta.json``, last.

Every built-in task keeps what ``prepare`` makes of its data in a :class:`TaskCache`, named by a
hash of what the data is made from (:func:`cache_key`). Every file is written atomically
(:mod:`hetseq_hpc.files.atomic`), ``meta.json`` last: a folder with one is complete. A build
holds a ``filelock`` lock, so concurrent preparers build it once; arrays are memory-mapped.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import numpy as np
from filelock import FileLock, Timeout

from hetseq_hpc.errors import DataError
from hetseq_hpc.files.atomic import atomic_write, atomic_write_text, remove_stale_temps

log = logging.getLogger(__name__)

#: the completion marker, written last
META_NAME = "meta.json"
#: the lock file a builder holds (flock, through filelock)
LOCK_NAME = ".lock"


def cache_root(cache_dir: Optional[str]) -> Path:
    """The cache directory: ``task.data.cache_dir``, else ``$HETSEQ_CACHE``, else
    ``~/.cache/hetseq_hpc``."""
    if cache_dir:
        return Path(os.path.expanduser(cache_dir))
    env = os.environ.get("HETSEQ_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "hetseq_hpc"


def cache_key(
    *fields: object, files: Iterable[str] = (), texts: Iterable[str] = (), prefix: str = ""
) -> str:
    """A cache folder's name: ``prefix`` + 20 hex digits of the SHA-256 of ``fields`` joined by
    ``|``, then ``|path|size|mtime_ns`` of each of ``files`` and the digest of each of ``texts``
    (a tokenizer's JSON).

    Raises:
        OSError: a file of ``files`` is missing.
    """
    h = hashlib.sha256("|".join(map(str, fields)).encode())
    for path in files:
        st = os.stat(path)
        h.update(f"|{path}|{st.st_size}|{st.st_mtime_ns}".encode())
    for text in texts:
        h.update(hashlib.sha256(text.encode()).digest())
    return prefix + h.hexdigest()[:20]


def files_fingerprint(files: Iterable[Tuple[str, Path]]) -> str:
    """16 hex digits of the SHA-256 of ``name\\0size\\0mtime_ns\\n`` of each ``(name, path)``:
    it changes when a file is rewritten, renamed or added.

    Raises:
        OSError: a file is missing.
    """
    h = hashlib.sha256()
    for name, path in files:
        st = os.stat(path)
        h.update(f"{name}\x00{st.st_size}\x00{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TaskCache:
    """One cache folder.

    Attributes:
        directory: the folder, ``<root>/<key>``.
        what: its name in error messages, e.g. ``"image cache"``.
    """

    directory: Path
    what: str = "data cache"

    @property
    def meta_path(self) -> Path:
        """``<directory>/meta.json``."""
        return self.directory / META_NAME

    def is_complete(self) -> bool:
        """Whether ``meta.json`` exists: every file of the cache is there."""
        return self.meta_path.is_file()

    def build_once(self, build: Callable[[], None]) -> Path:
        """Run ``build`` (the arrays, then :meth:`write_meta`) unless the cache is complete,
        holding the lock on ``<directory>/.lock``: a concurrent builder (another run, ``prepare``)
        waits, then finds it complete. An interrupted build's temp files are removed first.
        Returns ``directory``.

        Raises:
            OSError: the folder cannot be created or locked (full disk, read-only, a file in
                its place); whatever ``build`` raises.
        """
        if self.is_complete():
            return self.directory
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.directory / LOCK_NAME)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info("another process is preparing %s: waiting for it", self.directory)
            lock.acquire()
        try:
            if not self.is_complete():
                remove_stale_temps([self.directory])
                build()
        finally:
            lock.release()
        return self.directory

    def save(self, name: str, array: np.ndarray) -> None:
        """Write ``<directory>/<name>.npy`` atomically and durably."""
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(array))
        atomic_write(self.directory / f"{name}.npy", lambda fh: fh.write(buf.getvalue()), True)

    def write_meta(self, meta: Dict[str, object], indent: int = 1) -> None:
        """Write ``meta.json`` atomically and durably: the last file of a build."""
        text = json.dumps(meta, indent=indent, default=str)
        atomic_write_text(self.meta_path, text, durable=True)

    def unreadable(self, exc: BaseException) -> DataError:
        """The one-line error of a damaged cache: delete the folder to rebuild it."""
        return DataError(
            f"{self.what} {str(self.directory)!r} is unreadable ({type(exc).__name__}): delete "
            "that directory to rebuild it"
        )

    def mismatch(self) -> DataError:
        """The one-line error of arrays that disagree with ``meta.json``."""
        return DataError(
            f"{self.what} {str(self.directory)!r} does not match its meta.json: delete that "
            "directory to rebuild it"
        )

    def read_meta(self) -> Dict[str, object]:
        """``meta.json`` as a dict.

        Raises:
            DataError: missing or damaged (:meth:`unreadable`).
        """
        try:
            return json.loads(self.meta_path.read_text())
        except Exception as exc:
            raise self.unreadable(exc) from None

    def open(self, names: Sequence[str]) -> Tuple[Dict[str, object], Dict[str, np.ndarray]]:
        """Read ``meta.json`` and memory-map ``<name>.npy`` for each name.

        Returns:
            ``(meta, {name: read-only memory-mapped array})``.

        Raises:
            DataError: a file is missing or unreadable (:meth:`unreadable`).
        """
        meta = self.read_meta()
        try:
            arrays = {n: np.load(self.directory / f"{n}.npy", mmap_mode="r") for n in names}
        except Exception as exc:
            raise self.unreadable(exc) from None
        return meta, arrays
