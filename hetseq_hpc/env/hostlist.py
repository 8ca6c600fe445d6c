"""Expand Slurm hostlist expressions such as ``gpu[01-03,7],cpu-a1``.

Grammar from Slurm's ``scontrol show hostnames`` / hostlist documentation
(https://slurm.schedmd.com/scontrol.html#OPT_hostnames): names separated by commas OR
whitespace (``"alpha beta"`` is two hosts, as ``scontrol show hostnames`` reads it), each with
optional bracketed ranges ``[a-b,c]`` of ASCII digits that keep leading zeros, possibly several
per name. Slurm caps a hostlist at 65536 hosts (``MAX_RANGE`` in ``src/common/hostlist.c``);
the count is checked BEFORE anything is expanded, so ``n[0-99999999999]`` is an error, not an
exhausted memory. Errors name the variable that held the expression.
"""

from __future__ import annotations

import re
from typing import List, Tuple

from hetseq_hpc.errors import WorldError

#: most hosts one expression may expand to (Slurm's own limit)
MAX_HOSTS = 65536
_BRACKET = re.compile(r"\[([^\]]*)\]")
#: one range item: ASCII digits only (``str.isdigit`` also accepts '²' and Arabic digits)
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")
_SEPARATORS = ", \t\n\r\f\v"


def _fail(var: str, expr: str, what: str) -> WorldError:
    return WorldError(
        f"{var}={expr!r} {what}: check the variable (scontrol show hostnames "
        "expands a valid one), or set MASTER_ADDR"
    )


def _split_top_level(expr: str, var: str) -> List[str]:
    parts, depth, current = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _fail(var, expr, "has an unmatched ']'")
        if ch in _SEPARATORS and depth == 0:
            parts.append("".join(current))
            current = []
        elif ch.isspace():
            raise _fail(var, expr, "has whitespace inside brackets")
        else:
            current.append(ch)
    if depth != 0:
        raise _fail(var, expr, "has an unmatched '['")
    parts.append("".join(current))
    return [p for p in parts if p]


def _ranges(body: str, expr: str, var: str) -> List[Tuple[int, int, int]]:
    """``(low, high, width)`` per item of one bracket body, checked but not expanded."""
    out = []
    for item in body.split(","):
        match = _ITEM.match(item.strip())
        if match is None:
            raise _fail(var, expr, f"has a bad range {item!r} (use ASCII digits: [1-4,7])")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(lo) > int(hi):
            raise _fail(var, expr, f"has a bad range {item!r} (it runs backwards)")
        out.append((int(lo), int(hi), len(lo)))
    return out


def _count(name: str, expr: str, var: str) -> int:
    total = 1
    for body in _BRACKET.findall(name):
        total *= sum(hi - lo + 1 for lo, hi, _ in _ranges(body, expr, var))
        if total > MAX_HOSTS:
            break
    return total


def _expand_one(name: str, expr: str, var: str) -> List[str]:
    match = _BRACKET.search(name)
    if match is None:
        return [name]
    prefix, suffix = name[: match.start()], name[match.end() :]
    return [
        host
        for lo, hi, width in _ranges(match.group(1), expr, var)
        for value in range(lo, hi + 1)
        for host in _expand_one(prefix + str(value).zfill(width) + suffix, expr, var)
    ]


def expand_hostlist(expr: str, var: str = "the hostlist") -> List[str]:
    """Return the host names of a Slurm hostlist expression, in order.

    >>> expand_hostlist("n[1,3-4],gpu[08-10]")
    ['n1', 'n3', 'n4', 'gpu08', 'gpu09', 'gpu10']
    >>> expand_hostlist("alpha beta")
    ['alpha', 'beta']

    Args:
        expr: the expression (commas and/or whitespace between names).
        var: the variable that held it, named in errors (e.g. ``SLURM_STEP_NODELIST``).

    Raises:
        WorldError: unbalanced brackets, a malformed or non-ASCII range, or more than
            :data:`MAX_HOSTS` hosts; the message names ``var`` and the expression.
    """
    parts = _split_top_level(expr or "", var)
    total = 0
    for part in parts:
        total += _count(part, expr, var)
        if total > MAX_HOSTS:
            raise _fail(var, expr, f"expands to more than {MAX_HOSTS} hosts (Slurm's limit)")
    hosts: List[str] = []
    for part in parts:
        hosts.extend(_expand_one(part, expr, var))
    return hosts
