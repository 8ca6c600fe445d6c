"""The files of a sharded checkpoint, checked and read without unpickling anything untrusted.

An FSDP checkpoint is DCP's ``step_XXXXXXXX.<token>.shards/`` directory with its ``SHA256SUMS``,
committed by the checksummed ``step_XXXXXXXX.pt`` record; :func:`sweep_orphans` removes a
directory no record names. :class:`SafeShardReader` reads DCP's ``.metadata`` without
``pickle.load`` and only after every file matched ``SHA256SUMS``; :func:`full_state` reads the
whole state in one process (a DDP resume, ``export``). Writing and loading the shards is the
sharded strategy's (:class:`hetseq_hpc.train.parallel.Sharded`). The layout and the safety
rules: docs/design/checkpoints.md, "The files of a sharded checkpoint".
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.files.fence import check_write
from hetseq_hpc.train.checkpoint.files import FIX, sha256_file

#: the checksum list inside a shard directory
MANIFEST = "SHA256SUMS"
#: DCP's metadata file
METADATA = ".metadata"
_DIR = re.compile(r"^step_(\d{8})\.([0-9a-f]{8,32})\.shards\Z")
_DATA = re.compile(r"^__\d+_\d+\.distcp\Z")
_DCP = "torch.distributed.checkpoint"
#: the only classes a DCP ``.metadata`` may construct
ALLOWED_GLOBALS = frozenset(
    {
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


def shard_dir_name(step: int, token: str) -> str:
    """``step_XXXXXXXX.<token>.shards``: a new name for every write, so a checkpoint of the same
    step is replaced by writing its record, never by rewriting a directory in place."""
    return f"step_{step:08d}.{token}.shards"


def is_shard_dir_name(name: str) -> bool:
    """Whether ``name`` is a shard directory's name (no path separators, no ``..``)."""
    return _DIR.match(name) is not None


def shard_dirs(path: Path) -> List[Path]:
    """The shard directories of checkpoint ``path``'s step (``step_XXXXXXXX.<token>.shards``,
    this module); empty for a full checkpoint."""
    stem = Path(path).name[: -len(".pt")]
    return sorted(p for p in Path(path).parent.glob(f"{stem}.*.shards") if p.is_dir())


def rank_files(directory: Path, rank: int) -> List[Path]:
    """The data files rank ``rank`` wrote into a shard directory (``__<rank>_<n>.distcp``)."""
    return sorted(p for p in Path(directory).glob(f"__{rank}_*.distcp") if _DATA.match(p.name))


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only :data:`ALLOWED_GLOBALS` and torch dtypes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP checkpoint metadata")


def read_metadata_safely(directory: Path) -> Any:
    """DCP's ``Metadata`` of a shard directory, unpickled with :data:`ALLOWED_GLOBALS` only,
    and checked: tensor entries only, data files by their DCP names inside the directory, no
    storage transforms.

    Raises:
        CheckpointError: the file is missing, refused (names what it tried to build) or
            inconsistent; one line ending with the fix.
    """
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = Path(directory) / METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except OSError as exc:
        raise CheckpointError(
            f"sharded checkpoint {str(directory)!r} has no readable "
            f"{METADATA} ({exc.strerror or exc}): {FIX}"
        ) from None
    except Exception as exc:  # the refusal, or a damaged pickle
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} is refused as untrusted: its metadata is not "
            f"plain DCP metadata ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; "
            f"nothing was built from it): {FIX}"
        ) from None
    bad = None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        bad = "it is not a DCP Metadata object"
    else:
        kinds = {
            type(v).__name__
            for v in metadata.state_dict_metadata.values()
            if not isinstance(v, TensorStorageMetadata)
        }
        files = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()}
        if kinds:
            bad = f"it lists non-tensor entries ({', '.join(sorted(kinds))})"
        elif any(not isinstance(f, str) or not _DATA.match(f) for f in files):
            bad = "it names data files outside the directory or not written by DCP"
        elif any(
            getattr(info, "transform_descriptors", None) for info in metadata.storage_data.values()
        ):
            bad = "it asks for storage transforms"
    if bad:
        raise CheckpointError(f"sharded checkpoint {str(path)!r} is refused: {bad}: {FIX}")
    return metadata


