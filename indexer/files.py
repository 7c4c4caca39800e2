"""Reading repository files safely: size cap, binary and encoding checks, language.

The first piece of the indexer: every path the daemon reads from disk goes through
``read_source``, which either returns text or raises ``SourceError`` with a reason a
user can read (missing, a directory, too large, binary, not UTF-8).  No torch here.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MAX_BYTES = 2_000_000

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
    """A file that cannot serve as source text."""


def language_of(path: str | Path) -> str:
    p = Path(path)
    if p.name in ("Makefile", "makefile"):
        return "makefile"
    if p.name == "Dockerfile":
        return "dockerfile"
    return LANGUAGES.get(p.suffix.lower(), "plaintext")


def looks_binary(data: bytes) -> bool:
    """NUL bytes in the first 8 KiB: what git and ripgrep use."""
    return b"\x00" in data[:8192]


def decode_source(data: bytes, name: str = "text") -> str:
    if looks_binary(data):
        raise SourceError(f"{name} is a binary file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{name} is not valid UTF-8 (byte {exc.start})") from exc


def read_source(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise SourceError(f"{p} is not a regular file")
        if size > max_bytes:
            raise SourceError(f"{p} is {size} bytes, over the {max_bytes}-byte limit")
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise SourceError(f"{p} does not exist") from exc
    except PermissionError as exc:
        raise SourceError(f"{p} is not readable") from exc
    except IsADirectoryError as exc:
        raise SourceError(f"{p} is a directory") from exc
    return decode_source(data, str(p))
