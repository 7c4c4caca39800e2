"""Positions and the text around the cursor.

Positions are converted once, here, at the protocol edge: LSP positions count code
units of the negotiated encoding (utf-16 by default, utf-8 or utf-32 when agreed);
inside the daemon, offsets count code points.  Lines are split the LSP way (``\\n``,
``\\r\\n``, ``\\r``).  A line past the end of the document is an error; a character past
the end of its line is clamped to the line's end, as the LSP specification says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_EOL = re.compile(r"\r\n|\r|\n")


class PositionError(ValueError):
    """A position that does not exist in the document."""


def encoding_name(encoding) -> str:
    """The negotiated position encoding as LSP spells it: pygls hands over either a str or
    a PositionEncodingKind, whose str() is "PositionEncodingKind.Utf16"."""
    return str(getattr(encoding, "value", encoding) or "utf-16")


def split_lines(text: str) -> list[str]:
    """The lines of ``text`` at LSP's line breaks (not str.splitlines', which also breaks
    at form feeds and U+2028)."""
    return _EOL.split(text)


def _units(ch: str, encoding: str) -> int:
    cp = ord(ch)
    if encoding == "utf-8":
        return 1 if cp < 0x80 else 2 if cp < 0x800 else 3 if cp < 0x10000 else 4
    if encoding == "utf-32":
        return 1
    return 2 if cp >= 0x10000 else 1  # utf-16


def line_start_offset(text: str, line: int) -> int:
    """Code-point offset where ``line`` starts; PositionError past the last line."""
    if line < 0:
        raise PositionError(f"line {line} is negative")
    if line == 0:
        return 0
    if "\r" not in text:  # "\n" only: the line's start by counting in C, not a Python loop
        return _nth_newline_end(text, line)
    count = 0
    for m in _EOL.finditer(text):
        count += 1
        if count == line:
            return m.end()
    raise PositionError(f"line {line} is past the end of the document ({count + 1} lines)")


def _nth_newline_end(text: str, n: int) -> int:
    """Offset just after the ``n``-th ``\n`` (n >= 1), counted in C: whole 64 kB blocks
    first, then a binary search inside the block that holds it."""
    lo, need, block = 0, n, 1 << 16
    while True:
        hi = min(len(text), lo + block)
        found = text.count("\n", lo, hi)
        if found >= need:
            break
        if hi == len(text):
            raise PositionError(f"line {n} is past the end of the document ({n - need + found + 1} lines)")
        need -= found
        lo = hi
    base = lo  # the smallest end with `need` newlines in text[base:end]
    while lo < hi:
        mid = (lo + hi) // 2
        if text.count("\n", base, mid) >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def offset_at(text: str, line: int, character: int, encoding: str = "utf-16") -> int:
    """Code-point offset of an LSP position."""
    if character < 0:
        raise PositionError(f"character {character} is negative")
    start = line_start_offset(text, line)
    m = _EOL.search(text, start)
    end = m.start() if m else len(text)
    if encoding == "utf-32":
        return min(start + character, end)
    units = 0
    i = start
    while i < end and units < character:
        units += _units(text[i], encoding)
        i += 1
    return i


def position_at(text: str, offset: int, encoding: str = "utf-16") -> tuple[int, int]:
    """LSP (line, character) of a code-point offset."""
    if "\r" not in text:
        start = text.rfind("\n", 0, offset) + 1
        return text.count("\n", 0, offset), sum(_units(c, encoding) for c in text[start:offset])
    line = 0
    start = 0
    for m in _EOL.finditer(text, 0, offset):
        if m.end() > offset:
            break
        line += 1
        start = m.end()
    return line, sum(_units(c, encoding) for c in text[start:offset])


@dataclass(frozen=True)
class Cursor:
    """The document split at the cursor."""

    prefix: str
    suffix: str
    offset: int
    line_start: int  # offset of the start of the cursor's line
    line_end: int  # offset of the end of the cursor's line


def cursor_at(text: str, line: int, character: int, encoding: str = "utf-16") -> Cursor:
    start = line_start_offset(text, line)
    offset = offset_at(text, line, character, encoding)
    m = _EOL.search(text, offset)
    return Cursor(text[:offset], text[offset:], offset, start, m.start() if m else len(text))
