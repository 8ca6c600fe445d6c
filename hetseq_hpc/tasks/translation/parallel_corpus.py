"""German-English sentence pairs from installed packages or the user's files (nothing downloaded).

Built-in sources, all used when present (``task.data.files`` empty):

- ``ding``: Debian ``trans-de-en`` (the Ding dictionary, ``/usr/share/trans/de-en``). Lines are
  ``de :: en``; `` | `` separates aligned sub-entries, ``;`` synonyms (the first is kept),
  ``{...}``/``[...]`` are grammar and usage notes (removed). Only sentence-like entries (3+ words,
  ending in ``.``, ``!`` or ``?``) are kept.
- ``gettext``: the German message catalogs ``/usr/share/locale/de/LC_MESSAGES/*.mo`` of installed
  Debian packages, read with the standard library (``gettext.GNUTranslations``); msgid (English)
  is the target, msgstr (German) the source; a msgctxt prefix is dropped, plurals keep form 0.
- ``site-packages``: the same for ``<pkg>/**/locale/de/LC_MESSAGES/*.mo`` that pip-installed
  packages ship (Django, Sphinx, ... when installed).

User files (``task.data.files``, paths or globs): ``*.tsv`` with ``german<TAB>english`` lines,
or line-aligned parallel pairs ``name.de`` + ``name.en``.
"""

from __future__ import annotations

import gettext
import glob
import logging
import os
import re
import site
import struct
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from hetseq_hpc.config.validate import expand_data_files
from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks.cache import files_fingerprint
from hetseq_hpc.tasks.text_chunks import utf8_chunks

log = logging.getLogger(__name__)

DING_PATH = Path("/usr/share/trans/de-en")
SYSTEM_LOCALE = Path("/usr/share/locale/de/LC_MESSAGES")
Pair = Tuple[str, str]
_NOTES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_SPACE = re.compile(r"\s+")
_SENTENCE_END = (".", "!", "?")
#: bytes read from a user's data file at a time
READ_CHUNK_BYTES = 1 << 22
#: a line longer than this many characters is skipped while it is read (kept pairs have at most
#: ``task.data.max_chars`` characters a side), so memory stays bounded without newlines
MAX_LINE_CHARS = 1 << 20
#: the characters ``str.splitlines`` ends a line at
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def clean(text: str) -> str:
    """One line, single spaces, no leading/trailing blanks."""
    return _SPACE.sub(" ", text).strip()


def _keep(de: str, en: str, max_chars: int) -> bool:
    return bool(de) and bool(en) and de != en and len(de) <= max_chars and len(en) <= max_chars


def read_ding(path: Path) -> List[Pair]:
    """Sentence-like pairs of the Ding dictionary file (format in the module docstring)."""
    pairs = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith("#") or " :: " not in line:
                continue
            de_side, en_side = line.rstrip("\n").split(" :: ", 1)
            de_parts, en_parts = de_side.split(" | "), en_side.split(" | ")
            if len(de_parts) != len(en_parts):
                continue
            for de, en in zip(de_parts, en_parts):
                de = clean(_NOTES.sub("", de.split(";")[0]))
                en = clean(_NOTES.sub("", en.split(";")[0]))
                if (
                    len(en.split()) >= 3
                    and en.endswith(_SENTENCE_END)
                    and de.endswith(_SENTENCE_END)
                ):
                    pairs.append((de, en))
    return pairs


def read_mo(path: Path) -> List[Pair]:
    """``(german, english)`` pairs of one compiled gettext catalog.

    Raises:
        DataError: the file is not a readable ``.mo`` catalog.
    """
    try:
        with open(path, "rb") as fh:
            catalog = gettext.GNUTranslations(fh)._catalog
    except (OSError, ValueError, LookupError, struct.error) as exc:
        raise DataError(
            f"gettext catalog {str(path)!r} is unreadable ({exc}): remove it from the sources"
        ) from None
    pairs = []
    for key, german in catalog.items():
        if isinstance(key, tuple):  # (msgid, plural index)
            if key[1] != 0:
                continue
            key = key[0]
        english = key.split("\x04", 1)[-1]  # drop msgctxt
        if english and isinstance(german, str):
            pairs.append((clean(german), clean(english)))
    return pairs


def read_tsv(path: Path) -> List[Pair]:
    """Pairs of a ``german<TAB>english`` file (further columns are ignored).

    Raises:
        DataError: the file is not UTF-8 or a non-empty line has no tab.
    """
    pairs = []
    for number, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise DataError(
                f"{str(path)!r} line {number} has no tab: write 'german<TAB>english' per line"
            )
        de, en = line.split("\t")[:2]
        pairs.append((clean(de), clean(en)))
    return pairs


def _read_lines(path: Path) -> List[str]:
    """The lines of a UTF-8 file (as ``str.splitlines`` of the whole text), read in chunks of
    :data:`READ_CHUNK_BYTES`. A line longer than :data:`MAX_LINE_CHARS` characters is returned
    as ``""`` (its pair is dropped, the line numbers of the others stay aligned) without ever
    being held whole, so memory stays bounded whatever the line structure (a file without any
    newline included).

    Raises:
        DataError: the file is not UTF-8 (the byte offset is named) or cannot be read.
    """
    lines: List[str] = []
    rest, skipping, skipped = "", False, 0
    for text, last in utf8_chunks(str(path), READ_CHUNK_BYTES):
        parts = (rest + text).splitlines(keepends=True)
        # the last part may go on in the next chunk (a "\r" there may be half a "\r\n")
        rest = parts.pop() if parts and not last else ""
        for part in parts:  # (when skipping, the first part ends the long line)
            line = "" if skipping else part.splitlines()[0]
            if len(line) > MAX_LINE_CHARS:
                line, skipped = "", skipped + 1
            lines.append(line)
            skipping = False
        if len(rest) > MAX_LINE_CHARS + 2:  # too long whatever its line break
            skipped += not skipping
            # keep a final line break: it ends the skipped line in the next round
            rest, skipping = (rest[-1] if rest[-1] in _LINE_BREAKS else ""), True
    if skipping:
        lines.append("")
    if skipped:
        log.warning(
            "%s: skipped %d line(s) longer than %d characters (no sentence pair is that long)",
            path,
            skipped,
            MAX_LINE_CHARS,
        )
    return lines


