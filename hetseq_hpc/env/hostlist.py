"""Expand Slurm hostlist expressions such as ``gpu[01-03,7],cpu-a1``.

Grammar from Slurm's ``scontrol show hostnames`` / hostlist documentation
(https://slurm.schedmd.com/scontrol.html#OPT_hostnames): comma-separated names, each with
optional bracketed ranges ``[a-b,c]`` that keep leading zeros, possibly several per name.
"""

from __future__ import annotations

import re
from typing import List

from hetseq_hpc.errors import WorldError

_BRACKET = re.compile(r"\[([^\]]*)\]")


def _split_top_level(expr: str) -> List[str]:
    parts, depth, current = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise WorldError(f"hostlist {expr!r} has an unmatched ']': check SLURM_JOB_NODELIST")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise WorldError(f"hostlist {expr!r} has an unmatched '[': check SLURM_JOB_NODELIST")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(body: str, expr: str) -> List[str]:
    values = []
    for item in body.split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise WorldError(f"hostlist {expr!r} has a bad range {item!r}")
            width = len(lo)
            values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif item.isdigit():
            values.append(item)
        else:
            raise WorldError(f"hostlist {expr!r} has a bad range {item!r}")
    return values


def _expand_one(name: str, expr: str) -> List[str]:
    match = _BRACKET.search(name)
    if match is None:
        return [name]
    prefix, suffix = name[: match.start()], name[match.end() :]
    return [
        host
        for value in _expand_ranges(match.group(1), expr)
        for host in _expand_one(prefix + value + suffix, expr)
    ]


def expand_hostlist(expr: str) -> List[str]:
    """Return the host names of a Slurm hostlist expression, in order.

    >>> expand_hostlist("n[1,3-4],gpu[08-10]")
    ['n1', 'n3', 'n4', 'gpu08', 'gpu09', 'gpu10']

    Raises:
        WorldError: unbalanced brackets or a malformed range.
    """
    hosts: List[str] = []
    for part in _split_top_level(expr or ""):
        hosts.extend(_expand_one(part, expr))
    return hosts