def write_manifest(directory: Path, digests: Dict[str, str]) -> str:
    """Write ``SHA256SUMS`` (``<digest>  <name>`` lines, sorted) into ``directory`` with fsync;
    returns its own SHA-256 (stored in the commit record)."""
    text = "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
    path = Path(directory) / MANIFEST
    check_write(path, ask=False)  # save_sharded asked for this checkpoint
    with open(path, "w", encoding="ascii") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def shard_dir_of(record_path: Path, state: Dict[str, Any]) -> Path:
    """The shard directory a record names (beside the record; the name is checked).

    Raises:
        CheckpointError: the ``shards`` entry is malformed or names something else.
    """
    entry = state.get("shards")
    name = entry.get("dir") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not is_shard_dir_name(name):
        raise CheckpointError(
            f"checkpoint {str(record_path)!r} names no valid shard directory ({name!r}): {FIX}"
        )
    return Path(record_path).parent / name


def verify_shards(record_path: Path, state: Dict[str, Any], full: bool = True) -> Path:
    """Check a sharded checkpoint before anything is loaded from it: ``SHA256SUMS`` against the
    record's digest, then (``full``) every listed file's SHA-256 and the metadata's contents
    (:func:`read_metadata_safely`). ``full=False`` checks the list and the metadata file only
    (the ranks that read a checkpoint rank 0 has just verified whole).

    Returns:
        The shard directory.

    Raises:
        CheckpointError: a file is missing, differs from its checksum, or the metadata is
            refused; one line naming the file and the fix.
    """
    directory = shard_dir_of(record_path, state)
    manifest = directory / MANIFEST
    try:
        text = manifest.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        raise CheckpointError(
            f"sharded checkpoint {str(directory)!r} is incomplete: its "
            f"{MANIFEST} is missing or unreadable: {FIX}"
        ) from None
    want = str(state["shards"].get("manifest_sha256", ""))
    if hashlib.sha256(text.encode("ascii")).hexdigest() != want:
        raise CheckpointError(
            f"sharded checkpoint {str(manifest)!r} is corrupt: it differs "
            f"from the checksum in {Path(record_path).name}: {FIX}"
        )
    listed: Dict[str, str] = {}
    for line in text.splitlines():
        digest, _, name = line.partition("  ")
        if name != METADATA and not _DATA.match(name):
            raise CheckpointError(
                f"sharded checkpoint {str(manifest)!r} lists {name!r}, not a DCP file: {FIX}"
            )
        listed[name] = digest
    if METADATA not in listed:
        raise CheckpointError(
            f"sharded checkpoint {str(manifest)!r} does not list {METADATA}: {FIX}"
        )
    for name, digest in listed.items():
        if not full and name != METADATA:
            continue
        try:
            got = sha256_file(directory / name)
        except OSError:
            raise CheckpointError(
                f"sharded checkpoint {str(directory)!r} is incomplete: {name} is missing: {FIX}"
            ) from None
        if got != digest:
            raise CheckpointError(
                f"sharded checkpoint file {str(directory / name)!r} is corrupt: its SHA-256 "
                f"{got[:16]}... differs from {digest[:16]}... in {MANIFEST}: {FIX}"
            )
    metadata = read_metadata_safely(directory)
    used = {info.relative_path for info in metadata.storage_data.values()}
    unlisted = sorted(used - set(listed))
    if unlisted:
        raise CheckpointError(
            f"sharded checkpoint {str(directory)!r} reads {unlisted[0]}, "
            f"which {MANIFEST} does not list: {FIX}"
        )
    return directory