def site_package_catalogs() -> List[Path]:
    """German ``.mo`` catalogs shipped inside installed Python packages (up to 4 folders deep)."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    roots.update(getattr(site, "getsitepackages", list)())
    found = set()
    for root in sorted(roots):
        for depth in range(1, 5):
            pattern = os.path.join(root, *["*"] * depth, "locale", "de", "LC_MESSAGES", "*.mo")
            found.update(Path(p) for p in glob.glob(pattern))
    return sorted(found)


@dataclass(frozen=True)
class ParallelSource:
    """Where the pairs come from. ``parts``: ``[(kind, path), ...]`` with kind ``ding``,
    ``gettext``, ``site-packages``, ``tsv`` or ``parallel`` (path of the ``.de`` file)."""

    parts: tuple
    fingerprint: str

    @property
    def description(self) -> str:
        """E.g. ``"gettext (86 files), site-packages (13 files: django)"``."""
        counts: Dict[str, int] = {}
        packages: Dict[str, set] = {}
        for kind, path in self.parts:
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "site-packages":
                packages.setdefault(kind, set()).add(_package_of(path))
        return ", ".join(
            f"{k} ({n} file{'s' * (n != 1)}"
            f"{': ' + ', '.join(sorted(packages[k])) if k in packages else ''})"
            for k, n in counts.items()
        )


def _package_of(path: str) -> str:
    """The top-level package of a file under a site-packages folder (``django``)."""
    parts = Path(path).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1]
    return Path(path).parent.name


def resolve_sources(files: Sequence[str]) -> ParallelSource:
    """The user's files, or every built-in source present on this machine.

    Raises:
        ConfigError: a ``task.data.files`` pattern matches nothing, or a ``.de`` file has no
            ``.en`` partner (or the reverse).
        DataError: no file given and no built-in source is installed.
    """
    parts = []
    if files:
        for path in expand_data_files(list(files)):
            stem, suffix = os.path.splitext(path)
            if suffix not in (".de", ".en"):
                parts.append(("tsv", path))
                continue
            partner = stem + (".en" if suffix == ".de" else ".de")
            if not os.path.isfile(partner):
                raise ConfigError(
                    f"task.data.files entry {path!r} has no partner {partner!r}: "
                    "give line-aligned name.de + name.en, or a .tsv"
                )
            if ("parallel", stem + ".de") not in parts:
                parts.append(("parallel", stem + ".de"))
    else:
        if DING_PATH.is_file():
            parts.append(("ding", str(DING_PATH)))
        parts += [("gettext", str(p)) for p in sorted(SYSTEM_LOCALE.glob("*.mo"))]
        parts += [("site-packages", str(p)) for p in site_package_catalogs()]
        if not parts:
            raise DataError(
                f"no German-English text found ({DING_PATH}, {SYSTEM_LOCALE}/*.mo and site-packages "
                "locale catalogs are all missing): apt-get install trans-de-en, or set "
                "task.data.files to a german<TAB>english .tsv"
            )
    fingerprint = files_fingerprint((f"{kind}\x00{os.path.abspath(p)}", p) for kind, p in parts)
    return ParallelSource(parts=tuple(parts), fingerprint=fingerprint)


def read_pairs(source: ParallelSource, max_chars: int) -> Tuple[List[Pair], Dict[str, int]]:
    """All usable pairs, de-duplicated and sorted (a deterministic order).

    A pair is kept when both sides are non-empty, differ (untranslated catalog entries are
    dropped) and have at most ``max_chars`` characters. An unreadable ``.mo`` is skipped with a
    warning (one Debian catalog in a legacy charset must not stop the run).

    Returns:
        ``(pairs, per_kind)``: pairs as ``(german, english)``, and the kept pairs per source kind
        (counted before de-duplication across kinds).

    Raises:
        DataError: a user file is unreadable or malformed.
    """
    unique: Dict[Pair, None] = {}
    per_kind: Dict[str, int] = {}
    for kind, path in source.parts:
        if kind == "ding":
            pairs = read_ding(Path(path))
        elif kind in ("gettext", "site-packages"):
            try:
                pairs = read_mo(Path(path))
            except DataError as exc:
                log.warning("skipped: %s", exc)
                continue
        elif kind == "parallel":
            de_lines = _read_lines(Path(path))
            en_lines = _read_lines(Path(os.path.splitext(path)[0] + ".en"))
            if len(de_lines) != len(en_lines):
                raise DataError(
                    f"{path!r} has {len(de_lines)} lines but its .en partner has "
                    f"{len(en_lines)}: the files must be line-aligned"
                )
            pairs = [(clean(d), clean(e)) for d, e in zip(de_lines, en_lines)]
        else:
            pairs = read_tsv(Path(path))
        kept = [p for p in pairs if _keep(p[0], p[1], max_chars)]
        per_kind[kind] = per_kind.get(kind, 0) + len(kept)
        unique.update(dict.fromkeys(kept))
    return sorted(unique), per_kind
