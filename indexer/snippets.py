"""Chunks, definitions and queries for snippet retrieval (prompt context).

A file is cut into windows of ``CHUNK_LINES`` lines, side by side (overlapping windows
doubled the FTS5 table and its insert time for no measured gain); each chunk goes into
an FTS5 table.  Definitions (functions, classes, methods,
types) are found with per-language patterns and stored by name.  At the cursor, the
query is the identifiers of the lines around it; results too similar to the cursor's own
window (Jaccard similarity of identifier sets) are dropped, like Tabby and Continue do,
because the model already sees them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHUNK_LINES = 20
QUERY_TERMS = 8  # rarest identifiers of the cursor's window that form a snippet query
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{1,}")
KEYWORDS = frozenset("""
and as assert async await break class continue def del elif else except finally for from
global if import in is lambda nonlocal not or pass raise return try while with yield None
True False self cls const let var function return new this typeof void fn pub impl struct
enum mut use mod match func package type interface int str bool float string public private
protected static final void char long short double unsigned signed auto include define
""".split())

_DEF_PATTERNS = {
    "python": re.compile(r"^[ \t]*(?:async[ \t]+)?(def|class)[ \t]+([A-Za-z_]\w*)", re.M),
    "javascript": re.compile(r"^[ \t]*(?:export[ \t]+)?(?:default[ \t]+)?(?:async[ \t]+)?"
                             r"(function\*?|class)[ \t]+([A-Za-z_$][\w$]*)", re.M),
    "typescript": re.compile(r"^[ \t]*(?:export[ \t]+)?(?:default[ \t]+)?(?:abstract[ \t]+)?"
                             r"(?:async[ \t]+)?(function\*?|class|interface|type|enum)"
                             r"[ \t]+([A-Za-z_$][\w$]*)", re.M),
    "go": re.compile(r"^(func|type)[ \t]+(?:\([^)]*\)[ \t]*)?([A-Za-z_]\w*)", re.M),
    "rust": re.compile(r"^[ \t]*(?:pub(?:\([^)]*\))?[ \t]+)?(?:async[ \t]+)?(?:unsafe[ \t]+)?"
                       r"(fn|struct|enum|trait|type|mod)[ \t]+([A-Za-z_]\w*)", re.M),
    "java": re.compile(r"^[ \t]*(?:(?:public|private|protected|static|final|abstract)[ \t]+)*"
                       r"(class|interface|enum|record)[ \t]+([A-Za-z_]\w*)", re.M),
    # bounded repeats: unbounded ones made a half-written file (lines of "f(" and no ")")
    # quadratic, seconds per 60 kB
    "c": re.compile(r"^(?:[A-Za-z_][\w \t\*]{0,120}?[ \t\*])?([A-Za-z_]\w*)[ \t]*\(([^;{]{0,400})\)[ \t]*\{?$",
                    re.M),
    "lua": re.compile(r"^[ \t]*(?:local[ \t]+)?(function)[ \t]+([A-Za-z_][\w.:]*)", re.M),
    "ruby": re.compile(r"^[ \t]*(def|class|module)[ \t]+([A-Za-z_][\w.?!]*)", re.M),
}
_DEF_PATTERNS["javascriptreact"] = _DEF_PATTERNS["javascript"]
_DEF_PATTERNS["typescriptreact"] = _DEF_PATTERNS["typescript"]
_DEF_PATTERNS["cpp"] = _DEF_PATTERNS["c"]


@dataclass(frozen=True)
class Chunk:
    start_line: int  # 0-based, inclusive
    end_line: int  # exclusive
    text: str


@dataclass(frozen=True)
class Definition:
    name: str
    kind: str
    line: int  # 0-based


@dataclass(frozen=True)
class Snippet:
    """A piece of repository code offered as prompt context."""

    path: str
    start_line: int
    end_line: int
    text: str
    score: float
    reason: str  # "similar" or "definition of NAME"


def chunks(text: str, lines_per_chunk: int = CHUNK_LINES) -> list[Chunk]:
    lines = text.splitlines(keepends=True)
    if not lines:
        return []
    stride = lines_per_chunk  # windows side by side: the FTS table holds the text once
    out = []
    for start in range(0, len(lines), stride):
        end = min(len(lines), start + lines_per_chunk)
        body = "".join(lines[start:end])
        if body.strip():
            out.append(Chunk(start, end, body))
        if end == len(lines):
            break
    return out


def definitions(text: str, language: str) -> list[Definition]:
    pattern = _DEF_PATTERNS.get(language)
    if pattern is None:
        return []
    out = []
    line, pos = 0, 0
    for m in pattern.finditer(text):
        line += text.count("\n", pos, m.start())
        pos = m.start()
        if language in ("c", "cpp"):
            kind, name = "function", m.group(1)
            if name in KEYWORDS or name in ("if", "while", "for", "switch", "return"):
                continue
        else:
            kind, name = m.group(1), m.group(2)
        out.append(Definition(name, kind, line))
    return out


def identifiers(text: str) -> list[str]:
    return [w for w in IDENT.findall(text) if w not in KEYWORDS]


def fts_query(words: list[str]) -> str:
    """An FTS5 MATCH expression: the given words, quoted and OR-ed."""
    return " OR ".join(f'"{w}"' for w in dict.fromkeys(words))


def jaccard(a: set[str], b: set[str]) -> float:
    if not a or not b:
        return 0.0
    return len(a & b) / len(a | b)


def used_names(text: str) -> list[str]:
    """Names called or referenced near the cursor, most recent first."""
    out: dict[str, None] = {}
    for w in reversed(identifiers(text)):
        out.setdefault(w, None)
    return list(out)


COMMENT = {"python": "#", "ruby": "#", "shellscript": "#", "toml": "#", "yaml": "#", "r": "#",
           "julia": "#", "makefile": "#", "dockerfile": "#", "lua": "--", "sql": "--", "html": None,
           "css": None, "markdown": None, "json": None}


def render_context(snippets: list[Snippet], language: str, max_chars: int) -> str:
    """Snippets as code the model reads before the file: each under a comment naming
    its path (the convention of Copilot-style prompts), within ``max_chars``."""
    mark = COMMENT.get(language, "//")
    if mark is None or not snippets:
        return ""
    out, used = [], 0
    for sn in snippets:
        block = f"{mark} {sn.path}\n{sn.text.rstrip()}\n\n"
        if used + len(block) > max_chars:
            break
        out.append(block)
        used += len(block)
    return "".join(out)
