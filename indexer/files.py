"""Reading repository files safely: size cap, binary and encoding checks, language.

The first piece of the indexer: every path the daemon reads from disk goes through
``read_source``, which either returns text or raises ``SourceError`` with a reason a
user can read (missing, a directory, too large, binary, not UTF-8).  No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MAX_BYTES = 2_000_000
# A Jupyter notebook's file is mostly its outputs (images in base64, tables); what the index
# holds of it is its code cells (``notebook_code``), so its file may be this many times the
# size limit, the limit applying to the code.
NOTEBOOK_SIZE_FACTOR = 16
NOTEBOOK_LANGUAGES = {"python3": "python", "ipython": "python", "ipython3": "python"}
# Cell magics whose body is not the kernel's language (IPython's): such cells are left out of a
# notebook's code, as a cell's prompt leaves them out (VS Code gives them their own language).
FOREIGN_CELL_MAGICS = frozenset({"bash", "sh", "script", "html", "javascript", "js", "latex", "markdown", "svg",
                                 "perl", "ruby", "sql", "writefile", "file", "python2", "pypy"})

LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".jsx": "javascriptreact",
    ".ts": "typescript", ".tsx": "typescriptreact", ".go": "go", ".rs": "rust",
    ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".java": "java",
    ".kt": "kotlin", ".rb": "ruby", ".php": "php", ".cs": "csharp", ".swift": "swift",
    ".lua": "lua", ".sh": "shellscript", ".md": "markdown", ".toml": "toml",
    ".yaml": "yaml", ".yml": "yaml", ".json": "json", ".sql": "sql", ".html": "html",
    ".css": "css", ".scala": "scala", ".r": "r", ".jl": "julia", ".zig": "zig",
}


class SourceError(ValueError):
    """A file that cannot serve as source text; ``reason`` a short name for it (the index's
    skip counters: binary, not_utf8, not_notebook, too_large)."""

    def __init__(self, message: str, reason: str = "unreadable"):
        super().__init__(message)
        self.reason = reason


def language_of(path: str | Path) -> str:
    p = Path(path)
    if p.name in ("Makefile", "makefile"):
        return "makefile"
    if p.name == "Dockerfile":
        return "dockerfile"
    return LANGUAGES.get(p.suffix.lower(), "plaintext")


def is_notebook(path: str | Path) -> bool:
    return str(path).lower().endswith(".ipynb")


def max_size(path: str | Path, max_bytes: int) -> int:
    """The largest file at ``path`` the index reads (a notebook's file may be larger)."""
    return max_bytes * NOTEBOOK_SIZE_FACTOR if is_notebook(path) else max_bytes


def index_language(path: str | Path) -> str:
    """The language of what the index holds for ``path``: a notebook's code is Python unless
    the notebook says otherwise (``notebook_code``)."""
    return "python" if is_notebook(path) else language_of(path)


def foreign_cell(source: str) -> bool:
    """Whether a code cell's ``source`` is another language's under a cell magic (``%%bash``)."""
    first = source.lstrip().split("\n", 1)[0]
    return first.startswith("%%") and first[2:].split(" ", 1)[0].strip() in FOREIGN_CELL_MAGICS


def join_cells(sources) -> str:
    """Code cells' sources as the index holds a notebook: each followed by a blank line, as a
    cell's prompt joins the cells around it; blank cells and cells of another language under a
    cell magic (``foreign_cell``) left out."""
    return "".join(s.rstrip("\n") + "\n\n" for s in sources if s.strip() and not foreign_cell(s))


def notebook_code(text: str, name: str = "notebook") -> tuple[str, str]:
    """A Jupyter notebook's (nbformat 4, or 3's worksheets) code cells in order, each followed
    by a blank line, as a cell's prompt joins them (markdown, raw cells, outputs and cells of
    another language under a cell magic left out), and its language (the kernel's, else
    Python).  SourceError when ``text`` is not one."""
    try:
        nb = json.loads(text)
    except ValueError as exc:
        raise SourceError(f"{name} is not a Jupyter notebook (invalid JSON: {exc})",
                          "not_notebook") from exc
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if cells is None and isinstance(nb, dict) and isinstance(nb.get("worksheets"), list):
        cells = [c for ws in nb["worksheets"] if isinstance(ws, dict) for c in ws.get("cells") or []]
    if not isinstance(cells, list):
        raise SourceError(f"{name} is not a Jupyter notebook (no cells)", "not_notebook")
    meta = nb.get("metadata") if isinstance(nb.get("metadata"), dict) else {}
    code = [c for c in cells if isinstance(c, dict) and c.get("cell_type") == "code"]

    def said(key: str, field: str):
        info = meta.get(key)
        return info.get(field) if isinstance(info, dict) else None

    # the kernel's language (nbformat 4), else the notebook's or its first code cell's (3)
    named = [said("kernelspec", "language"), said("language_info", "name"), meta.get("language"),
             code[0].get("language") if code else None]
    language = next((x.strip().lower() for x in named if isinstance(x, str) and x.strip()), "python")
    sources = []
    for cell in code:
        source = cell.get("source", cell.get("input", ""))
        if isinstance(source, list):
            source = "".join(x for x in source if isinstance(x, str))
        if isinstance(source, str):
            sources.append(source)
    return join_cells(sources), NOTEBOOK_LANGUAGES.get(language, language)


def looks_binary(data: bytes) -> bool:
    """NUL bytes in the first 8 KiB: what git and ripgrep use."""
    return b"\x00" in data[:8192]


def decode_source(data: bytes, name: str = "text") -> str:
    if looks_binary(data):
        raise SourceError(f"{name} is a binary file", "binary")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{name} is not valid UTF-8 (byte {exc.start})", "not_utf8") from exc


def read_source(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise SourceError(f"{p} is not a regular file")
        if size > max_bytes:
            raise SourceError(f"{p} is {size} bytes, over the {max_bytes}-byte limit", "too_large")
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise SourceError(f"{p} does not exist") from exc
    except PermissionError as exc:
        raise SourceError(f"{p} is not readable") from exc
    except IsADirectoryError as exc:
        raise SourceError(f"{p} is a directory") from exc
    return decode_source(data, str(p))
