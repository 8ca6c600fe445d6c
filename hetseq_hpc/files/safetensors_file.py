"""A safetensors file a user names (https://huggingface.co/docs/safetensors), checked from its
header alone: 8 bytes, a little-endian length ``N``, then ``N`` bytes of JSON naming each
tensor's dtype, shape and byte range. :func:`safetensors_problem` makes the size checks the
library leaves to ``mmap`` (a regular file, ``N`` within the file and within the library's own
cap), then lets the library's reader (``safe_open``: valid JSON, known dtypes, shapes that fit
the byte ranges, ranges that cover the data exactly) parse the header; no tensor is read.
"""

from __future__ import annotations

import os
from typing import Optional

from hetseq_hpc.files.user_input import PathLike, file_problem

#: largest header the safetensors library reads (its ``MAX_HEADER_SIZE``, 100 MB)
MAX_HEADER_BYTES = 100_000_000
#: bytes of the little-endian header length that opens the file
LENGTH_BYTES = 8
#: longest part of the library's message kept in the one line
MAX_DETAIL = 120


def safetensors_problem(path: PathLike) -> Optional[str]:
    """Why ``path`` is not a sound safetensors file, as a phrase to follow its name ("does
    not exist", "is not a regular file (a character device)", "is cut off: ...", "is not a
    safetensors file: ..."), or None when its header is sound. Symlinks are followed; a FIFO or
    a device is never opened."""
    problem = file_problem(path)
    if problem:
        return problem
    size = os.stat(path).st_size
    try:
        with open(path, "rb") as fh:
            head = fh.read(LENGTH_BYTES)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    if len(head) < LENGTH_BYTES:
        return f"is {size} bytes: too short for a safetensors file (empty or cut off)"
    length = int.from_bytes(head, "little")
    if length > MAX_HEADER_BYTES:
        return (
            f"is not a safetensors file: its first 8 bytes give a header of {length:,} bytes "
            f"(at most {MAX_HEADER_BYTES:,}; random or other data?)"
        )
    if length > size - LENGTH_BYTES:
        return (
            f"is cut off: its header alone needs {length + LENGTH_BYTES:,} bytes and the "
            f"file has {size:,}"
        )
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="numpy") as opened:
            opened.keys()
    except (SafetensorError, OSError, ValueError) as exc:
        detail = " ".join(str(exc).split()).removeprefix("Error while deserializing header: ")
        detail = detail if len(detail) <= MAX_DETAIL else detail[: MAX_DETAIL - 3] + "..."
        if "not fully covered" in detail or "incomplete" in detail:
            return f"is cut off or has bytes past its tensors ({detail})"
        return f"is not a valid safetensors file ({detail})"
    return None