def safe_reader(directory: Path) -> Any:
    """A DCP ``FileSystemReader`` for ``directory`` whose ``read_metadata`` is
    :func:`read_metadata_safely` (the rest is DCP's own, which reads tensors with
    ``weights_only=True``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeShardReader(FileSystemReader):
        """DCP's file reader without its ``pickle.load``."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata_safely(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeShardReader(directory)


def sweep_orphans(checkpoints: Path, referenced: Optional[set] = None) -> List[Path]:
    """Remove shard directories no record references (a write cut off before its record, an
    older write of a step written again) and DCP temp directories (``.step_*.shards.tmp``).
    Call only where no other process writes (rank 0, at the start of a run or after a save).

    Args:
        checkpoints: ``<run dir>/checkpoints``.
        referenced: names of the directories the records reference.
    """
    removed: List[Path] = []
    if not Path(checkpoints).is_dir():
        return removed
    for path in Path(checkpoints).iterdir():
        stale_tmp = path.name.startswith(".step_") and path.name.endswith(".shards.tmp")
        orphan = is_shard_dir_name(path.name) and path.name not in (referenced or set())
        if path.is_dir() and (stale_tmp or orphan):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def load_error(source: str, exc: BaseException) -> CheckpointError:
    """The one-line error of a checkpoint ``source`` whose tensors did not load (``exc``):
    another model's, or unreadable."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(
        f"checkpoint {source!r} could not be loaded into this model "
        f"({first[:200]}): use the task.model settings it was trained with, "
        "or a new run directory"
    )


def full_state(
    directory: Path, param_groups: List[Dict[str, Any]], optimizer: bool = True
) -> Dict[str, Any]:
    """The whole model and optimizer state of a sharded checkpoint on the CPU, in a full
    checkpoint's layout (``{"model": {fqn: tensor}, "optimizer": Optimizer.state_dict()
    layout}``), read by THIS process alone (no collective): a DDP resume, ``export``
    (``optimizer=False``: the model only, nothing of the optimizer is read).

    Raises:
        CheckpointError: the metadata is refused or a file cannot be read.
    """
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata_safely(directory)
    paths = metadata.planner_data or {}
    nested: Dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        path = paths.get(key) or tuple(key.split(".", 1))
        if not all(isinstance(p, (str, int)) for p in path) or len(path) < 2:
            raise CheckpointError(
                f"sharded checkpoint {str(directory)!r} is refused: entry "
                f"{key!r} has no valid place: resume from another checkpoint"
            )
        if path[0] != "model" and not optimizer:
            continue
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(nested, storage_reader=safe_reader(directory), no_dist=True)
    except Exception as exc:
        raise load_error(str(directory), exc) from None
    order = [fqn for group in param_groups for fqn in group["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    optim = nested.get("optim", {})
    return {
        "model": nested.get("model", {}),
        "optimizer": {
            "state": {index[fqn]: optim[fqn] for fqn in order if fqn in optim},
            "param_groups": [
                {**g, "params": [index[f] for f in g["params"]]} for g in param_groups
            ],
        },
    }


def with_full_tensors(record: Dict[str, Any], record_path: Path) -> Dict[str, Any]:
    """A sharded checkpoint's record with the whole model and optimizer state filled in
    (:func:`full_state`); a full checkpoint is returned as it is."""
    if "shards" not in record:
        return record
    directory = verify_shards(record_path, record, full=False)
    return dict(record, **full_state(directory, record["optimizer"]["param_groups"]))


__all__ = [
    "ALLOWED_GLOBALS",
    "MANIFEST",
    "METADATA",
    "full_state",
    "is_shard_dir_name",
    "load_error",
    "rank_files",
    "read_metadata_safely",
    "safe_reader",
    "shard_dir_name",
    "shard_dir_of",
    "shard_dirs",
    "sweep_orphans",
    "verify_shards",
    "with_full_tensors",
    "write_manifest",
]
